//! The DiT on each GPU backend against the CPU reference: a `tiny` streaming run (several chunks
//! through the KV cache) and one lingbot-1.3b block on a 480×832 latent frame, in f32 (TF32
//! GEMMs) and bf16 weights. Skipped, with the reason printed, where no GPU is present.

mod common;

use common::{gpus, random_times as rnd, rel_l2};

use std::sync::Arc;

use kernels::{DType, Device, RopeTable, Tensor};
use pipeline::camera::Controls;
use pipeline::model::{BlockInputs, KvMode, WanBlock, ROPE_POSITIONS};
use pipeline::rng::NormalRng;
use pipeline::{ChunkInputs, Engine, EngineConfig, ModelConfig, WanModel, WeightStore};

fn run(dev: Device, dtype: DType) -> Vec<Vec<f32>> {
    let cfg = ModelConfig::tiny();
    let store = WeightStore::random(5, dtype).on_device(dev);
    let model = Arc::new(WanModel::load(&cfg, &store).expect("model"));
    let ecfg = EngineConfig {
        height: 64,
        width: 96,
        chunk_frames: 2,
        window_frames: 5,
        sink_frames: 1,
        ..EngineConfig::tiny(3)
    };
    let mut engine = Engine::new(model, ecfg).expect("engine");
    let ctx = Tensor::from_vec(
        NormalRng::new(9).normals(12 * cfg.text_dim),
        &[12, cfg.text_dim],
    )
    .expect("ctx");
    engine.set_prompt(&ctx).expect("prompt");
    let first =
        Tensor::from_vec(NormalRng::new(8).normals(16 * 8 * 12), &[16, 8, 12]).expect("first");
    engine.set_first_frame(&first).expect("first frame");
    let keys = [
        Controls {
            w: true,
            ..Default::default()
        },
        Controls {
            d: true,
            mouse_dy: 9.0,
            ..Default::default()
        },
    ];
    (0..4)
        .map(|i| {
            let c = engine
                .next_chunk(&ChunkInputs {
                    controls: keys[i % 2],
                })
                .expect("chunk");
            assert_eq!(c.latents.device(), dev);
            c.latents.to_vec_f32()
        })
        .collect()
}

#[test]
fn tiny_stream_matches_the_cpu() {
    for dev in gpus() {
        for (dtype, tol) in [(DType::F32, 3e-3), (DType::BF16, 3e-2)] {
            let want = run(Device::Cpu, dtype);
            let got = run(dev, dtype);
            for (c, (g, w)) in got.iter().zip(&want).enumerate() {
                let e = rel_l2(g, w);
                println!("tiny {dtype:?} chunk {c} on {dev}: rel L2 {e:.2e}");
                assert!(e < tol, "chunk {c}: {e:.3e} ≥ {tol:e}");
            }
        }
    }
}

#[test]
fn lingbot_1_3b_block_matches_the_cpu() {
    for dev in gpus() {
        let cfg = ModelConfig::lingbot_1_3b();
        let grid = [1, 30, 52];
        let tokens: usize = grid.iter().product();
        let rope = RopeTable::new(cfg.head_dim(), ROPE_POSITIONS, 1e4).expect("rope");
        let (x, e0, text, cond) = (
            rnd(1, &[tokens, cfg.dim], 1.0),
            rnd(2, &[6, cfg.dim], 0.1),
            rnd(3, &[cfg.text_len, cfg.dim], 1.0),
            rnd(4, &[tokens, cfg.dim], 1.0),
        );
        // Attention at head_dim 128 runs in bf16 on the GPU, so even the f32 run has bf16 operands.
        for (dtype, tol) in [(DType::F32, 1e-2), (DType::BF16, 2e-2)] {
            let out = |d: Device| {
                let store = WeightStore::random(0, dtype).on_device(d);
                let block = WanBlock::load(&store.root().pp("blocks").pp(0), &cfg).expect("block");
                let up = |t: &Tensor| t.to_device(d).expect("up");
                let kv = block.cross_attn.text_kv(&up(&text)).expect("text");
                let cam = block
                    .camera
                    .as_ref()
                    .expect("cam")
                    .scale_shift(&up(&cond))
                    .expect("cam");
                let e0 = up(&e0);
                let inp = BlockInputs {
                    e0: &e0,
                    grid,
                    t_offset: 0,
                    rope: &rope,
                };
                let y = block
                    .forward(&up(&x), &inp, &kv, Some(&cam), KvMode::Full, false)
                    .expect("forward")
                    .expect("out");
                y.to_vec_f32()
            };
            let e = rel_l2(&out(dev), &out(Device::Cpu));
            println!("lingbot-1.3b block {dtype:?} on {dev}: rel L2 {e:.2e}");
            assert!(e < tol, "{e:.3e} ≥ {tol:e}");
        }
    }
}

/// The same block through a KV cache that keeps an fp8 copy, so self-attention runs in fp8 (the
/// Hopper kernel on the GPU, the dequantizing reference on the CPU): bf16 weights, a cache
/// already holding two frames. The GPU also rounds the softmax weights to e4m3, hence a looser
/// bound than the bf16 run's.
#[test]
fn lingbot_1_3b_block_with_fp8_attention_matches_the_cpu() {
    for dev in gpus() {
        let cfg = ModelConfig::lingbot_1_3b();
        let grid = [1, 30, 52];
        let tokens: usize = grid.iter().product();
        let rope = RopeTable::new(cfg.head_dim(), ROPE_POSITIONS, 1e4).expect("rope");
        let (x, e0, text, held) = (
            rnd(1, &[tokens, cfg.dim], 1.0),
            rnd(2, &[6, cfg.dim], 0.1),
            rnd(3, &[cfg.text_len, cfg.dim], 1.0),
            rnd(5, &[2 * tokens, cfg.num_heads, cfg.head_dim()], 1.0),
        );
        let out = |d: Device| {
            let store = WeightStore::random(0, DType::BF16).on_device(d);
            let block = WanBlock::load(&store.root().pp("blocks").pp(0), &cfg).expect("block");
            let up = |t: &Tensor| t.to_device(d).expect("up");
            let kv = block.cross_attn.text_kv(&up(&text)).expect("text");
            let dtype = if d.is_cpu() { DType::F32 } else { DType::BF16 };
            let mut cache =
                kernels::KvCache::new(4, 1, tokens, cfg.num_heads, cfg.head_dim(), dtype)
                    .and_then(|c| c.on_device(d))
                    .and_then(|c| c.with_fp8_attention())
                    .expect("cache");
            let h = up(&held).to_dtype(dtype).expect("dtype");
            cache.write(0, &h, &h).expect("held frames");
            let e0 = up(&e0);
            let inp = BlockInputs {
                e0: &e0,
                grid,
                t_offset: 2,
                rope: &rope,
            };
            let mode = KvMode::Cache {
                cache: &mut cache,
                first_frame: 2,
            };
            let y = block
                .forward(&up(&x), &inp, &kv, None, mode, false)
                .expect("forward")
                .expect("out");
            y.to_vec_f32()
        };
        let e = rel_l2(&out(dev), &out(Device::Cpu));
        println!(
            "lingbot-1.3b block, fp8 attention over a 3-frame cache, on {dev}: rel L2 {e:.2e}"
        );
        assert!(e < 3e-2, "{e:.3e} ≥ 3e-2");
    }
}
