//! VSA on a GPU (`kernels/gpu/vsa.cu`), one source for both vendors (declared by `cuda::ops`
//! and `rocm::ops` with `#[path]`): tile means, the coarse branch with the top-k selection, the
//! fine branch over the kept tiles (on sm_90a the TMA kernel of attention.cu, on MFMA
//! architectures its MFMA kernel, through the vendor module's `vsa_fine_fast`). The tiling
//! is index arrays written on the device: uploads from the host would stall the stream before
//! the first launch (0.15 ms of a 1.75 ms call on the H200).

#[allow(unused_imports)] // the ROCm side has these as inherent methods
use super::PushKernelArg;
use super::{
    cast, push, push_mut, storage, storage_mut, suffix, wrap, Backend as CudaBackend,
    DeviceBuf as CudaSlice, GpuData as CudaData, GpuStorage as CudaStorage, LaunchConfig,
};
use std::sync::{Arc, Mutex};

use crate::vsa::{sums_len, tiles, Coarse, KeySums, Tiling, TILE};
use crate::{DType, Result, Tensor};

/// Warps per block of the fine kernel (`WL_VSA_WARPS`).
const FINE_WARPS: usize = 4;
/// Threads of a means block (`WL_VSA_MEAN_THREADS`), each summing 16 bytes of columns.
const MEAN_THREADS: usize = 128;
/// Threads of a coarse block (`WL_VSA_COARSE_THREADS`).
const COARSE_THREADS: usize = 256;
/// Shared memory a coarse block may take without opting in on CUDA.
const COARSE_SMEM_LIMIT: usize = 48 << 10;

/// Query tiles per coarse block (a kernel per choice, `vsa_coarse_{qg}`) and its dynamic shared
/// memory: the most tiles whose scores, over every key tile, fit (beside the static `qg × 256`
/// floats of query means), for the fewest reads of the key-tile means; the coarse output's
/// partial sums reuse that memory. A block of one tile still takes 12 032 key tiles.
fn coarse_shape(nk: usize) -> Option<(usize, usize)> {
    let nks = nk.next_multiple_of(4);
    [8, 4, 2, 1].into_iter().find_map(|qg| {
        let dynamic = 4 * (qg * nks).max(COARSE_THREADS * qg * 4);
        (dynamic + qg * 256 * 4 <= COARSE_SMEM_LIMIT).then_some((qg, dynamic))
    })
}

/// Floats of `nk` key tiles' means in the coarse kernel's layout (vsa.cu's `vsa_kt`: each head's
/// d rounded up to whole float4s).
fn key_means_len(nk: usize, row: usize, d: usize) -> usize {
    nk * row / d.max(1) * d.next_multiple_of(4)
}

/// A grid's tiling on a device: `[order, offsets, sizes]`.
type DeviceTiling = Arc<[CudaSlice<i32>; 3]>;

/// Tilings already made, by device and grid: `vsa_tiling` writes the same arrays for a grid
/// every time, and two launches a call (the query and the key grid) took ~24 µs of a 14B VSA
/// call on an H100 (2026-12-06). A stream's chunks keep one query grid and one key grid, so a
/// few entries serve a process; past [`TILINGS_KEPT`] the oldest is let go (its arrays freed in
/// stream order, after any launch queued before reads them).
static TILINGS: Mutex<Vec<(TilingKey, DeviceTiling)>> = Mutex::new(Vec::new());
/// A device's ordinal and a token grid.
type TilingKey = (usize, [usize; 3]);
const TILINGS_KEPT: usize = 16;

/// The tiling of `grid` on `dev`, made on its first use there.
fn device_tiling(dev: &CudaBackend, grid: [usize; 3]) -> Result<DeviceTiling> {
    let key = (dev.ordinal, grid);
    // Held while a missing tiling is made, so two threads sharing the device make it once;
    // its launch is queued on the device's one ops stream before any call can read it.
    let mut kept = TILINGS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, t)) = kept.iter().find(|(k, _)| *k == key) {
        return Ok(t.clone());
    }
    let t = Arc::new(make_tiling(dev, grid)?);
    if kept.len() >= TILINGS_KEPT {
        kept.remove(0);
    }
    kept.push((key, t.clone()));
    Ok(t)
}

