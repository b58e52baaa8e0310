//! The VSA rows of `bench kernels`, and `bench vsa` (those rows alone, for quick turns on the
//! sparse path): VSA at sparsity 0.9 against our dense attention on the same shape, for both of
//! Hopper's fine kernels, on random inputs and on inputs with local structure.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use kernels::{ops, AttnMask, DType, Device, Tensor};
use pipeline::flops;
use pipeline::rng::NormalRng;

use super::{profile_line, rand, time, write_rows, Row, PEER_REPEAT};

/// VSA at sparsity 0.9 over `q, k, v` on these grids, timed as `time` does: the kept key
/// tiles, the key tiles and the time.
fn time_vsa(
    dev: Device,
    repeat: usize,
    [q, k, v]: [&Tensor; 3],
    q_grid: [usize; 3],
    k_grid: [usize; 3],
) -> Result<(usize, usize, Duration)> {
    let tiles = kernels::vsa::tiles(k_grid, kernels::vsa::TILE);
    let top_k = kernels::vsa::top_k(0.9, tiles);
    let t = time(dev, repeat, || {
        kernels::vsa::attention(q, k, v, None, q_grid, k_grid, top_k)?;
        Ok(())
    })?;
    Ok((top_k, tiles, t))
}

/// The VSA rows of `bench kernels` and `bench vsa`, beside our dense attention (`dense`, timed
/// on `q, k, v` by the caller): VSA at sparsity 0.9 on the same shape, the chunk's 3×30×52
/// latent grid against the window's 18×30×52 (issue target: ≥ 4× faster than our dense); the
/// same at a 4-frame chunk, dense and sparse; and one profiled call.
pub(super) fn vsa_rows(
    dev: Device,
    heavy: usize,
    [q, k, v]: [&Tensor; 3],
    dense: Duration,
    push: &mut dyn FnMut(String, Duration, f64),
) -> Result<()> {
    let (lq, heads, d) = (q.dim(0), q.dim(1), q.dim(2));
    let lk = k.dim(0);
    let (q_grid, k_grid) = ([3, 30, 52], [18, 30, 52]);
    let (top_k, tiles, t_vsa) = time_vsa(dev, heavy, [q, k, v], q_grid, k_grid)?;
    println!(
        "vsa sparsity 0.9 ({top_k} of {tiles} key tiles): {:.3} ms = {:.2}x faster than dense",
        t_vsa.as_secs_f64() * 1e3,
        dense.as_secs_f64() / t_vsa.as_secs_f64()
    );
    push(
        format!("vsa bf16 sparsity 0.9 {lq}q x {lk}k x {heads}h x {d}"),
        t_vsa,
        0.0,
    );
    fine_kernel_rows(dev, heavy, [q, k, v], (q_grid, k_grid), dense, "", push)?;
    // 4-latent chunks over a 20-frame window (FlashDreams' 4-frame LingBot preset, with a window
    // that is whole tiles in time): every query tile then spans four frames, where the 3-frame
    // chunk above fills at most three of its four, so this row shows what the tile fill costs
    // the 4× target.
    {
        let (q_grid, k_grid) = ([4, 30, 52], [20, 30, 52]);
        let (lq4, lk4) = (4 * 30 * 52, 20 * 30 * 52);
        let q4 = rand(dev, 6, &[lq4, heads, d], 1.0, DType::BF16)?;
        let k4 = rand(dev, 7, &[lk4, heads, d], 1.0, DType::BF16)?;
        let v4 = rand(dev, 8, &[lk4, heads, d], 1.0, DType::BF16)?;
        let dense = time(dev, heavy, || {
            ops::attention(&q4, &k4, &v4, lk4, AttnMask::None)?;
            Ok(())
        })?;
        let (top_k, tiles, sparse) = time_vsa(dev, heavy, [&q4, &k4, &v4], q_grid, k_grid)?;
        println!(
            "vsa sparsity 0.9, 4-frame chunk ({top_k} of {tiles} key tiles): {:.3} ms = {:.2}x \
             faster than our dense {:.3} ms",
            sparse.as_secs_f64() * 1e3,
            dense.as_secs_f64() / sparse.as_secs_f64(),
            dense.as_secs_f64() * 1e3
        );
        push(
            format!("attention bf16 {lq4}q x {lk4}k x {heads}h x {d} (4-frame chunk)"),
            dense,
            flops::attention(lq4, lk4, heads * d),
        );
        push(
            format!("vsa bf16 sparsity 0.9 {lq4}q x {lk4}k x {heads}h x {d} (4-frame chunk)"),
            sparse,
            0.0,
        );
        let qkv = [&q4, &k4, &v4];
        fine_kernel_rows(
            dev,
            heavy,
            qkv,
            (q_grid, k_grid),
            dense,
            "4-frame chunk, ",
            push,
        )?;
    }
    // Where one VSA call's time goes: stream time per kind of launch (tile means and the coarse
    // stage are `vsa`; V's transpose and the wgmma fine stage `attention`), and the stream's idle
    // time between them.
    if let Device::Cuda(i) = dev {
        let b = kernels::cuda::backend(i)?;
        b.synchronize()?;
        b.profile(true);
        let ran = kernels::vsa::attention(q, k, v, None, q_grid, k_grid, top_k);
        b.profile(false);
        ran?;
        println!(
            "vsa profile (one call, events around each launch): {}",
            profile_line(&b.take_profile()?)
        );
    }
    Ok(())
}

