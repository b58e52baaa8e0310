//! The DiT runs that the GPU tests compare against the CPU (`gpu.rs` on CUDA or ROCm cards,
//! `rocm_emulated.rs` on the emulated AMD GPU): a `tiny` stream, and one lingbot-1.3b block.

use std::sync::Arc;

use kernels::{DType, Device, RopeTable, Tensor};
use pipeline::camera::Controls;
use pipeline::model::{BlockInputs, KvMode, WanBlock, ROPE_POSITIONS};
use pipeline::rng::NormalRng;
use pipeline::{ChunkInputs, Engine, EngineConfig, ModelConfig, WanModel, WeightStore};

use super::random_times as rnd;

/// Latents of `chunks` chunks of the `tiny` stream on `dev` at `height × width` (2-frame
/// chunks, one sink frame, a window of `window` frames), alternating two control sets.
pub fn tiny_stream(
    dev: Device,
    dtype: DType,
    hw: [usize; 2],
    window: usize,
    chunks: usize,
) -> Vec<Vec<f32>> {
    tiny_stream_sparse(dev, dtype, hw, window, chunks, None)
}

/// [`tiny_stream`] with the self-attention sparse (`WanModel::use_sparse_attention`) where
/// `sparsity` is given.
pub fn tiny_stream_sparse(
    dev: Device,
    dtype: DType,
    [height, width]: [usize; 2],
    window: usize,
    chunks: usize,
    sparsity: Option<f64>,
) -> Vec<Vec<f32>> {
    let cfg = ModelConfig::tiny();
    let store = WeightStore::random(5, dtype).on_device(dev);
    let mut model = WanModel::load(&cfg, &store).expect("model");
    if let Some(s) = sparsity {
        model.use_sparse_attention(s).expect("sparse attention");
    }
    let model = Arc::new(model);
    let ecfg = EngineConfig {
        height,
        width,
        chunk_frames: 2,
        window_frames: window,
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
    let (h, w) = (height / 8, width / 8);
    let first =
        Tensor::from_vec(NormalRng::new(8).normals(16 * h * w), &[16, h, w]).expect("first");
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
    (0..chunks)
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

/// lingbot-1.3b's block 0 (random `dtype` weights, its linears in fp8 where `fp8`) over one chunk
/// of `grid` latent tokens with camera conditioning, attention over the chunk alone, on `dev`.
pub fn block_1_3b(dev: Device, dtype: DType, fp8: bool, grid: [usize; 3]) -> Vec<f32> {
    let cfg = ModelConfig::lingbot_1_3b();
    let tokens: usize = grid.iter().product();
    let rope = RopeTable::new(cfg.head_dim(), ROPE_POSITIONS, 1e4).expect("rope");
    let (x, e0, text, cond) = (
        rnd(1, &[tokens, cfg.dim], 1.0),
        rnd(2, &[6, cfg.dim], 0.1),
        rnd(3, &[cfg.text_len, cfg.dim], 1.0),
        rnd(4, &[tokens, cfg.dim], 1.0),
    );
    let store = WeightStore::random(0, dtype).on_device(dev);
    let mut block = WanBlock::load(&store.root().pp("blocks").pp(0), &cfg).expect("block");
    if fp8 {
        block.quantize_linears_fp8().expect("fp8 linears");
    }
    let up = |t: &Tensor| t.to_device(dev).expect("up");
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
}

/// The same block (bf16 weights) through a KV cache that keeps an fp8 copy, so self-attention
/// runs in fp8 (the GPU's fp8 kernel, the dequantizing reference on the CPU): the cache already
/// holds two frames of `grid`'s size and the chunk is the third, without camera conditioning.
pub fn block_1_3b_fp8_attention(dev: Device, grid: [usize; 3]) -> Vec<f32> {
    block_1_3b_cached(dev, grid, Keeps::Fp8, None, false)
}

/// The same block over the same cache with fp8 linears (dense bf16 attention): the keys are
/// normed and rotated into the cache's rows.
pub fn block_1_3b_cached_fp8_linears(dev: Device, grid: [usize; 3]) -> Vec<f32> {
    block_1_3b_cached(dev, grid, Keeps::Rows, None, true)
}

/// The same block over the same cache with sparse self-attention at `sparsity` (VSA's fine
/// branch; bf16 attention, no fp8 copy).
pub fn block_1_3b_sparse(dev: Device, grid: [usize; 3], sparsity: f64) -> Vec<f32> {
    block_1_3b_cached(dev, grid, Keeps::Rows, Some(sparsity), false)
}

/// [`block_1_3b_sparse`] over a cache that also keeps its keys' slab sums, as the engine's
/// caches do under sparse attention: the key-tile means come from them.
pub fn block_1_3b_sparse_summed(dev: Device, grid: [usize; 3], sparsity: f64) -> Vec<f32> {
    block_1_3b_cached(dev, grid, Keeps::KeySums, Some(sparsity), false)
}

/// The same block over the same cache, dense bf16 attention.
pub fn block_1_3b_cached_dense(dev: Device, grid: [usize; 3]) -> Vec<f32> {
    block_1_3b_cached(dev, grid, Keeps::Rows, None, false)
}

/// What the cache keeps beside its rows.
#[derive(Clone, Copy, PartialEq)]
enum Keeps {
    Rows,
    Fp8,
    KeySums,
}

fn block_1_3b_cached(
    dev: Device,
    grid: [usize; 3],
    keeps: Keeps,
    sparsity: Option<f64>,
    fp8_linears: bool,
) -> Vec<f32> {
    let cfg = ModelConfig::lingbot_1_3b();
    let tokens: usize = grid.iter().product();
    let rope = RopeTable::new(cfg.head_dim(), ROPE_POSITIONS, 1e4).expect("rope");
    let (x, e0, text, held) = (
        rnd(1, &[tokens, cfg.dim], 1.0),
        rnd(2, &[6, cfg.dim], 0.1),
        rnd(3, &[cfg.text_len, cfg.dim], 1.0),
        rnd(5, &[2 * tokens, cfg.num_heads, cfg.head_dim()], 1.0),
    );
    let store = WeightStore::random(0, DType::BF16).on_device(dev);
    let mut block = WanBlock::load(&store.root().pp("blocks").pp(0), &cfg).expect("block");
    block.self_attn.sparsity = sparsity;
    if fp8_linears {
        block.quantize_linears_fp8().expect("fp8 linears");
    }
    let up = |t: &Tensor| t.to_device(dev).expect("up");
    let kv = block.cross_attn.text_kv(&up(&text)).expect("text");
    let dtype = if dev.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let mut cache = kernels::KvCache::new(4, 1, tokens, cfg.num_heads, cfg.head_dim(), dtype)
        .and_then(|c| c.on_device(dev))
        .and_then(|c| match keeps {
            Keeps::Fp8 => c.with_fp8_attention(),
            Keeps::KeySums => c.with_key_sums([grid[1], grid[2]]),
            Keeps::Rows => Ok(c),
        })
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
}
