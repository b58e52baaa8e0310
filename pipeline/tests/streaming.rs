//! Streaming with the self-attention KV cache on the `tiny` model (f32, random weights): the cache
//! must give the same attention as a one-pass reference, keep exactly the frames the window/sink
//! rule says, and the engine must be deterministic and actually use its clean-context refresh.

use std::sync::Arc;

use kernels::{ops, AttnMask, DType, KvCache, Tensor};
use pipeline::camera::{fold_rays, ray_map, relative_poses, CameraRig, Controls, Pose};
use pipeline::config::{LATENT_CHANNELS, MASK_CHANNELS, VAE_STRIDE, VAE_TIME_STRIDE};
use pipeline::model::{Attn, CameraContext, KvMode, TextContext};
use pipeline::rng::NormalRng;
use pipeline::sampler::FlowSchedule;
use pipeline::{ChunkInputs, Engine, EngineConfig, ModelConfig, WanModel, WeightStore};

fn tiny_model() -> WanModel {
    WanModel::load(&ModelConfig::tiny(), &WeightStore::random(5, DType::F32)).expect("tiny")
}

fn randn(seed: u64, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(NormalRng::new(seed).normals(n), shape).expect("tensor")
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32().iter().map(|x| x.to_bits()).collect()
}

fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.to_vec_f32(), b.to_vec_f32());
    let num: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Frames `[start, start + len)` of a `[c, F, h, w]` latent.
fn frames(x: &Tensor, start: usize, len: usize) -> Tensor {
    x.narrow(1, start, len).expect("narrow")
}

/// A random prompt: zero padding alone would make every text key the same.
fn random_text(model: &WanModel) -> TextContext {
    let ctx = randn(77, &[5, model.cfg.text_dim]);
    model.encode_text(&ctx, None).expect("text")
}

/// Camera context of latent frames from their (already relative) poses, at pixel size.
fn camera_of(model: &WanModel, rel: &[Pose], height: usize, width: usize) -> CameraContext {
    let c = model.cfg.control_dim.expect("camera model");
    let map = ray_map(
        rel,
        &vec![[0.0; 4]; rel.len()],
        height,
        width,
        [480.0, 480.0, 416.0, 240.0],
        c,
    )
    .expect("rays");
    let tokens = fold_rays(&map, rel.len(), height, width, c).expect("fold");
    model.camera_context(&tokens).expect("camera")
}

#[test]
fn cached_chunks_equal_one_block_causal_pass() {
    let model = tiny_model();
    let mc = &model.cfg;
    let (chunk, chunks, lh, lw) = (2, 3, 8, 8);
    let total = chunk * chunks;
    let tokens_per_frame = (lh / mc.patch[1]) * (lw / mc.patch[2]);
    let x = randn(1, &[mc.in_dim, total, lh, lw]);
    let text = random_text(&model);
    let t = 500.0;

    // One pose per latent frame along a turning, climbing walk; made relative once for the
    // whole sequence so the per-chunk conditions are slices of the same per-frame values.
    let mut rig = CameraRig::new(Default::default());
    let controls = Controls {
        w: true,
        d: true,
        i: true,
        ..Default::default()
    };
    let poses: Vec<Pose> = (0..total)
        .map(|f| {
            if f > 0 {
                rig.advance(&controls, VAE_TIME_STRIDE, chunk * VAE_TIME_STRIDE);
            }
            rig.pose()
        })
        .collect();
    let rel = relative_poses(None, &poses, rig.step_length());
    let (ph, pw) = (lh * VAE_STRIDE, lw * VAE_STRIDE);

    let full_cam = camera_of(&model, &rel, ph, pw);
    let one_pass = |attn| {
        model
            .forward(&x, t, 0, &text, Some(&full_cam), attn, None)
            .expect("forward")
            .expect("output")
    };
    let reference = one_pass(Attn::BlockCausal { frames: chunk });

    let mut caches: Vec<KvCache> = (0..mc.num_layers)
        .map(|_| {
            KvCache::new(
                total,
                0,
                tokens_per_frame,
                mc.num_heads,
                mc.head_dim(),
                DType::F32,
            )
            .expect("cache")
        })
        .collect();
    let mut outs = Vec::new();
    for c in 0..chunks {
        let first = c * chunk;
        let cam = camera_of(&model, &rel[first..first + chunk], ph, pw);
        let out = model
            .forward(
                &frames(&x, first, chunk),
                t,
                first as u64,
                &text,
                Some(&cam),
                Attn::Cache {
                    caches: &mut caches,
                    kv_only: false,
                    resend_window: false,
                },
                None,
            )
            .expect("forward")
            .expect("output");
        outs.push(out);
    }
    let streamed = Tensor::cat(&outs.iter().collect::<Vec<_>>(), 1).expect("cat");
    for cache in &caches {
        assert_eq!(cache.frames(), (0..total as u64).collect::<Vec<_>>());
    }

    // The contract is a tolerance, not bits: the one pass runs each matrix product on all tokens
    // and each softmax row over all keys (masked scores zeroed), the stream on one chunk's tokens
    // and the keys held, so a backend whose GEMM blocking or reduction order depends on the
    // sizes rounds differently. The CPU reference measures 0 (its products are row by row and
    // the masked terms add exact zeros).
    let err = rel_l2(&streamed, &reference);
    eprintln!("cached vs block-causal: relative L2 {err:.3e}");
    assert!(err < 1e-5, "cached chunks vs one block-causal pass: {err}");

    // The comparison must be able to see a wrong mask: bidirectional attention lets the first
    // chunks see later ones and lands far away.
    let full = one_pass(Attn::Full);
    let far = rel_l2(&full, &reference);
    assert!(far > 1e-3, "bidirectional vs block-causal only {far}");
}

