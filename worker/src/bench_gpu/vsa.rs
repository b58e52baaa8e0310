//! The VSA rows of `bench kernels`, and `bench vsa` (those rows alone, for quick turns on the
//! sparse path): VSA at sparsity 0.9 against our dense attention on the same shape, timed in
//! ways that give neither the clock the other left.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use kernels::{ops, AttnMask, Device, Tensor};
use pipeline::flops;

use super::{profile_line, rand_qkv, round, sustained, sync, time, write_rows, Row, PEER_REPEAT};

/// FLOPs the fine branch issues: every query tile's 64 rows (padding included: a 3-frame chunk
/// fills 48 of them) against `top_k` key tiles of 64 slots, two products of head dim `d`. The
/// VSA rows' TFLOP/s are of this work, so they compare with other block-sparse kernels' rates,
/// not with dense attention's.
fn fine_flop(q_grid: [usize; 3], top_k: usize, heads: usize, d: usize) -> f64 {
    let rows = 64 * kernels::vsa::tiles(q_grid, kernels::vsa::TILE);
    4.0 * (rows * top_k * 64 * heads * d) as f64
}

/// "query tiles: R rows issued for L queries (F %); kept key slots: S for the window's K keys".
fn fill_line(q_grid: [usize; 3], k_grid: [usize; 3], top_k: usize) -> String {
    let tiles = |g| kernels::vsa::tiles(g, kernels::vsa::TILE);
    let (rows, lq) = (64 * tiles(q_grid), q_grid.iter().product::<usize>());
    let (slots, lk) = (64 * tiles(k_grid), k_grid.iter().product::<usize>());
    format!(
        "query tiles {:?} of {:?}: {rows} rows issued for {lq} queries ({:.0} % real); key tiles:          {slots} slots for {lk} keys ({:.0} % real), {top_k} kept",
        q_grid,
        kernels::vsa::TILE,
        100.0 * lq as f64 / rows as f64,
        100.0 * lk as f64 / slots as f64
    )
}

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
/// same at a 4-frame chunk over a 20- and an 18-frame window, dense and sparse; and profiled
/// calls.
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
    println!("vsa {}", fill_line(q_grid, k_grid, top_k));
    println!(
        "vsa sparsity 0.9 ({top_k} of {tiles} key tiles): {:.3} ms = {:.2}x faster than dense",
        t_vsa.as_secs_f64() * 1e3,
        dense.as_secs_f64() / t_vsa.as_secs_f64()
    );
    push(
        format!("vsa bf16 sparsity 0.9 {lq}q x {lk}k x {heads}h x {d}"),
        t_vsa,
        fine_flop(q_grid, top_k, heads, d),
    );
    fair_rows(dev, heavy, [q, k, v], (q_grid, k_grid), top_k, "", push)?;
    // 4-latent chunks: over a 20-frame window (FlashDreams' 4-frame LingBot preset, a window
    // that is whole tiles in time), and over LingBot v2's own 18-frame window (MODELS.md §5: v2
    // streams chunks of 4). Every query tile then spans four frames, where the 3-frame chunk
    // above fills at most three of its four, so these rows show what the tile fill costs the 4×
    // target.
    for window in if quick() { &[][..] } else { &[20, 18][..] } {
        let window = *window;
        let (q_grid, k_grid) = ([4, 30, 52], [window, 30, 52]);
        let (lq4, lk4) = (4 * 30 * 52, window * 30 * 52);
        let [q4, k4, v4] = rand_qkv(dev, 6, lq4, lk4, heads, d)?;
        let dense = time(dev, heavy, || {
            ops::attention(&q4, &k4, &v4, lk4, AttnMask::None)?;
            Ok(())
        })?;
        let (top_k, tiles, sparse) = time_vsa(dev, heavy, [&q4, &k4, &v4], q_grid, k_grid)?;
        let label = format!("4-frame chunk, {window}-frame window");
        println!("vsa {label}: {}", fill_line(q_grid, k_grid, top_k));
        println!(
            "vsa sparsity 0.9, {label} ({top_k} of {tiles} key tiles): {:.3} ms = {:.2}x \
             faster than our dense {:.3} ms",
            sparse.as_secs_f64() * 1e3,
            dense.as_secs_f64() / sparse.as_secs_f64(),
            dense.as_secs_f64() * 1e3
        );
        push(
            format!("attention bf16 {lq4}q x {lk4}k x {heads}h x {d} ({label})"),
            dense,
            flops::attention(lq4, lk4, heads * d),
        );
        push(
            format!("vsa bf16 sparsity 0.9 {lq4}q x {lk4}k x {heads}h x {d} ({label})"),
            sparse,
            fine_flop(q_grid, top_k, heads, d),
        );
        fair_rows(
            dev,
            heavy,
            [&q4, &k4, &v4],
            (q_grid, k_grid),
            top_k,
            &format!("{label}, "),
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
        b.profile(true);
        let select = kernels::vsa::Coarse::SelectOnly;
        let ran = kernels::vsa::attention_with(q, k, v, select, q_grid, k_grid, top_k);
        b.profile(false);
        ran?;
        println!(
            "vsa select-only profile (one call): {}",
            profile_line(&b.take_profile()?)
        );
    }
    Ok(())
}

