//! Sequence parallelism on the CPU over the loopback communicator: `tiny` on 1, 2 and 4 ranks
//! must give the single-card latents bit for bit through a rolling window with a sink, move only
//! the new chunk's q/k/v/o per attention call, and fail fast, naming the rank, when one fails.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kernels::{DType, Tensor};
use pipeline::camera::Controls;
use pipeline::config::VAE_STRIDE;
use pipeline::rng::NormalRng;
use pipeline::{
    ChunkInputs, Engine, EngineConfig, EngineGroup, ModelConfig, WanModel, WeightStore,
};
use sp::{CommStats, Communicator};

fn tiny() -> Arc<WanModel> {
    Arc::new(
        WanModel::load(&ModelConfig::tiny(), &WeightStore::random(5, DType::F32)).expect("tiny"),
    )
}

/// Chunks of 3 latent frames in a window of 7 with 1 sink frame: from the third chunk on, every
/// chunk evicts.
fn session(height: usize, width: usize) -> EngineConfig {
    EngineConfig {
        height,
        width,
        chunk_frames: 3,
        window_frames: 7,
        sink_frames: 1,
        ..EngineConfig::tiny(3)
    }
}

fn prompt(model: &WanModel) -> Tensor {
    let n = 6 * model.cfg.text_dim;
    Tensor::from_vec(NormalRng::new(9).normals(n), &[6, model.cfg.text_dim]).expect("prompt")
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

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32().iter().map(|x| x.to_bits()).collect()
}

const CHUNKS: usize = 4;

/// `model` on one card and as rank groups of each of `cards` at `h × w`: the same latents, bit
/// for bit, chunk by chunk.
fn ranks_match_one_card(model: &Arc<WanModel>, (h, w): (usize, usize), cards: &[usize]) {
    let cfg = session(h, w);
    let mut one = Engine::new(model.clone(), cfg.clone()).expect("engine");
    one.set_prompt(&prompt(model)).expect("prompt");
    let want: Vec<Vec<u32>> = (0..CHUNKS)
        .map(|i| bits(&one.next_chunk(&controls(i)).expect("chunk").latents))
        .collect();
    for &cards in cards {
        let mut group = EngineGroup::loopback(model.clone(), cfg.clone(), cards).expect("group");
        group.set_prompt(&prompt(model)).expect("prompt");
        for (i, want) in want.iter().enumerate() {
            let got = group.next_chunk(&controls(i)).expect("chunk");
            assert_eq!(got.index, i as u64);
            assert!(
                &bits(&got.latents) == want,
                "{h}×{w} on {cards} cards: chunk {i} differs from one card"
            );
        }
    }
}

#[test]
fn ranks_reproduce_one_card_bit_for_bit() {
    let model = tiny();
    // 32×48: 6 tokens a frame, 18 a chunk (padded to 20 on 4 ranks); 48×48: 27 (28 on 2 and 4).
    for size in [(32, 48), (48, 48)] {
        ranks_match_one_card(&model, size, &[1, 2, 4]);
    }
}

/// `--attention vsa` under Ulysses: each rank runs VSA over its heads on the whole sequence, so
/// the ranks give the one card's latents bit for bit here too (also where a chunk's tokens are
/// padded to divide among the ranks).
#[test]
fn sparse_attention_on_ranks_reproduces_one_card() {
    let mut model =
        WanModel::load(&ModelConfig::tiny(), &WeightStore::random(5, DType::F32)).expect("tiny");
    model.use_sparse_attention(0.5).expect("sparse");
    let model = Arc::new(model);
    // 64×96: 24 tokens a frame in 2 tiles, 72 a chunk (on 4 ranks, 18 each; 48×48: 27 a chunk,
    // padded to 28).
    for size in [(64, 96), (48, 48)] {
        ranks_match_one_card(&model, size, &[2, 4]);
    }
}

#[test]
fn attention_moves_only_the_new_chunk() {
    let model = tiny();
    let mc = &model.cfg;
    let cfg = session(32, 48);
    let (cards, layers, steps) = (4u64, mc.num_layers as u64, cfg.step_indices.len() as u64);
    let (lh, lw) = (cfg.height / VAE_STRIDE, cfg.width / VAE_STRIDE);
    let tokens = (cfg.chunk_frames * (lh / mc.patch[1]) * (lw / mc.patch[2])) as u64;
    let per_rank = tokens.div_ceil(cards);
    let (heads, d) = (mc.num_heads as u64, mc.head_dim() as u64);
    // One tensor's exchange: this rank's shard of the other ranks' heads, in f32.
    let unit = (cards - 1) * per_rank * (heads / cards) * d * 4;
    // Each denoising forward sends q, k, v and gets o back in every layer; the refresh pass
    // needs no q and no o in its last layer.
    let a2a = steps * layers * 4 * unit + ((layers - 1) * 4 + 2) * unit;
    // Keys and values, then queries (sent while the keys are rotated and cached), then o.
    let calls = steps * layers * 3 + (layers - 1) * 3 + 1;
    // The head's input (the f32 residual stream) is gathered before the head's GEMM, so that
    // the GEMM runs on the whole chunk's rows as on one card.
    let gather = steps * (cards - 1) * per_rank * mc.dim as u64 * 4;

    let mut group =
        EngineGroup::loopback(model.clone(), cfg.clone(), cards as usize).expect("group");
    let mut before = group.comm_stats();
    for i in 0..CHUNKS + 2 {
        group.next_chunk(&controls(i)).expect("chunk");
        let now = group.comm_stats();
        for (rank, (a, b)) in now.iter().zip(&before).enumerate() {
            let moved = *a - *b;
            // The same every chunk, whether the window is empty, filling or evicting: the
            // cached keys stay where they are.
            assert_eq!(
                moved,
                CommStats {
                    all_to_all_bytes: a2a,
                    all_to_all_calls: calls,
                    all_gather_bytes: gather,
                    broadcast_bytes: 0,
                    collective_ns: moved.collective_ns,
                },
                "chunk {i}, rank {rank}"
            );
        }
        before = now;
    }
    // What re-sending the held window on every call would cost grows with the window; the
    // incremental exchange stays at the chunk.
    let window_tokens = cfg.window_frames as u64 * tokens / cfg.chunk_frames as u64;
    assert!(window_tokens > tokens);
}