/// The frames a window of `window` with `sink` sink frames holds after frames `0..written`.
fn kept_frames(written: usize, window: usize, sink: usize) -> Vec<usize> {
    if written <= window {
        return (0..written).collect();
    }
    (0..sink)
        .chain(written - (window - sink)..written)
        .collect()
}

#[test]
fn window_with_sink_frames_attends_exactly_the_kept_frames() {
    let model = tiny_model();
    let sa = &model.blocks[0].self_attn;
    let (dim, heads, hd) = (model.cfg.dim, model.cfg.num_heads, model.cfg.head_dim());
    let (gh, gw) = (2, 3);
    let tpf = gh * gw;
    let (window, sink) = (5, 2);
    for chunk in [1, 2] {
        let mut cache = KvCache::new(window, sink, tpf, heads, hd, DType::F32).expect("cache");
        // Every frame's K/V computed on its own, in the chunk it was written with.
        let mut frame_kv: Vec<(Tensor, Tensor)> = Vec::new();
        let chunks = 14 / chunk;
        for c in 0..chunks {
            let first = c * chunk;
            let grid = [chunk, gh, gw];
            let x = randn(100 + first as u64, &[chunk * tpf, dim]);
            let out = sa
                .forward(
                    &x,
                    grid,
                    first,
                    &model.rope,
                    KvMode::Cache {
                        cache: &mut cache,
                        first_frame: first as u64,
                    },
                    false,
                )
                .expect("forward")
                .expect("output");

            let (k, v) = sa.keys_values(&x, grid, first, &model.rope).expect("kv");
            for f in 0..chunk {
                frame_kv.push((
                    k.narrow(0, f * tpf, tpf).expect("k"),
                    v.narrow(0, f * tpf, tpf).expect("v"),
                ));
            }
            let kept = kept_frames(first + chunk, window, sink);
            assert_eq!(
                cache.frames(),
                kept.iter().map(|&f| f as u64).collect::<Vec<_>>(),
                "chunk size {chunk}, after chunk {c}"
            );
            let keys = Tensor::cat(&kept.iter().map(|&f| &frame_kv[f].0).collect::<Vec<_>>(), 0)
                .expect("keys");
            let values = Tensor::cat(&kept.iter().map(|&f| &frame_kv[f].1).collect::<Vec<_>>(), 0)
                .expect("values");
            let len = keys.dim(0);
            assert_eq!(cache.len_tokens(), len);
            let held = |t: &Tensor| t.narrow(0, 0, len).expect("held");
            assert!(
                bits(&held(cache.keys())) == bits(&keys),
                "keys after chunk {c}"
            );
            assert!(
                bits(&held(cache.values())) == bits(&values),
                "values after chunk {c}"
            );

            let q = sa
                .norm_q
                .forward(&sa.q.forward(&x).expect("q"))
                .expect("norm");
            let q = q.reshape(&[chunk * tpf, heads, hd]).expect("heads");
            let q = ops::rope_3d(&q, grid, first, &model.rope).expect("rope");
            let a = ops::attention(&q, &keys, &values, len, AttnMask::None).expect("attention");
            let want =
                sa.o.forward(&a.reshape(&[chunk * tpf, dim]).expect("flat"))
                    .expect("o");
            // Same inputs, same ops, same key order: nothing may differ, not even rounding.
            assert!(
                bits(&out) == bits(&want),
                "chunk size {chunk}, chunk {c}: relative L2 {:.3e}",
                rel_l2(&out, &want)
            );
        }
    }
}