/// A timed call.
type Op<'a> = dyn FnMut() -> Result<()> + 'a;

/// VSA against our dense attention on `q, k, v`, timed so that neither catches the card in a
/// state the other left. The H200 runs under a power cap, and a row timed right after dense
/// attention (740 TFLOP/s) starts at the clock that left: on 2026-12-05 one build's VSA call
/// measured 1.44 ms there and 1.29 ms a few rows later, on the same inputs. Two ways, each with
/// its ratio: sustained (each op back to back for two seconds, at the clock it holds alone) and
/// interleaved (a dense call, a VSA call, a select-only one and the two forms with the means from
/// a cache's frame sums, `repeat` times, all under the same mixed load, as in a model's stream where attention
/// sits between GEMMs).
fn fair_rows(
    dev: Device,
    repeat: usize,
    [q, k, v]: [&Tensor; 3],
    (q_grid, k_grid): ([usize; 3], [usize; 3]),
    top_k: usize,
    label: &str,
    push: &mut dyn FnMut(String, Duration, f64),
) -> Result<()> {
    let (lq, lk, heads, d) = (q.dim(0), k.dim(0), q.dim(1), q.dim(2));
    let mut dense = || -> Result<()> {
        ops::attention(q, k, v, lk, AttnMask::None)?;
        Ok(())
    };
    let mut sparse = || -> Result<()> {
        kernels::vsa::attention(q, k, v, None, q_grid, k_grid, top_k)?;
        Ok(())
    };
    // The model's form (`--attention vsa`): the fine branch alone, no value means.
    let mut only = || -> Result<()> {
        let select = kernels::vsa::Coarse::SelectOnly;
        kernels::vsa::attention_with(q, k, v, select, q_grid, k_grid, top_k)?;
        Ok(())
    };
    // As a streaming cache runs it: the key (and value) tile means from per-frame slab sums
    // the cache keeps, where each call pays for summing its chunk's frames (the window's last
    // q_grid[0]) and writing them into the sums, not for reading the whole window.
    let chunk = [q_grid[0], k_grid[1], k_grid[2]];
    let chunk_at = (k_grid[0] - q_grid[0]) * k_grid[1] * k_grid[2];
    let slabs_at = (k_grid[0] - q_grid[0]) * kernels::vsa::slabs_per_frame([k_grid[1], k_grid[2]]);
    let resum = |sums: &mut Tensor, x: &Tensor| -> Result<()> {
        kernels::vsa::frame_sums_into(sums, slabs_at, x, chunk_at, chunk)?;
        Ok(())
    };
    let (mut ks, mut vs) = (
        kernels::vsa::frame_sums(k, 0, k_grid)?,
        kernels::vsa::frame_sums(v, 0, k_grid)?,
    );
    let mut summed = || -> Result<()> {
        resum(&mut ks, k)?;
        resum(&mut vs, v)?;
        let sums = kernels::vsa::KeySums {
            k: &ks,
            v: Some(&vs),
            q: None,
        };
        let added = kernels::vsa::Coarse::Added;
        kernels::vsa::attention_cached(q, k, v, sums, added, q_grid, k_grid, top_k)?;
        Ok(())
    };
    let mut ks_only = kernels::vsa::frame_sums(k, 0, k_grid)?;
    let mut only_summed = || -> Result<()> {
        resum(&mut ks_only, k)?;
        let sums = kernels::vsa::KeySums {
            k: &ks_only,
            v: None,
            q: None,
        };
        let select = kernels::vsa::Coarse::SelectOnly;
        kernels::vsa::attention_cached(q, k, v, sums, select, q_grid, k_grid, top_k)?;
        Ok(())
    };
    let ms = |t: Duration| t.as_secs_f64() * 1e3;
    let shape = format!("{lq}q x {lk}k x {heads}h x {d}");

    let (td, nd) = sustained(dev, &mut dense)?;
    let (ts, ns) = sustained(dev, &mut sparse)?;
    println!(
        "vsa {label}sustained: dense {:.3} ms ({nd} calls), vsa {:.3} ms ({ns} calls) = {:.2}x \
         faster than dense",
        ms(td),
        ms(ts),
        td.as_secs_f64() / ts.as_secs_f64()
    );
    let flop = flops::attention(lq, lk, heads * d);
    push(
        format!("attention bf16 {shape} ({label}sustained)"),
        td,
        flop,
    );
    let fine = fine_flop(q_grid, top_k, heads, d);
    push(
        format!("vsa bf16 sparsity 0.9 {shape} ({label}sustained)"),
        ts,
        fine,
    );
    // The engine's form against dense by the same statistic, dense first and last (each two
    // seconds, in the order dense, VSA, VSA, dense), so a clock that drifts over the four runs
    // weighs on both alike. Both hold the card at its power cap (H100, 2026-12-06: ~692 W), so
    // this ratio is one of energy per call.
    let mut runs = [Duration::ZERO; 4];
    runs[0] = sustained(dev, &mut dense)?.0;
    runs[1] = sustained(dev, &mut only_summed)?.0;
    runs[2] = sustained(dev, &mut only_summed)?.0;
    runs[3] = sustained(dev, &mut dense)?.0;
    let (tdd, tee) = ((runs[0] + runs[3]) / 2, (runs[1] + runs[2]) / 2);
    println!(
        "vsa {label}select-only from a cache's key sums (the engine's form), sustained in turn \
         with dense: dense {:.3} ms, vsa {:.3} ms = {:.2}x faster than dense (runs: dense {:.3}, \
         {:.3}; vsa {:.3}, {:.3})",
        ms(tdd),
        ms(tee),
        tdd.as_secs_f64() / tee.as_secs_f64(),
        ms(runs[0]),
        ms(runs[3]),
        ms(runs[1]),
        ms(runs[2])
    );
    push(
        format!("vsa bf16 sparsity 0.9 select-only from key sums {shape} ({label}sustained, in turn with dense)"),
        tee,
        fine,
    );

    // Round-robin, so that each op starts where the others leave the clock.
    let mut ops: [(&str, &str, &mut Op); 5] = [
        ("dense", "attention bf16", &mut dense),
        ("vsa", "vsa bf16 sparsity 0.9", &mut sparse),
        (
            "select-only (the model's form)",
            "vsa bf16 sparsity 0.9 select-only",
            &mut only,
        ),
        (
            "vsa with the means from a cache's frame sums",
            "vsa bf16 sparsity 0.9 from frame sums",
            &mut summed,
        ),
        (
            "select-only from a cache's key sums (the engine's form)",
            "vsa bf16 sparsity 0.9 select-only from key sums",
            &mut only_summed,
        ),
    ];
    for (_, _, f) in ops.iter_mut() {
        f()?;
    }
    sync(dev)?;
    let mut times = vec![Vec::new(); ops.len()];
    for _ in 0..repeat.max(1) {
        for ((_, _, f), t) in ops.iter_mut().zip(&mut times) {
            t.push(round(dev, 1, &mut **f)?.device);
        }
    }
    // Best and median of each.
    let stats: Vec<(Duration, Duration)> = times
        .iter_mut()
        .map(|t| {
            t.sort();
            (t[0], t[t.len() / 2])
        })
        .collect();
    let (db, dm) = stats[0];
    println!(
        "vsa {label}interleaved, {} rounds: dense best {:.3} ms, median {:.3}",
        repeat.max(1),
        ms(db),
        ms(dm)
    );
    push(
        format!("attention bf16 {shape} ({label}interleaved)"),
        db,
        flop,
    );
    for ((name, row, _), &(b, m)) in ops.iter().zip(&stats).skip(1) {
        println!(
            "vsa {label}{name}, interleaved: best {:.3} ms, median {:.3} = {:.2}x faster than \
             dense (best), {:.2}x (median)",
            ms(b),
            ms(m),
            db.as_secs_f64() / b.as_secs_f64(),
            dm.as_secs_f64() / m.as_secs_f64()
        );
        push(format!("{row} {shape} ({label}interleaved)"), b, fine);
    }
    // Each op alone, as the table's other rows and their peers are timed (`bench kernels`,
    // peer.py): after a second's rest (the power cap released, whatever ran before), one
    // untimed call, then `repeat` rounds back to back. Interleaved, the engine's form runs at
    // the clock dense leaves (an H100, 2026-12-07: 1.004 ms best there, 0.881 ms in rounds of
    // VSA alone); here each op starts from the same rest. Not the same as rounds after other
    // VSA calls: on that H100 the engine's form took 0.905 ms best here against 0.881 in the
    // A/B's rounds, as if its ~18 ms of rounds began before the clock was back up (not traced).
    let (dab, dam) = alone(dev, repeat, &mut dense)?;
    let (vab, vam) = alone(dev, repeat, &mut only_summed)?;
    println!(
        "vsa {label}select-only from a cache's key sums (the engine's form), each op alone \
         ({} rounds after a 1 s rest): dense best {:.3} ms, median {:.3}; vsa best {:.3} ms, \
         median {:.3} = {:.2}x faster than dense (best), {:.2}x (median)",
        repeat.max(1),
        ms(dab),
        ms(dam),
        ms(vab),
        ms(vam),
        dab.as_secs_f64() / vab.as_secs_f64(),
        dam.as_secs_f64() / vam.as_secs_f64()
    );
    push(format!("attention bf16 {shape} ({label}alone)"), dab, flop);
    push(
        format!("vsa bf16 sparsity 0.9 select-only from key sums {shape} ({label}alone)"),
        vab,
        fine,
    );
    fed_rows(
        dev,
        repeat,
        [q, k, v],
        (q_grid, k_grid),
        top_k,
        label,
        &mut dense,
        push,
    )?;
    // Where the engine's form spends its time: one call as timed above (the chunk's frames
    // summed into the cache's sums, then the call), events around each launch.
    if let Device::Cuda(i) = dev {
        let b = kernels::cuda::backend(i)?;
        b.synchronize()?;
        b.profile(true);
        let ran = only_summed();
        b.profile(false);
        ran?;
        println!(
            "vsa {label}engine's form profile (one call): {}",
            profile_line(&b.take_profile()?)
        );
    }
    Ok(())
}

