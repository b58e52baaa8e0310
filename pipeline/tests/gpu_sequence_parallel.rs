//! Sequence parallelism over NCCL on two CUDA GPUs against one GPU: a `tiny` streaming session
//! through a rolling window with a sink (several chunks, f32 and bf16 weights), and one
//! lingbot-1.3b block on one 480×832 chunk through its KV cache with random bf16 weights.
//! Prints max abs difference, relative L2 and whether the results are bit-identical; skipped,
//! with the reason printed, unless NCCL and two CUDA devices are present.

mod common;

use common::random_times as rnd;
use std::sync::{Arc, Once};
use std::time::Instant;

use kernels::{DType, Device, KvCache, RopeTable, Tensor};
use pipeline::camera::Controls;
use pipeline::model::{BlockInputs, KvMode, WanBlock, ROPE_POSITIONS};
use pipeline::rng::NormalRng;
use pipeline::{
    ChunkInputs, Engine, EngineConfig, EngineGroup, ModelConfig, ModelLoader, WanModel, WeightStore,
};
use sp::{Communicator, NcclComm, TokenShard, Ulysses};

/// Why these checks cannot run here, if they cannot.
fn skip_reason() -> Option<String> {
    static ENV: Once = Once::new();
    ENV.call_once(|| {
        std::env::set_var("WORLDLINE_POISON", "1");
        // NVLink multicast stays off on shared hosts.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
    });
    if let Err(e) = sp::nccl_library() {
        return Some(e.to_string());
    }
    for g in 0..2 {
        if let Err(e) = Device::Cuda(g).ensure_available() {
            return Some(format!("cuda:{g}: {e}"));
        }
    }
    None
}

/// (max abs difference, relative L2, bit-identical) of `got` against `want`.
fn compare(got: &[f32], want: &[f32]) -> (f64, f64, bool) {
    assert_eq!(got.len(), want.len());
    let mut max = 0f64;
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let d = (*g as f64 - *w as f64).abs();
        max = if d.is_nan() {
            f64::INFINITY
        } else {
            max.max(d)
        };
        num += d * d;
        den += (*w as f64).powi(2);
    }
    let rel = (num / den).sqrt();
    let rel = if rel.is_finite() { rel } else { f64::INFINITY };
    let same = got
        .iter()
        .zip(want)
        .all(|(g, w)| g.to_bits() == w.to_bits());
    (max, rel, same)
}

/// Chunks of 3 latent frames in a window of 7 with 1 sink: from the third chunk on, every chunk
/// evicts. 48×48 gives 27 tokens a chunk, padded to 28 on two ranks.
fn session() -> EngineConfig {
    EngineConfig {
        height: 48,
        width: 48,
        chunk_frames: 3,
        window_frames: 7,
        sink_frames: 1,
        ..EngineConfig::tiny(3)
    }
}

fn controls(i: usize) -> ChunkInputs {
    let c = [
        Controls {
            w: true,
            ..Default::default()
        },
        Controls {
            d: true,
            mouse_dx: 30.0,
            ..Default::default()
        },
        Controls {
            w: true,
            i: true,
            ..Default::default()
        },
    ];
    ChunkInputs {
        controls: c[i % c.len()],
    }
}

const CHUNKS: usize = 4;