fn engine_cfg(seed: u64, chunk_frames: usize) -> EngineConfig {
    EngineConfig {
        height: 64,
        width: 64,
        chunk_frames,
        window_frames: 5,
        sink_frames: 1,
        ..EngineConfig::tiny(seed)
    }
}

const WALK: Controls = Controls {
    w: true,
    a: false,
    s: false,
    d: false,
    q: false,
    e: false,
    i: false,
    k: false,
    mouse_dx: 0.0,
    mouse_dy: 0.0,
};

const TURN: Controls = Controls {
    w: false,
    d: true,
    ..WALK
};

/// Latent bits of each chunk.
fn run(model: &Arc<WanModel>, cfg: EngineConfig, controls: Controls, n: usize) -> Vec<Vec<u32>> {
    let mut engine = Engine::new(model.clone(), cfg).expect("engine");
    (0..n)
        .map(|_| {
            bits(
                &engine
                    .next_chunk(&ChunkInputs { controls })
                    .expect("chunk")
                    .latents,
            )
        })
        .collect()
}

#[test]
fn engine_is_deterministic_and_follows_seed_and_controls() {
    let model = Arc::new(tiny_model());
    // Four chunks of 2 in a window of 5: chunks 2 and 3 evict.
    let chunks = 4;
    let base = run(&model, engine_cfg(1, 2), WALK, chunks);
    assert_eq!(base, run(&model, engine_cfg(1, 2), WALK, chunks), "rerun");
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        let got = pool.install(|| run(&model, engine_cfg(1, 2), WALK, chunks));
        assert!(got == base, "{threads} rayon thread(s)");
    }

    let other_seed = run(&model, engine_cfg(2, 2), WALK, chunks);
    for c in 0..chunks {
        assert_ne!(other_seed[c], base[c], "seed 2, chunk {c}");
    }

    // Chunk 0's first latent frame is the start pose whatever is held, but its second frame has
    // moved, and frames of one chunk attend each other: the whole chunk depends on controls.
    let turning = run(&model, engine_cfg(1, 2), TURN, chunks);
    let plane = base[0].len() / 2 / LATENT_CHANNELS;
    let frame = |lat: &[u32], f: usize| -> Vec<u32> {
        lat.chunks(2 * plane)
            .flat_map(|ch| ch[f * plane..(f + 1) * plane].to_vec())
            .collect()
    };
    for c in 0..chunks {
        for f in 0..2 {
            assert_ne!(
                frame(&turning[c], f),
                frame(&base[c], f),
                "W vs D, chunk {c}, frame {f}"
            );
        }
    }

    // With one frame per chunk, chunk 0 is only the start pose: controls cannot reach it (its
    // relative pose is the identity), and chunk 1 is the first to move.
    let walk1 = run(&model, engine_cfg(1, 1), WALK, 3);
    let turn1 = run(&model, engine_cfg(1, 1), TURN, 3);
    assert_eq!(walk1[0], turn1[0], "chunk 0 of one frame");
    assert_ne!(walk1[1], turn1[1], "chunk 1");
    assert_ne!(walk1[2], turn1[2], "chunk 2");
}