/// The engine's form as the model runs it since the q and k norm + RoPE launches leave their
/// outputs' slab sums (`ops::rms_norm_rope_sums`, `ops::rms_norm_rope_into_sums`): the VSA call
/// then reads no token before its coarse stage (its means come from the queries' sums and the
/// cache's key sums), and what those launches take beyond the plain ones (the dense path's) is
/// charged to it. Timed three ways against dense, as above; the norm + RoPE pairs (q, and the
/// chunk's keys into a copy of the window) are timed in the same rounds.
#[allow(clippy::too_many_arguments)]
fn fed_rows(
    dev: Device,
    repeat: usize,
    [q, k, v]: [&Tensor; 3],
    (q_grid, k_grid): ([usize; 3], [usize; 3]),
    top_k: usize,
    label: &str,
    dense: &mut Op,
    push: &mut dyn FnMut(String, Duration, f64),
) -> Result<()> {
    let (heads, d) = (q.dim(1), q.dim(2));
    let table = kernels::RopeTable::new(d, 1024, 1e4)?;
    let t_off = k_grid[0] - q_grid[0];
    let w = Tensor::from_vec(vec![1.0f32; heads * d], &[heads * d])?.to_device(dev)?;
    let chunk_at = t_off * k_grid[1] * k_grid[2];
    let slabs_at = t_off * kernels::vsa::slabs_per_frame([k_grid[1], k_grid[2]]);
    // q stands in for the k linear's output too: only the launches' time is used.
    let (mut keys_plain, mut keys_summed) = (k.clone(), k.clone());
    let mut key_sums = kernels::vsa::frame_sums(k, 0, k_grid)?;
    let mut rope_plain = || -> Result<()> {
        ops::rms_norm_rope(q, None, &w, 1e-6, q_grid, t_off, &table)?;
        let keys = &mut keys_plain;
        ops::rms_norm_rope_into(q, None, &w, 1e-6, q_grid, t_off, &table, keys, chunk_at)?;
        Ok(())
    };
    let mut rope_summed = || -> Result<()> {
        ops::rms_norm_rope_sums(q, None, &w, 1e-6, q_grid, t_off, &table)?;
        let (keys, sums) = (&mut keys_summed, &mut key_sums);
        ops::rms_norm_rope_into_sums(
            q, None, &w, 1e-6, q_grid, t_off, &table, keys, chunk_at, sums, slabs_at,
        )?;
        Ok(())
    };
    let (ks, qs) = (
        kernels::vsa::frame_sums(k, 0, k_grid)?,
        kernels::vsa::frame_sums(q, 0, q_grid)?,
    );
    let mut fed = || -> Result<()> {
        let sums = kernels::vsa::KeySums {
            k: &ks,
            v: None,
            q: Some(&qs),
        };
        let only = kernels::vsa::Coarse::SelectOnly;
        kernels::vsa::attention_cached(q, k, v, sums, only, q_grid, k_grid, top_k)?;
        Ok(())
    };
    let ms = |t: Duration| t.as_secs_f64() * 1e3;
    let ratio = |dense: Duration, vsa: Duration, extra: f64| {
        dense.as_secs_f64() / (vsa.as_secs_f64() + extra.max(0.0))
    };
    let extra = |plain: Duration, summed: Duration| summed.as_secs_f64() - plain.as_secs_f64();
    let shape = format!(
        "{}q x {}k x {heads}h x {d}",
        q.dim(0),
        k_grid.iter().product::<usize>()
    );
    let fine = fine_flop(q_grid, top_k, heads, d);

    // Interleaved: dense, the call, the two norm + RoPE pairs, `repeat` rounds.
    let mut ops4: [&mut Op; 4] = [dense, &mut fed, &mut rope_plain, &mut rope_summed];
    for f in ops4.iter_mut() {
        f()?;
    }
    sync(dev)?;
    let mut times = vec![Vec::new(); 4];
    for _ in 0..repeat.max(1) {
        for (f, t) in ops4.iter_mut().zip(&mut times) {
            t.push(round(dev, 1, &mut **f)?.device);
        }
    }
    let [(db, dm), (vb, vm), (pb, pm), (sb, sm)]: [(Duration, Duration); 4] =
        std::array::from_fn(|i| {
            times[i].sort();
            (times[i][0], times[i][times[i].len() / 2])
        });
    let (xb, xm) = (extra(pb, sb), extra(pm, sm));
    println!(
        "vsa {label}fed by the norm + RoPE launches' sums (the engine's form), interleaved, {}          rounds: dense best {:.3} ms, median {:.3}; vsa best {:.3} ms, median {:.3}; q and k          norm + RoPE plain {:.3} / {:.3}, with the sums {:.3} / {:.3} (+{:.3} / +{:.3} ms charged          to vsa) = {:.2}x faster than dense (best), {:.2}x (median)",
        repeat.max(1),
        ms(db),
        ms(dm),
        ms(vb),
        ms(vm),
        ms(pb),
        ms(pm),
        ms(sb),
        ms(sm),
        xb * 1e3,
        xm * 1e3,
        ratio(db, vb, xb),
        ratio(dm, vm, xm)
    );
    push(
        format!("vsa bf16 sparsity 0.9 fed by the rope sums {shape} ({label}interleaved)"),
        vb,
        fine,
    );
    // Sustained in turn: dense, VSA, VSA, dense, then the two norm + RoPE pairs.
    let mut runs = [Duration::ZERO; 6];
    for (i, f) in [0, 1, 1, 0, 2, 3].into_iter().zip(&mut runs) {
        *f = sustained(dev, &mut *ops4[i])?.0;
    }
    let (td, tv) = ((runs[0] + runs[3]) / 2, (runs[1] + runs[2]) / 2);
    let xs = extra(runs[4], runs[5]);
    println!(
        "vsa {label}fed by the norm + RoPE launches' sums, sustained in turn: dense {:.3} ms, vsa          {:.3} ms, norm + RoPE plain {:.3}, with the sums {:.3} (+{:.3} ms charged to vsa) =          {:.2}x faster than dense",
        ms(td),
        ms(tv),
        ms(runs[4]),
        ms(runs[5]),
        xs * 1e3,
        ratio(td, tv, xs)
    );
    push(
        format!("vsa bf16 sparsity 0.9 fed by the rope sums {shape} ({label}sustained, in turn with dense)"),
        tv,
        fine,
    );
    // Each alone after a second's rest, as above.
    let [da, va, pa, sa] = [0, 1, 2, 3].map(|i| alone(dev, repeat, &mut *ops4[i]));
    let (da, va, pa, sa) = (da?.0, va?.0, pa?.0, sa?.0);
    println!(
        "vsa {label}fed by the norm + RoPE launches' sums, each op alone (best): dense {:.3} ms,          vsa {:.3} ms, norm + RoPE plain {:.3}, with the sums {:.3} (+{:.3} ms charged to vsa) =          {:.2}x faster than dense",
        ms(da),
        ms(va),
        ms(pa),
        ms(sa),
        extra(pa, sa) * 1e3,
        ratio(da, va, extra(pa, sa))
    );
    if let Device::Cuda(i) = dev {
        let b = kernels::cuda::backend(i)?;
        b.synchronize()?;
        b.profile(true);
        let ran = ops4[1]();
        b.profile(false);
        ran?;
        println!(
            "vsa {label}fed form profile (one call): {}",
            profile_line(&b.take_profile()?)
        );
    }
    Ok(())
}