#[test]
fn tiny_on_two_gpus_matches_one() {
    if let Some(why) = skip_reason() {
        println!("skipping tiny on two GPUs: {why}");
        return;
    }
    let mcfg = ModelConfig::tiny();
    let prompt = Tensor::from_vec(
        NormalRng::new(9).normals(6 * mcfg.text_dim),
        &[6, mcfg.text_dim],
    )
    .expect("prompt");
    // Bit-identical is the goal; the bound is the GPU-against-CPU tolerance of tests/gpu.rs.
    for (dtype, tol) in [(DType::F32, 3e-3), (DType::BF16, 3e-2)] {
        let load: Arc<ModelLoader> = {
            let mcfg = mcfg.clone();
            Arc::new(move |d| WanModel::load(&mcfg, &WeightStore::random(5, dtype).on_device(d)))
        };
        let mut one = Engine::new(Arc::new(load(Device::Cuda(0)).expect("model")), session())
            .expect("engine");
        one.set_prompt(&prompt).expect("prompt");
        let want: Vec<Vec<f32>> = (0..CHUNKS)
            .map(|i| {
                one.next_chunk(&controls(i))
                    .expect("chunk")
                    .latents
                    .to_vec_f32()
            })
            .collect();
        drop(one);

        let started = Instant::now();
        let mut group = EngineGroup::nccl(&mcfg, load, session(), &[0, 1]).expect("group");
        println!(
            "tiny {dtype:?}: two-GPU group ready in {:?}",
            started.elapsed()
        );
        group.set_prompt(&prompt).expect("prompt");
        let mut worst = 0f64;
        for (i, w) in want.iter().enumerate() {
            let chunk = group.next_chunk(&controls(i)).expect("chunk");
            assert_eq!(chunk.latents.device(), Device::Cuda(0));
            let (max, rel, same) = compare(&chunk.latents.to_vec_f32(), w);
            println!(
                "tiny {dtype:?} chunk {i}: 2 GPUs vs 1: max abs {max:.3e}, rel L2 {rel:.3e}, \
                 bit-identical {same}"
            );
            worst = worst.max(rel);
        }
        let stats = group.comm_stats();
        println!("tiny {dtype:?}: rank 0 sent {:?}", stats[0]);
        assert!(worst < tol, "rel L2 {worst:.3e} ≥ {tol:e}");
    }
}

#[test]
fn lingbot_1_3b_block_on_two_gpus_matches_one() {
    if let Some(why) = skip_reason() {
        println!("skipping the lingbot-1.3b block on two GPUs: {why}");
        return;
    }
    let cfg = ModelConfig::lingbot_1_3b();
    // One chunk of 3 latent frames at 480×832: 3 × 30 × 52 tokens.
    let grid = [3, 30, 52];
    let frame_tokens = grid[1] * grid[2];
    let tokens: usize = grid.iter().product();
    let (x, e0, text, cond) = (
        rnd(1, &[tokens, cfg.dim], 1.0),
        rnd(2, &[6, cfg.dim], 0.1),
        rnd(3, &[cfg.text_len, cfg.dim], 1.0),
        rnd(4, &[tokens, cfg.dim], 1.0),
    );
    // One rank's block forward: `comm` None is the single GPU. Returns the rank's real rows.
    let run = |d: Device, comm: Option<&dyn Communicator>| -> Vec<f32> {
        let cards = comm.map_or(1, |c| c.world_size());
        let rope = RopeTable::new(cfg.head_dim(), ROPE_POSITIONS, 1e4).expect("rope");
        let store = WeightStore::random(0, DType::BF16).on_device(d);
        let block = WanBlock::load(&store.root().pp("blocks").pp(0), &cfg).expect("block");
        let up = |t: &Tensor| t.to_device(d).expect("up");
        let shard = match comm {
            Some(c) => TokenShard::new(tokens, cards, c.rank()).expect("shard"),
            None => TokenShard::new(tokens, 1, 0).expect("shard"),
        };
        let kv = block.cross_attn.text_kv(&up(&text)).expect("text");
        let cam = block
            .camera
            .as_ref()
            .expect("camera layers")
            .scale_shift(&up(&shard.take(&cond).expect("cond")))
            .expect("cam");
        let mut cache = KvCache::new(
            18,
            6,
            frame_tokens,
            cfg.num_heads / cards,
            cfg.head_dim(),
            DType::BF16,
        )
        .and_then(|c| c.on_device(d))
        .expect("cache");
        let e0 = up(&e0);
        let inp = BlockInputs {
            e0: &e0,
            grid,
            t_offset: 0,
            rope: &rope,
        };
        let ulysses = comm.map(|c| Ulysses::new(c, tokens).expect("ulysses"));
        let mode = KvMode::Cache {
            cache: &mut cache,
            first_frame: 0,
        };
        let xs = up(&shard.take(&x).expect("x"));
        let started = Instant::now();
        let y = block
            .forward_with(&xs, &inp, &kv, Some(&cam), mode, false, ulysses.as_ref())
            .expect("forward")
            .expect("out");
        let y = y
            .narrow(0, 0, shard.real())
            .expect("real rows")
            .to_vec_f32();
        println!(
            "lingbot-1.3b block on {d} ({cards} card(s)): {:?} including the host copy",
            started.elapsed()
        );
        y
    };
    let want = run(Device::Cuda(0), None);
    let comms = NcclComm::group(&[0, 1], pipeline::parallel::COLLECTIVE_TIMEOUT).expect("group");
    let parts: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|c| s.spawn(|| run(c.device(), Some(c as &dyn Communicator))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    });
    let got: Vec<f32> = parts.concat();
    let (max, rel, same) = compare(&got, &want);
    println!(
        "lingbot-1.3b block, 480×832 chunk, bf16: 2 GPUs vs 1: max abs {max:.3e}, rel L2 \
         {rel:.3e}, bit-identical {same}; rank 0 sent {:?}",
        comms[0].stats()
    );
    assert!(rel < 2e-2, "rel L2 {rel:.3e}");
}