/// The engine's loop written out from MODELS.md §5 with the public pieces, so the cache can be
/// inspected between chunks. `refresh` switches the clean-context pass.
struct HandLoop {
    model: Arc<WanModel>,
    cfg: EngineConfig,
    schedule: FlowSchedule,
    steps: Vec<i64>,
    caches: Vec<KvCache>,
    text: TextContext,
    rng: NormalRng,
    rig: CameraRig,
    last_pose: Option<Pose>,
    next_frame: usize,
    refresh: bool,
    /// Block 0's keys just before the last refresh.
    before_refresh: Option<Tensor>,
}

impl HandLoop {
    fn new(model: Arc<WanModel>, cfg: EngineConfig, refresh: bool) -> Self {
        let mc = &model.cfg;
        let (lh, lw) = cfg.latent_hw();
        let schedule = FlowSchedule::new(cfg.num_train_steps, cfg.shift).expect("schedule");
        let steps = schedule.steps(&cfg.step_indices).expect("steps");
        let caches = (0..mc.num_layers)
            .map(|_| {
                KvCache::new(
                    cfg.window_frames,
                    cfg.sink_frames,
                    (lh / 2) * (lw / 2),
                    mc.num_heads,
                    mc.head_dim(),
                    DType::F32,
                )
                .expect("cache")
            })
            .collect();
        let text = model
            .encode_text(
                &Tensor::zeros(&[0, mc.text_dim], DType::F32).expect("z"),
                None,
            )
            .expect("text");
        HandLoop {
            rng: NormalRng::for_name(cfg.seed, "noise"),
            rig: CameraRig::new(cfg.camera.clone()),
            model,
            schedule,
            steps,
            caches,
            text,
            last_pose: None,
            next_frame: 0,
            refresh,
            before_refresh: None,
            cfg,
        }
    }

    fn noise(&mut self) -> Tensor {
        let (lh, lw) = self.cfg.latent_hw();
        let shape = [LATENT_CHANNELS, self.cfg.chunk_frames, lh, lw];
        Tensor::from_vec(self.rng.normals(shape.iter().product()), &shape).expect("noise")
    }

    /// One chunk: its clean latents and the model input `cat(x0, y)` of the refresh pass.
    fn chunk(&mut self, controls: Controls) -> (Tensor, Tensor) {
        let n = self.cfg.chunk_frames;
        let (lh, lw) = self.cfg.latent_hw();
        let first = self.next_frame as u64;
        let poses: Vec<Pose> = (0..n)
            .map(|i| {
                if self.next_frame + i > 0 {
                    self.rig
                        .advance(&controls, VAE_TIME_STRIDE, n * VAE_TIME_STRIDE);
                }
                self.rig.pose()
            })
            .collect();
        let rel = relative_poses(self.last_pose.as_ref(), &poses, self.rig.step_length());
        let model = self.model.clone();
        let cam = camera_of(&model, &rel, self.cfg.height, self.cfg.width);
        // No first frame was set: mask and first-frame latent are zero on every frame.
        let y =
            Tensor::zeros(&[MASK_CHANNELS + LATENT_CHANNELS, n, lh, lw], DType::F32).expect("y");
        let with_y = |x: &Tensor| Tensor::cat(&[x, &y], 0).expect("cat");
        let mut x = self.noise();
        let mut x0 = x.clone();
        let steps = self.steps.clone();
        for (s, &t) in steps.iter().enumerate() {
            let v = model
                .forward(
                    &with_y(&x),
                    t as f64,
                    first,
                    &self.text,
                    Some(&cam),
                    Attn::Cache {
                        caches: &mut self.caches,
                        kv_only: false,
                        resend_window: false,
                    },
                    None,
                )
                .expect("forward")
                .expect("output");
            let sigma = self.schedule.sigma_first(t).expect("sigma");
            x0 = ops::axpby(1.0, &x, -sigma, &v).expect("x0");
            if let Some(&next) = steps.get(s + 1) {
                let sigma = self.schedule.sigma_second(next).expect("sigma");
                let noise = self.noise();
                x = ops::axpby(1.0 - sigma, &x0, sigma, &noise).expect("renoise");
            }
        }
        let input = with_y(&x0);
        if self.refresh {
            // A clone shares storage until the cache writes, which then copies: a snapshot.
            self.before_refresh = Some(self.caches[0].keys().clone());
            let out = model
                .forward(
                    &input,
                    0.0,
                    first,
                    &self.text,
                    Some(&cam),
                    Attn::Cache {
                        caches: &mut self.caches,
                        kv_only: true,
                        resend_window: false,
                    },
                    None,
                )
                .expect("refresh");
            assert!(out.is_none(), "a cache-only pass returns nothing");
        }
        self.last_pose = poses.last().copied();
        self.next_frame += n;
        (x0, input)
    }
}