/// The tiling of `grid` as device index arrays `[order, offsets, sizes]` (vsa.cu's `vsa_tiling`:
/// the same arrays as [`Tiling::new`]).
fn make_tiling(dev: &CudaBackend, grid: [usize; 3]) -> Result<[CudaSlice<i32>; 3]> {
    let n = tiles(grid, TILE);
    let tokens: usize = grid.iter().product();
    if i32::try_from(tokens).is_err() {
        return Err(dev.err(format!("vsa: grid {grid:?} exceeds i32 indices")));
    }
    let [gt, gh, gw] = grid.map(|x| x as i32);
    let e = |e| dev.err(e);
    // SAFETY: vsa_tiling writes every tile's offset and size and every token's position.
    let (mut order, mut offsets, mut sizes) = unsafe {
        (
            dev.stream.alloc::<i32>(tokens.max(1)).map_err(e)?,
            dev.stream.alloc::<i32>(n.max(1)).map_err(e)?,
            dev.stream.alloc::<i32>(n.max(1)).map_err(e)?,
        )
    };
    let n32 = n as i32;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(kind = "vsa means"; dev, "vsa", "vsa_tiling", cfg, |b| {
        b.arg(&mut order).arg(&mut offsets).arg(&mut sizes);
        b.arg(&gt).arg(&gh).arg(&gw).arg(&n32);
    });
    Ok([order, offsets, sizes])
}

pub(super) fn upload(dev: &CudaBackend, v: &[usize]) -> Result<CudaSlice<i32>> {
    let v: Vec<i32> = v
        .iter()
        .map(|&x| i32::try_from(x).map_err(|_| dev.err(format!("vsa: index {x} exceeds i32"))))
        .collect::<Result<_>>()?;
    dev.stream.clone_htod(&v).map_err(|e| dev.err(e))
}

fn f32_data(s: &CudaStorage) -> Result<&CudaSlice<f32>> {
    match &s.data {
        CudaData::F32(d) => Ok(d),
        _ => Err(s.dev.err("vsa: expected f32 scratch")),
    }
}

/// Tile means (f32) of q on its tiling and of k and v on the key tiling, in grid order, one
/// launch: q's and v's `[tiles, heads, d]`, k's in the coarse kernel's layout (vsa.cu's
/// `vsa_kt`); without `with_v`, v's are not computed (a one-element buffer stands in).
fn tile_means(
    qkv: [&Tensor; 3],
    (nq, nk): (usize, usize),
    qi: &[CudaSlice<i32>; 3],
    ki: &[CudaSlice<i32>; 3],
    with_v: bool,
) -> Result<[CudaStorage; 3]> {
    let [q, k, v] = qkv;
    let d = q.dim(2);
    let row = q.dim(1) * d;
    let name = format!("vsa_tile_means_{}", suffix(q.dtype())?);
    let (qs, ks, vs) = (storage(q)?, storage(k)?, storage(v)?);
    let dev = &qs.dev;
    let mut qm = CudaStorage::alloc(dev, DType::F32, nq * row)?;
    let mut km = CudaStorage::alloc(dev, DType::F32, key_means_len(nk, row, d).max(1))?;
    let mut vm = CudaStorage::alloc(dev, DType::F32, if with_v { nk * row } else { 1 })?;
    let chunks = row.div_ceil(MEAN_THREADS * 16 / q.dtype().size_in_bytes());
    // Jobs run q's tiles, then k's, then v's: leaving v's out is launching fewer blocks.
    let blocks = (nq + if with_v { 2 } else { 1 } * nk) * chunks;
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(blocks).map_err(|_| dev.err(format!("vsa: {blocks} means blocks")))?,
            1,
            1,
        ),
        block_dim: (MEAN_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (nq32, nk32, row32, chunks32, d32) =
        (nq as i32, nk as i32, row as i32, chunks as i32, d as i32);
    launch!(
        kind = "vsa means";
        dev,
        "vsa",
        name,
        cfg,
        |b| {
            push_mut(b, &mut qm.data);
            push_mut(b, &mut km.data);
            push_mut(b, &mut vm.data);
            push(b, &qs.data);
            push(b, &ks.data);
            push(b, &vs.data);
            b.arg(&qi[0]).arg(&qi[1]).arg(&qi[2]);
            b.arg(&ki[0]).arg(&ki[1]).arg(&ki[2]);
            b.arg(&nq32).arg(&nk32).arg(&row32).arg(&chunks32).arg(&d32);
        }
    );
    Ok([qm, km, vm])
}