/// Hopper's two fine kernels (`WORLDLINE_VSA_FINE`, split and union) in turn on `q, k, v`, then
/// on [`patchy`] inputs of the same shape, each with the key tiles it loads for the input's
/// selection and its speed against `dense` (our dense attention on the shape, which does not
/// depend on the values). CUDA only: elsewhere there is one fine kernel.
fn fine_kernel_rows(
    dev: Device,
    heavy: usize,
    [q, k, v]: [&Tensor; 3],
    (q_grid, k_grid): ([usize; 3], [usize; 3]),
    dense: Duration,
    label: &str,
    push: &mut dyn FnMut(String, Duration, f64),
) -> Result<()> {
    if !matches!(dev, Device::Cuda(_)) {
        return Ok(());
    }
    let (lq, lk, heads, d) = (q.dim(0), k.dim(0), q.dim(1), q.dim(2));
    let (pq, pk) = (
        patchy(dev, 11, q_grid, heads, d)?,
        patchy(dev, 12, k_grid, heads, d)?,
    );
    for (input, q, k) in [("random", q, k), ("patchy", &pq, &pk)] {
        let tiles = kernels::vsa::tiles(k_grid, kernels::vsa::TILE);
        let sel = kernels::vsa::selection(q, k, q_grid, k_grid, kernels::vsa::top_k(0.9, tiles))?;
        let (union, split) = kernels::vsa::pair_loads(&sel);
        println!(
            "vsa {label}{input} input: a block's two query tiles keep {:.1}% of their tiles in \
             common; the union kernel loads {union} key tiles, the split kernel {split}",
            100.0 * (split - union) as f64 / (split / 2) as f64
        );
        for fine in ["split", "union"] {
            let (_, _, t) = with_fine(fine, || time_vsa(dev, heavy, [q, k, v], q_grid, k_grid))?;
            println!(
                "vsa {label}{input} input, {fine} kernel: {:.3} ms = {:.2}x faster than dense",
                t.as_secs_f64() * 1e3,
                dense.as_secs_f64() / t.as_secs_f64()
            );
            push(
                format!(
                    "vsa bf16 sparsity 0.9 {lq}q x {lk}k x {heads}h x {d} ({label}{input} input, \
                     {fine} kernel)"
                ),
                t,
                0.0,
            );
        }
    }
    Ok(())
}

/// Runs `f` with `WORLDLINE_VSA_FINE=fine` (read at each VSA call), then puts back what was set.
fn with_fine<T>(fine: &str, f: impl FnOnce() -> T) -> T {
    const VAR: &str = "WORLDLINE_VSA_FINE";
    let before = std::env::var_os(VAR);
    std::env::set_var(VAR, fine);
    let r = f();
    match before {
        Some(v) => std::env::set_var(VAR, v),
        None => std::env::remove_var(VAR),
    }
    r
}