/// One op alone, best and median: a second's rest (the power cap released, whatever ran
/// before), one untimed call, then `repeat` rounds back to back.
fn alone(dev: Device, repeat: usize, f: &mut Op) -> Result<(Duration, Duration)> {
    std::thread::sleep(Duration::from_secs(1));
    f()?;
    sync(dev)?;
    let mut t = (0..repeat.max(1))
        .map(|_| Ok(round(dev, 1, &mut *f)?.device))
        .collect::<Result<Vec<_>>>()?;
    t.sort();
    Ok((t[0], t[t.len() / 2]))
}

fn quick() -> bool {
    std::env::var("WORLDLINE_BENCH_VSA_QUICK").is_ok_and(|v| v == "1")
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
    // `WORLDLINE_BENCH_VSA_QUICK=1`: the shape alone (40 heads, 3-frame chunk), for a
    // device call with little time left.
    let quick = quick();
    for heads in if quick { &[40][..] } else { &[40, 12][..] } {
        let heads = *heads;
        let (lq, lk, d) = (4680, 28080, 128);
        let [q, k, v] = rand_qkv(dev, 3, lq, lk, heads, d)?;
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
    // The fine kernel's A/B comes last and its failure costs only its rows: its variant may not
    // have run on a GPU before, and a fault on the device ends every launch after it.
    if matches!(dev, Device::Cuda(_)) && !quick {
        if let Err(e) = super::variants::vsa_ab(dev, heavy, &mut push) {
            println!("vsa fine kernel A/B failed, its rows left out: {e:#}");
        }
    }
    write_rows(json, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fine_branch_counts_padded_query_rows_and_whole_key_tiles() {
        // LingBot's 3-frame chunk: 1 × 8 × 13 query tiles of 64 rows against 52 key tiles.
        let want = 4.0 * (104 * 64) as f64 * (52 * 64) as f64 * (40 * 128) as f64;
        assert_eq!(fine_flop([3, 30, 52], 52, 40, 128), want);
        let line = fill_line([3, 30, 52], [18, 30, 52], 52);
        assert!(
            line.contains("6656 rows issued for 4680 queries (70 % real)"),
            "{line}"
        );
        assert!(
            line.contains("33280 slots for 28080 keys (84 % real)"),
            "{line}"
        );
        // Four frames fill every query tile in time.
        let line = fill_line([4, 30, 52], [20, 30, 52], 65);
        assert!(line.contains("(94 % real)"), "{line}");
    }
}