/// `worker bench sp` compares with the stock layout by re-sending the cached window on every
/// call: that must cost exactly the window's K/V and change nothing in the output.
#[test]
fn resending_the_window_costs_the_window_and_changes_nothing() {
    let model = tiny();
    let mc = &model.cfg;
    let cfg = session(32, 48);
    let (cards, layers, steps) = (2u64, mc.num_layers as u64, cfg.step_indices.len() as u64);
    let frame_tokens =
        ((cfg.height / VAE_STRIDE / mc.patch[1]) * (cfg.width / VAE_STRIDE / mc.patch[2])) as u64;
    let (heads, d) = (mc.num_heads as u64, mc.head_dim() as u64);

    let mut plain =
        EngineGroup::loopback(model.clone(), cfg.clone(), cards as usize).expect("group");
    let mut stock =
        EngineGroup::loopback(model.clone(), cfg.clone(), cards as usize).expect("group");
    stock.set_resend_window(true).expect("resend");
    for i in 0..CHUNKS + 1 {
        let (p0, s0) = (plain.comm_stats()[0], stock.comm_stats()[0]);
        let a = plain.next_chunk(&controls(i)).expect("chunk");
        let b = stock.next_chunk(&controls(i)).expect("chunk");
        assert!(bits(&a.latents) == bits(&b.latents), "chunk {i} changed");
        let extra = (stock.comm_stats()[0] - s0).all_to_all_bytes
            - (plain.comm_stats()[0] - p0).all_to_all_bytes;
        // Held before this chunk: the earlier chunks' frames, up to the window less the chunk.
        let cached =
            (3 * i as u64).min((cfg.window_frames - cfg.chunk_frames) as u64) * frame_tokens;
        // Every call that attends re-sends K and V of the held tokens (f32 on the CPU): each
        // layer of each step, and every layer but the last (cache-only) of the refresh.
        let calls = steps * layers + layers - 1;
        let want = calls * (cards - 1) * cached.div_ceil(cards) * (heads / cards) * d * 4 * 2;
        assert_eq!(extra, want, "chunk {i}");
    }
}

/// Fails (or panics in) the `at`-th all-to-all of one rank.
#[derive(Debug)]
struct Faulty {
    inner: Arc<dyn Communicator>,
    victim: usize,
    at: u64,
    panic: bool,
    calls: AtomicU64,
}

impl Communicator for Faulty {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_to_all(&self, send: Vec<Tensor>) -> Result<Vec<Tensor>, sp::Error> {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        if self.rank() == self.victim && n == self.at {
            if self.panic {
                panic!("injected panic in all_to_all");
            }
            return Err(sp::Error::Invalid("injected link failure".into()));
        }
        self.inner.all_to_all(send)
    }
    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>, sp::Error> {
        self.inner.all_gather(t)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, sp::Error> {
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> Result<(), sp::Error> {
        self.inner.barrier()
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
}

fn faulty_group(victim: usize, at: u64, panic: bool) -> EngineGroup {
    let wrap = Arc::new(
        move |inner: Arc<dyn Communicator>| -> Arc<dyn Communicator> {
            Arc::new(Faulty {
                inner,
                victim,
                at,
                panic,
                calls: AtomicU64::new(0),
            })
        },
    );
    EngineGroup::loopback_with(tiny(), session(32, 48), 4, wrap).expect("group")
}

#[test]
fn a_rank_failing_mid_chunk_fails_the_chunk_naming_it() {
    // 28 all-to-alls a chunk (6 a forward): the 38th is inside the second chunk's second step.
    for panic in [false, true] {
        let mut group = faulty_group(2, 38, panic);
        group.next_chunk(&controls(0)).expect("chunk 0");
        let e = group
            .next_chunk(&controls(1))
            .expect_err("rank 2 fails")
            .to_string();
        let cause = if panic {
            "injected panic"
        } else {
            "injected link failure"
        };
        assert!(e.contains("rank 2 failed") && e.contains(cause), "{e}");
        let again = group
            .next_chunk(&controls(2))
            .expect_err("broken")
            .to_string();
        assert!(again.contains("restarted"), "{again}");
    }
    // The worker can start over with a new group.
    let mut group = faulty_group(2, u64::MAX, false);
    group.next_chunk(&controls(0)).expect("a new group runs");
}