/// The query tiles' means (`[tiles, heads, d]`), and the key tile means (in the coarse kernel's
/// layout, `vsa_kt`) and value tile means (`[tiles, heads, d]`) from a cache's frame sums, in one
/// launch (vsa.cu's `vsa_means_from_sums_*`, or with the queries' sums given,
/// `vsa_means_all_sums`); without `with_v`, a one-element buffer stands in for v's.
fn cached_means(
    q: &Tensor,
    qi: &[CudaSlice<i32>; 3],
    nq: usize,
    sums: KeySums,
    (q_grid, k_grid): ([usize; 3], [usize; 3]),
    with_v: bool,
) -> Result<[CudaStorage; 3]> {
    let (heads, d) = (q.dim(1), q.dim(2));
    let row = heads * d;
    let qs = storage(q)?;
    let dev = &qs.dev;
    let nk = tiles(k_grid, TILE);
    let ks = storage(sums.k)?;
    let vs = match (with_v, sums.v) {
        (true, Some(v)) => storage(v)?,
        (true, None) => return Err(dev.err("vsa: the coarse output needs the values' sums")),
        (false, _) => ks,
    };
    let (ksd, vsd) = (f32_data(ks)?, f32_data(vs)?);
    let mut qm = CudaStorage::alloc(dev, DType::F32, nq * row)?;
    let mut km = CudaStorage::alloc(dev, DType::F32, key_means_len(nk, row, d))?;
    let mut vm = CudaStorage::alloc(dev, DType::F32, if with_v { nk * row } else { 1 })?;
    // The queries: a thread per 16 bytes of a tile's columns. The sums: a thread per float4 of a
    // row where a head's row is whole float4s (the buffers are whole allocations, so 16-byte
    // aligned), else per column.
    let q_chunks = row.div_ceil(MEAN_THREADS * 16 / q.dtype().size_in_bytes());
    let per = if d.is_multiple_of(4) { 4 } else { 1 };
    let s_chunks = row.div_ceil(MEAN_THREADS * per);
    let q_blocks = nq * if sums.q.is_some() { s_chunks } else { q_chunks };
    let blocks = q_blocks + nk * if with_v { 2 } else { 1 } * s_chunks;
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(blocks).map_err(|_| dev.err(format!("vsa: {blocks} means blocks")))?,
            1,
            1,
        ),
        block_dim: (MEAN_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let [gt, gh, gw] = k_grid.map(|x| x as i32);
    let (nq32, qc32, nk32, row32) = (nq as i32, q_chunks as i32, nk as i32, row as i32);
    let (sc32, per32, d32) = (s_chunks as i32, per as i32, d as i32);
    if let Some(q_sums) = sums.q {
        // The queries' means from their slab sums too: no block reads a token.
        let qsd = f32_data(storage(q_sums)?)?;
        let [qt, qh, qw] = q_grid.map(|x| x as i32);
        launch!(kind = "vsa means"; dev, "vsa", "vsa_means_all_sums", cfg, |b| {
            push_mut(b, &mut qm.data);
            b.arg(qsd).arg(&qt).arg(&qh).arg(&qw).arg(&nq32);
            push_mut(b, &mut km.data);
            push_mut(b, &mut vm.data);
            b.arg(ksd).arg(vsd);
            b.arg(&gt).arg(&gh).arg(&gw).arg(&nk32).arg(&row32).arg(&sc32).arg(&per32).arg(&d32);
        });
        return Ok([qm, km, vm]);
    }
    let name = format!("vsa_means_from_sums_{}", suffix(q.dtype())?);
    launch!(kind = "vsa means"; dev, "vsa", name, cfg, |b| {
        push_mut(b, &mut qm.data);
        push(b, &qs.data);
        b.arg(&qi[0]).arg(&qi[1]).arg(&qi[2]).arg(&nq32).arg(&qc32);
        push_mut(b, &mut km.data);
        push_mut(b, &mut vm.data);
        b.arg(ksd).arg(vsd);
        b.arg(&gt).arg(&gh).arg(&gw).arg(&nk32).arg(&row32).arg(&sc32).arg(&per32).arg(&d32);
    });
    Ok([qm, km, vm])
}

/// [`crate::vsa::frame_sums`] on the device (vsa.cu's `vsa_frame_sums`).
pub fn vsa_frame_sums(x: &Tensor, first: usize, grid: [usize; 3]) -> Result<Tensor> {
    let dev = &storage(x)?.dev;
    let (heads, d) = (x.dim(1), x.dim(2));
    let slabs = sums_len(grid);
    let mut out = CudaStorage::alloc(dev, DType::F32, slabs * heads * d)?;
    let at = out.device_ptr_mut()?;
    frame_sums_at(x, first, grid, at)?;
    Ok(wrap(out, &[slabs, heads, d]))
}