/// The head of lingbot-14b (5120 → 64) on a 480×832 chunk: cuBLASLt computes a 2340-row shard
/// of that GEMM with another kernel than the 4680-row chunk, so the head runs on the gathered
/// chunk; every rank's output must then have the one-card bits.
#[test]
fn lingbot_14b_head_on_two_gpus_matches_one() {
    use pipeline::model::{Head, Linear};
    if let Some(why) = skip_reason() {
        println!("skipping the lingbot-14b head on two GPUs: {why}");
        return;
    }
    let cfg = ModelConfig::lingbot_14b();
    let tokens = 3 * 30 * 52;
    let out = cfg.out_dim * cfg.patch.iter().product::<usize>();
    let rnd = |seed, shape: &[usize]| {
        Tensor::from_vec(NormalRng::new(seed).normals(shape.iter().product()), shape).expect("t")
    };
    let (h, e) = (rnd(1, &[tokens, cfg.dim]), rnd(2, &[cfg.dim]));
    let head_on = |d: Device| {
        let store = WeightStore::random(0, DType::BF16).on_device(d);
        let vb = store.root().pp("head");
        Head {
            head: Linear::load(&vb.pp("head"), cfg.dim, out).expect("head"),
            modulation: vb
                .get_f32(&[1, 2, cfg.dim], "modulation")
                .expect("modulation"),
        }
    };
    let one = head_on(Device::Cuda(0));
    let up = |t: &Tensor, d| t.to_device(d).expect("up");
    let want = one
        .forward(
            &up(&h, Device::Cuda(0)),
            &up(&e, Device::Cuda(0)),
            cfg.eps,
            None,
        )
        .expect("head")
        .to_vec_f32();
    let comms = NcclComm::group(&[0, 1], pipeline::parallel::COLLECTIVE_TIMEOUT).expect("group");
    let got: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|c| {
                let (h, e) = (&h, &e);
                s.spawn(move || {
                    let d = c.device();
                    let u = Ulysses::new(c, tokens).expect("ulysses");
                    let head = head_on(d);
                    let shard = u.shard.take(h).expect("shard");
                    head.forward(&up(&shard, d), &up(e, d), cfg.eps, Some(&u))
                        .expect("head")
                        .to_vec_f32()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    });
    for (rank, y) in got.iter().enumerate() {
        let (max, rel, same) = compare(y, &want);
        println!(
            "lingbot-14b head, rank {rank} of 2 vs 1 GPU: max abs {max:.3e}, rel L2 {rel:.3e}, \
             bit-identical {same}"
        );
        assert!(same, "rank {rank}: the head differs from one card's");
    }
}