/// A bf16 q or k on `grid` with local structure, as a video's has: per head and dim one random
/// value per 8×8-token patch of the frame (the same in every frame), plus white noise as large.
/// Neighbouring query tiles then tend to keep the same key tiles; the rows print how many they
/// do, since how alike real activations make them is not measured here.
fn patchy(dev: Device, seed: u64, grid: [usize; 3], heads: usize, d: usize) -> Result<Tensor> {
    const PATCH: usize = 8;
    let [t, h, w] = grid;
    let (ph, pw, row) = (h.div_ceil(PATCH), w.div_ceil(PATCH), heads * d);
    let field = NormalRng::new(seed).normals(ph * pw * row);
    let mut x = NormalRng::normals_par(seed + 1, t * h * w * row);
    for (g, tok) in x.chunks_mut(row).enumerate() {
        let (y, xx) = (g / w % h, g % w);
        let f = &field[((y / PATCH) * pw + xx / PATCH) * row..][..row];
        tok.iter_mut().zip(f).for_each(|(a, b)| *a += b);
    }
    Ok(Tensor::from_vec(x, &[t * h * w, heads, d])?
        .to_dtype(DType::BF16)?
        .to_device(dev)?)
}

/// `bench vsa`: our dense attention and the VSA rows of [`vsa_rows`] at 40 and 12 heads, alone
/// (the VSA part of `bench kernels`, for quick turns on the sparse path).
pub fn run_vsa(device: &str, json: Option<&Path>, repeat: usize) -> Result<()> {
    let dev: Device = device.parse().map_err(anyhow::Error::msg)?;
    anyhow::ensure!(!dev.is_cpu(), "bench vsa needs a GPU: pass --device cuda");
    dev.ensure_available()?;
    let heavy = repeat.max(PEER_REPEAT);
    let mut rows = Vec::new();
    let mut push = |what, t, flop| rows.push(Row::printed(what, t, flop));
    for heads in [40, 12] {
        let (lq, lk, d) = (4680, 28080, 128);
        let q = rand(dev, 3, &[lq, heads, d], 1.0, DType::BF16)?;
        let k = rand(dev, 4, &[lk, heads, d], 1.0, DType::BF16)?;
        let v = rand(dev, 5, &[lk, heads, d], 1.0, DType::BF16)?;
        let t = time(dev, heavy, || {
            ops::attention(&q, &k, &v, lk, AttnMask::None)?;
            Ok(())
        })?;
        push(
            format!("attention bf16 {lq}q x {lk}k x {heads}h x {d}"),
            t,
            flops::attention(lq, lk, heads * d),
        );
        vsa_rows(dev, heavy, [&q, &k, &v], t, &mut push)?;
    }
    write_rows(json, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the patchy rows are for: on LingBot's 30×52 frames, a block's two query tiles keep
    /// many more key tiles in common with patchy inputs (46 % here) than with random ones (about
    /// top_k / tiles, 10 % at sparsity 0.9).
    #[test]
    fn patchy_inputs_make_neighbouring_tiles_keep_the_same_tiles() {
        let (q_grid, k_grid, heads, d) = ([3, 30, 52], [8, 30, 52], 2, 128);
        let tiles = kernels::vsa::tiles(k_grid, kernels::vsa::TILE);
        let top_k = kernels::vsa::top_k(0.9, tiles);
        let shared = |q: &Tensor, k: &Tensor| {
            let sel = kernels::vsa::selection(q, k, q_grid, k_grid, top_k).expect("selection");
            let (union, split) = kernels::vsa::pair_loads(&sel);
            (split - union) as f64 / (split / 2) as f64
        };
        let (pq, pk) = (
            patchy(Device::Cpu, 1, q_grid, heads, d).expect("q"),
            patchy(Device::Cpu, 2, k_grid, heads, d).expect("k"),
        );
        let (rq, rk) = (
            rand(Device::Cpu, 3, &[pq.dim(0), heads, d], 1.0, DType::BF16).expect("q"),
            rand(Device::Cpu, 4, &[pk.dim(0), heads, d], 1.0, DType::BF16).expect("k"),
        );
        let (p, r) = (shared(&pq, &pk), shared(&rq, &rk));
        println!("shared: patchy {p:.3}, random {r:.3}");
        assert!(
            p > 0.3 && p > 3.0 * r,
            "patchy inputs share {p:.3}, random {r:.3}"
        );
        assert!(r < 0.2, "random inputs share {r:.3}");
    }
}