/// Block 0's K/V of a model input at timestep `t`, from the public pieces of the block.
fn block0_kv(model: &WanModel, input: &Tensor, t: f64, first: usize) -> (Tensor, Tensor) {
    let dim = model.cfg.dim;
    let grid = [input.dim(1), input.dim(2) / 2, input.dim(3) / 2];
    let h = ops::patch_embed(
        input,
        &model.patch_embedding_weight,
        Some(&model.patch_embedding_bias),
    )
    .expect("patch");
    let (_, e0) = model.time_embedding(t).expect("time");
    let block = &model.blocks[0];
    let m = ops::add(&block.modulation.reshape(&[6, dim]).expect("m"), &e0).expect("add");
    let row = |i| {
        m.narrow(0, i, 1)
            .expect("row")
            .reshape(&[dim])
            .expect("dim")
    };
    let h = ops::layer_norm(&h, None, None, block.eps).expect("ln");
    let h = ops::modulate(&h, &row(0), &row(1)).expect("modulate");
    block
        .self_attn
        .keys_values(&h, grid, first, &model.rope)
        .expect("kv")
}

#[test]
fn refresh_rewrites_the_chunk_with_clean_context() {
    let model = Arc::new(tiny_model());
    let cfg = engine_cfg(9, 2);
    let controls = Controls { d: true, ..WALK };
    let chunks = 4;
    let mut engine = Engine::new(model.clone(), cfg.clone()).expect("engine");
    let mut hand = HandLoop::new(model.clone(), cfg.clone(), true);
    let mut stale = HandLoop::new(model.clone(), cfg.clone(), false);
    for c in 0..chunks {
        let want = engine
            .next_chunk(&ChunkInputs { controls })
            .expect("chunk")
            .latents;
        let (x0, input) = hand.chunk(controls);
        // The hand loop is the engine: what it shows about the cache holds for the engine.
        assert!(bits(&x0) == bits(&want), "hand loop vs engine, chunk {c}");

        let first = c * cfg.chunk_frames;
        let cache = &hand.caches[0];
        let tpf = (input.dim(2) / 2) * (input.dim(3) / 2);
        let pos = cache
            .frames()
            .iter()
            .position(|&f| f == first as u64)
            .expect("chunk's frames held");
        let held = |t: &Tensor| {
            t.narrow(0, pos * tpf, cfg.chunk_frames * tpf)
                .expect("rows")
        };
        let (k, v) = block0_kv(&model, &input, 0.0, first);
        assert!(
            bits(&held(cache.keys())) == bits(&k),
            "chunk {c}: keys are not x0's at t = 0"
        );
        assert!(
            bits(&held(cache.values())) == bits(&v),
            "chunk {c}: values are not x0's at t = 0"
        );
        // What the last denoising step wrote (and a loop without refresh keeps) was different.
        let before = hand.before_refresh.as_ref().expect("snapshot");
        assert!(
            bits(&held(before)) != bits(&k),
            "chunk {c}: refresh rewrote nothing"
        );

        let (x0_stale, _) = stale.chunk(controls);
        if c == 0 {
            // Chunk 0 is emitted before its own refresh, and no earlier chunk is cached.
            assert!(bits(&x0_stale) == bits(&want));
        } else {
            let d = rel_l2(&x0_stale, &want);
            eprintln!("chunk {c}: without refresh, relative L2 {d:.3e}");
            assert!(d > 1e-4, "chunk {c}: the refresh changed nothing ({d})");
        }
    }
}