/// [`crate::vsa::frame_sums_into`] on the device (shapes, dtype and device checked there).
pub fn vsa_frame_sums_into(
    sums: &mut Tensor,
    row: usize,
    x: &Tensor,
    first: usize,
    grid: [usize; 3],
) -> Result<()> {
    let offset = row * x.dim(1) * x.dim(2) * DType::F32.size_in_bytes();
    let at = storage_mut(sums)?.device_ptr_mut()? + offset as u64;
    frame_sums_at(x, first, grid, at)
}

/// The launch of `vsa_frame_sums`, its f32 rows stored from device address `out`.
fn frame_sums_at(x: &Tensor, first: usize, grid: [usize; 3], out: u64) -> Result<()> {
    if !matches!(x.dtype(), DType::F32 | DType::BF16) {
        return frame_sums_at(&cast(x, DType::F32)?, first, grid, out);
    }
    let xs = storage(x)?;
    let dev = &xs.dev;
    let row = x.dim(1) * x.dim(2);
    let slabs = sums_len(grid);
    if i32::try_from(row).is_err() || i32::try_from(grid[1] * grid[2]).is_err() {
        return Err(dev.err(format!("vsa frame sums: {grid:?} × {row} exceed i32")));
    }
    let chunks = row.div_ceil(MEAN_THREADS * 16 / x.dtype().size_in_bytes());
    let blocks = slabs * chunks;
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(blocks).map_err(|_| dev.err(format!("vsa: {blocks} sums blocks")))?,
            1,
            1,
        ),
        block_dim: (MEAN_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = format!("vsa_frame_sums_{}", suffix(x.dtype())?);
    let (first64, row64) = (first as u64, row as u64);
    let (gh, gw, chunks32) = (grid[1] as i32, grid[2] as i32, chunks as i32);
    launch!(kind = "vsa means"; dev, "vsa", name, cfg, |b| {
        b.arg(&out);
        push(b, &xs.data);
        b.arg(&first64).arg(&gh).arg(&gw).arg(&row64).arg(&chunks32);
    });
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn vsa_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sums: Option<KeySums>,
    coarse_mix: Coarse,
    q_grid: [usize; 3],
    k_grid: [usize; 3],
    top_k: usize,
) -> Result<Tensor> {
    // Keys in bf16 at Wan's head dim (a GPU's KV cache) take the bf16 path whatever q's dtype,
    // as dense attention does there: an f32 query would otherwise make an f32 copy of the
    // whole cache on every call and miss the tensor-core fine kernels.
    if k.dtype() == DType::BF16 && q.dtype() != DType::BF16 && q.dim(2) == 128 {
        let gate = coarse_mix
            .gate()
            .map(|g| cast(g, DType::BF16))
            .transpose()?;
        let mix = match (&coarse_mix, &gate) {
            (Coarse::Gated(_), Some(g)) => Coarse::Gated(g),
            _ => coarse_mix,
        };
        let q16 = cast(q, DType::BF16)?;
        let out = vsa_attention(&q16, k, v, sums, mix, q_grid, k_grid, top_k)?;
        return cast(&out, q.dtype());
    }
    let s = storage(q)?;
    let dev = s.dev.clone();
    let dt = q.dtype();
    let (lq, heads, d) = (q.dim(0), q.dim(1), q.dim(2));
    if d > 256 {
        return Err(dev.err(format!("vsa: head_dim {d} > 256")));
    }
    let (nq, nk) = (tiles(q_grid, TILE), tiles(k_grid, TILE));
    let Some((qg, smem)) = coarse_shape(nk) else {
        return Err(dev.err(format!(
            "vsa: {nk} key tiles exceed the coarse kernel's shared memory"
        )));
    };
    if i32::try_from(heads * d).is_err() {
        return Err(dev.err(format!("vsa: {heads} heads × {d} exceed i32")));
    }
    let (k, v) = (cast(k, dt)?, cast(v, dt)?);
    let gate = coarse_mix.gate().map(|g| cast(g, dt)).transpose()?;
    let mix = coarse_mix.code();
    // Select-only: the coarse branch's output is neither computed nor read (nor v's means).
    let with_out = !matches!(coarse_mix, Coarse::SelectOnly);
    let (qi, ki) = (device_tiling(&dev, q_grid)?, device_tiling(&dev, k_grid)?);
    let [qc, kc, vc] = match sums {
        None => tile_means([q, &k, &v], (nq, nk), &qi, &ki, with_out)?,
        // Only the queries' means read the tokens; the keys' come from the cache's sums.
        Some(sums) => cached_means(q, &qi, nq, sums, (q_grid, k_grid), with_out)?,
    };
    let coarse_len = if with_out { nq * heads * d } else { 1 };
    let mut coarse = CudaStorage::alloc(&dev, DType::F32, coarse_len)?;
    // SAFETY: the coarse kernel writes all top_k entries of every (query tile, head) row
    // (vsa::attention_inner checks 1 ≤ top_k ≤ nk), so no launch reads an unwritten one; zeroing
    // them first was a memset launch on each call.
    let mut kept =
        unsafe { dev.stream.alloc::<i32>(nq * heads * top_k) }.map_err(|e| dev.err(e))?;
    let scale = 1.0 / (d as f32).sqrt();
    let (nq32, nk32, h32, d32, k32) = (nq as i32, nk as i32, heads as i32, d as i32, top_k as i32);
    let with_out32 = i32::from(with_out);
    let cfg = LaunchConfig {
        grid_dim: (nq.div_ceil(qg) as u32, heads as u32, 1),
        block_dim: (COARSE_THREADS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (qcd, kcd, vcd) = (f32_data(&qc)?, f32_data(&kc)?, f32_data(&vc)?);
    let coarse_fn = format!("vsa_coarse_{qg}");
    launch!(kind = "vsa coarse+top-k"; &dev, "vsa", &coarse_fn, cfg, |b| {
        push_mut(b, &mut coarse.data);
        b.arg(&mut kept).arg(qcd).arg(kcd).arg(vcd);
        b.arg(&nq32).arg(&nk32).arg(&h32).arg(&d32).arg(&k32).arg(&scale).arg(&with_out32);
    });
    // Tensor cores where the vendor module has them (CUDA on sm_90a: TMA boxes of 4×4×4 tokens).
    if let Some(out) = super::vsa_fine_fast(
        q,
        &k,
        &v,
        (mix, gate.as_ref()),
        f32_data(&coarse)?,
        &kept,
        (q_grid, &qi),
        (k_grid, &ki),
        top_k,
    )? {
        return Ok(out);
    }
    // The portable fine kernel also takes each tiled query position's tile.
    let qt = Tiling::new(q_grid, TILE);
    let mut q_tile = vec![0usize; lq];
    for j in 0..nq {
        q_tile[qt.offsets[j]..qt.offsets[j] + qt.sizes[j]].fill(j);
    }
    let q_tile = upload(&dev, &q_tile)?;
    let mut out = CudaStorage::alloc(&dev, dt, q.elem_count())?;
    let jobs = lq * heads;
    let cfg = LaunchConfig {
        grid_dim: (jobs.div_ceil(FINE_WARPS) as u32, 1, 1),
        block_dim: ((FINE_WARPS * dev.warp_size()) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (ks, vs) = (storage(&k)?, storage(&v)?);
    let gs = gate.as_ref().map(storage).transpose()?;
    let lq32 = lq as i32;
    let cd = f32_data(&coarse)?;
    launch!(
        kind = "vsa fine";
        &dev,
        "vsa",
        &format!("vsa_fine_{}", suffix(dt)?),
        cfg,
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            push(b, &ks.data);
            push(b, &vs.data);
            // Without a gate the kernel never reads this pointer; q stands in.
            push(b, &gs.unwrap_or(s).data);
            b.arg(&mix).arg(cd).arg(&kept).arg(&qi[0]).arg(&q_tile);
            b.arg(&ki[0]).arg(&ki[1]).arg(&ki[2]);
            b.arg(&lq32).arg(&h32).arg(&d32).arg(&k32).arg(&scale);
        }
    );
    Ok(wrap(out, q.shape()))
}

#[cfg(test)]
mod tests {
    use super::{coarse_shape, key_means_len};

    #[test]
    fn a_coarse_block_fits_the_default_shared_memory() {
        // LingBot's 520 key tiles: eight query tiles a block; the coarse output's partial sums
        // (256 threads × 8 tiles × 4 floats) are the larger use of the dynamic memory.
        assert_eq!(coarse_shape(520), Some((8, 32 << 10)));
        // One query tile's scores of 12 032 key tiles and its 256 floats of means fill 48 KiB.
        assert_eq!(coarse_shape(12_032), Some((1, 48_128)));
        assert_eq!(coarse_shape(12_033), None);
    }

    #[test]
    fn key_means_round_each_head_up_to_whole_float4s() {
        assert_eq!(key_means_len(520, 40 * 128, 128), 520 * 40 * 128);
        assert_eq!(key_means_len(10, 2 * 6, 6), 10 * 2 * 8);
    }
}
