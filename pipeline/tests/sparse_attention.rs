//! `--attention vsa` in the DiT (`WanModel::use_sparse_attention`): VSA's fine branch over the
//! key tiles the coarse scores pick, for the self-attention over the KV cache, on the CPU
//! reference. The op itself is checked against its definition in `kernels/tests/vsa.rs`; here,
//! that the model hands it the right grids and rows as the cache fills, rolls and evicts.

mod common;

use common::dit::{block_1_3b_sparse, block_1_3b_sparse_summed, tiny_stream, tiny_stream_sparse};
use common::rel_l2;
use kernels::{DType, Device};
use pipeline::{ModelConfig, WanModel, WeightStore};

/// 5 chunks of 2 frames at 64×96 (4×6 tokens a frame: key tiles of up to 4×4×4 split 2 ways
/// across a frame) in a 5-frame window with a sink frame: the cache fills, then rolls, and the
/// key grid runs 2, 4, 5, 5, 5 frames.
const STREAM: ([usize; 2], usize, usize) = ([64, 96], 5, 5);

#[test]
fn every_tile_kept_is_the_dense_model() {
    let (hw, window, chunks) = STREAM;
    let dense = tiny_stream(Device::Cpu, DType::F32, hw, window, chunks);
    let sparse = tiny_stream_sparse(Device::Cpu, DType::F32, hw, window, chunks, Some(0.0));
    for (c, (s, d)) in sparse.iter().zip(&dense).enumerate() {
        let e = rel_l2(s, d);
        // The fine branch sums its keys tile by tile, dense attention in cache order.
        assert!(e < 1e-5, "chunk {c}: rel L2 {e:e} against dense");
    }
}

#[test]
fn sparse_attention_changes_the_stream_and_stays_finite() {
    let (hw, window, chunks) = STREAM;
    let dense = tiny_stream(Device::Cpu, DType::F32, hw, window, chunks);
    // 0.6 keeps 1 of the first chunk's 2 key tiles, 2 of 4 once the window holds 5 frames.
    let sparse = tiny_stream_sparse(Device::Cpu, DType::F32, hw, window, chunks, Some(0.6));
    for (c, (s, d)) in sparse.iter().zip(&dense).enumerate() {
        assert!(s.iter().all(|x| x.is_finite()), "chunk {c}: not finite");
        let e = rel_l2(s, d);
        println!("tiny, sparsity 0.6, chunk {c}: rel L2 {e:.2e} against dense");
        assert!(
            e > 1e-4,
            "chunk {c}: sparse attention changed nothing ({e:e})"
        );
    }
}

/// lingbot-1.3b's block over a cache of two frames plus its own (and a fourth, empty frame of
/// rows the attention must not read): all tiles kept is dense, fewer is not.
#[test]
fn a_1_3b_block_over_a_cache() {
    let grid = [1, 8, 12];
    let dense = block_1_3b_sparse(Device::Cpu, grid, 0.0);
    assert!(dense.iter().all(|x| x.is_finite()));
    let all = common::dit::block_1_3b_cached_dense(Device::Cpu, grid);
    let e = rel_l2(&dense, &all);
    // bf16 weights: the activations round to bf16 between ops, so the two summation orders
    // part by more than in f32.
    assert!(e < 2e-4, "sparsity 0 against dense: rel L2 {e:e}");
    let sparse = block_1_3b_sparse(Device::Cpu, grid, 0.5);
    let e = rel_l2(&sparse, &all);
    println!("lingbot-1.3b block, sparsity 0.5: rel L2 {e:.2e} against dense");
    assert!(e > 1e-4, "sparse attention changed nothing ({e:e})");
}

/// The cache's key sums in place of the means of its rows (the engine's form): the same block
/// output, up to the order of the means' f32 additions.
#[test]
fn a_cache_with_key_sums_gives_the_same_block() {
    let grid = [1, 8, 12];
    for sparsity in [0.5, 0.9] {
        let rows = block_1_3b_sparse(Device::Cpu, grid, sparsity);
        let sums = block_1_3b_sparse_summed(Device::Cpu, grid, sparsity);
        let e = rel_l2(&sums, &rows);
        println!("lingbot-1.3b block, sparsity {sparsity}, key sums: rel L2 {e:.2e}");
        assert!(e < 1e-5, "sparsity {sparsity}: rel L2 {e:e}");
    }
}

/// The cache's key sums and the queries' sums made by the q and k norm + RoPE launches
/// (`WORLDLINE_VSA_ROPE_SUMS`) in place of launches of their own: the same block output, up to
/// the order of the query means' f32 additions. The switch is left as it was found (the other
/// tests here pass either way).
#[test]
fn key_and_query_sums_from_the_norm_and_rope_give_the_same_block() {
    let grid = [1, 8, 12];
    let was = pipeline::model::rope_sums();
    for sparsity in [0.5, 0.9] {
        pipeline::model::set_rope_sums(false);
        let apart = block_1_3b_sparse_summed(Device::Cpu, grid, sparsity);
        pipeline::model::set_rope_sums(true);
        let fused = block_1_3b_sparse_summed(Device::Cpu, grid, sparsity);
        let e = rel_l2(&fused, &apart);
        println!(
            "lingbot-1.3b block, sparsity {sparsity}, sums from the norm + RoPE: rel L2 {e:.2e}"
        );
        assert!(e < 1e-5, "sparsity {sparsity}: rel L2 {e:e}");
    }
    pipeline::model::set_rope_sums(was);
}

#[test]
fn bad_settings_are_refused() {
    let store = WeightStore::random(5, DType::F32);
    let mut model = WanModel::load(&ModelConfig::tiny(), &store).expect("model");
    for s in [1.0, -0.1, f64::NAN] {
        let e = model.use_sparse_attention(s).expect_err("refused");
        assert!(e.to_string().contains("outside [0, 1)"), "{e}");
    }
    assert_eq!(model.sparse_attention(), None);
    model.use_sparse_attention(0.9).expect("sparse");
    assert_eq!(model.sparse_attention(), Some(0.9));
    let e = model.use_fp8_attention().expect_err("refused");
    assert!(e.to_string().contains("choose one"), "{e}");
    let mut model = WanModel::load(&ModelConfig::tiny(), &store).expect("model");
    model.fp8_attention = true;
    let e = model.use_sparse_attention(0.9).expect_err("refused");
    assert!(e.to_string().contains("choose one"), "{e}");
}
