//! The CPU reference must give bit-identical results whatever the thread count: GPU backends are
//! compared against it, and a reference that drifts with the machine's core count is no reference.

mod common;

use common::{assert_bits_eq, randn, Rng};
use kernels::{ops, AttnMask, DType, Device, Result, RopeTable, Tensor};

/// Runs `f` in rayon pools of 1, 2 and 4 threads and asserts the outputs are bit-identical.
fn same_on_all_pools(what: &str, f: impl Fn() -> Result<Tensor> + Sync) -> Result<()> {
    let mut first: Option<Vec<f32>> = None;
    for threads in [1, 2, 4] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a rayon pool");
        let out = pool.install(&f)?.to_vec_f32();
        assert!(
            out.iter().all(|x| x.is_finite()),
            "{what}: non-finite output"
        );
        match &first {
            None => first = Some(out),
            Some(reference) => {
                assert_bits_eq(&format!("{what}, {threads} threads vs 1"), &out, reference)
            }
        }
    }
    Ok(())
}

fn linear_deterministic(dev: Device) -> Result<()> {
    let mut rng = Rng::new(50);
    // Large enough for gemm to split the work across threads, plus the single-row (gemv) shape,
    // odd sizes that leave partial tiles, and a depth longer than one k block.
    for (m, k, n) in [(257, 384, 320), (1, 512, 300), (130, 1100, 70)] {
        let x = randn(dev, &mut rng, &[m, k])?;
        let w = randn(dev, &mut rng, &[n, k])?;
        let b = randn(dev, &mut rng, &[n])?;
        same_on_all_pools(&format!("linear {m}x{k}x{n}"), || {
            ops::linear(&x, &w, Some(&b))
        })?;
        let xb = x.to_dtype(DType::BF16)?;
        same_on_all_pools(&format!("linear bf16 {m}x{k}x{n}"), || {
            ops::linear(&xb, &w, None)
        })?;
    }
    Ok(())
}
test_device!(linear_deterministic, linear_deterministic_cpu);

fn attention_deterministic(dev: Device) -> Result<()> {
    let mut rng = Rng::new(51);
    let (l, heads, d) = (300, 3, 64);
    let q = randn(dev, &mut rng, &[l, heads, d])?;
    let k = randn(dev, &mut rng, &[l + 20, heads, d])?;
    let v = randn(dev, &mut rng, &[l + 20, heads, d])?;
    same_on_all_pools("attention", || {
        ops::attention(&q, &k, &v, l + 7, AttnMask::None)
    })?;
    let causal = AttnMask::BlockCausal { block_tokens: 64 };
    let (kc, vc) = (k.narrow(0, 0, l)?, v.narrow(0, 0, l)?);
    same_on_all_pools("attention block-causal", || {
        ops::attention(&q, &kc, &vc, l, causal)
    })?;
    Ok(())
}
test_device!(attention_deterministic, attention_deterministic_cpu);

/// The other rayon-parallel ops split by rows; cheap to cover here as well.
fn row_ops_deterministic(dev: Device) -> Result<()> {
    let mut rng = Rng::new(52);
    let x = randn(dev, &mut rng, &[96, 128])?;
    let w = randn(dev, &mut rng, &[128])?;
    same_on_all_pools("layer_norm", || ops::layer_norm(&x, Some(&w), None, 1e-6))?;
    same_on_all_pools("rms_norm", || ops::rms_norm(&x, None, &w, 1e-6))?;
    let table = RopeTable::new(64, 16, 10_000.0)?;
    let r = x.reshape(&[96, 2, 64])?;
    same_on_all_pools("rope_3d", || ops::rope_3d(&r, [4, 4, 6], 3, &table))?;
    Ok(())
}
test_device!(row_ops_deterministic, row_ops_deterministic_cpu);
