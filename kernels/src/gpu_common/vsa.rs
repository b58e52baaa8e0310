//! VSA on a GPU (`kernels/gpu/vsa.cu`), one source for both vendors (declared by `cuda::ops`
//! and `rocm::ops` with `#[path]`): tile means, the coarse branch with the top-k selection, the
//! fine branch over the kept tiles (on sm_90a the TMA kernel of attention.cu, on MFMA
//! architectures its MFMA kernel, through the vendor module's `vsa_fine_fast`). The tiling
//! travels as index arrays.

#[allow(unused_imports)] // the ROCm side has these as inherent methods
use super::PushKernelArg;
use super::{
    cast, push, push_mut, storage, suffix, wrap, Backend as CudaBackend, DeviceBuf as CudaSlice,
    GpuData as CudaData, GpuStorage as CudaStorage, LaunchConfig,
};
use crate::vsa::{Tiling, TILE};
use crate::{DType, Result, Tensor};

/// Warps per block of the fine kernel (`WL_VSA_WARPS`).
const FINE_WARPS: usize = 4;
/// Threads of a means block (`WL_VSA_MEAN_THREADS`), each summing 16 bytes of columns.
const MEAN_THREADS: usize = 128;
/// Key tiles per scores block (`WL_VSA_SK`) and its threads (`WL_VSA_SCORE_THREADS`).
const SCORE_KEYS: usize = 32;
const SCORE_THREADS: usize = 256;
/// Query tiles per block of the weighted means (`WL_VSA_OQ`) and its threads (groups of d).
const OUT_QUERIES: usize = 8;
const OUT_THREADS: usize = 256;
/// Shared memory a block may take without opting in on CUDA.
const SMEM_LIMIT: usize = 48 << 10;

/// Query tiles per scores block (8·R, `vsa_coarse_scores_{R}`) and its dynamic shared memory:
/// both sets of means for head dim `d`, the most query tiles that fit.
fn scores_shape(d: usize) -> Option<(usize, usize)> {
    [4, 1].into_iter().find_map(|r| {
        let bytes = 4 * (8 * r * d + SCORE_KEYS * (d + 1));
        (bytes <= SMEM_LIMIT).then_some((r, bytes))
    })
}

/// Rows (warps) per selection block and its dynamic shared memory: a row of `nks` keys a warp.
fn select_shape(nks: usize) -> Option<(usize, usize)> {
    let warps = (SMEM_LIMIT / (4 * nks)).min(8);
    (warps > 0).then_some((warps, warps * 4 * nks))
}

/// Threads of a fused coarse block (`WL_VSA_COARSE_THREADS`) and the staged slice of d of its
/// score phase (`WL_VSA_EC`).
const COARSE_THREADS: usize = 256;
const COARSE_EC: usize = 16;

/// Query tiles per fused coarse block (a kernel per choice, `vsa_coarse_{qg}`) and its dynamic
/// shared memory: the most tiles whose scores, over every key tile, fit beside the staging of
/// the score phase (and the static `qg × 256` floats of query means).
fn coarse_shape(nk: usize) -> Option<(usize, usize)> {
    let nks = nk.next_multiple_of(4);
    [8, 4, 2, 1].into_iter().find_map(|qg| {
        let dynamic =
            4 * (qg * nks + COARSE_THREADS * (COARSE_EC + 4)).max(COARSE_THREADS * qg * 4);
        (dynamic + qg * 256 * 4 <= SMEM_LIMIT).then_some((qg, dynamic))
    })
}

/// Tiles of a grid in VSA's tiles.
fn tiles_of(grid: [usize; 3]) -> usize {
    crate::vsa::tiles(grid, crate::vsa::TILE)
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

/// Tile means `[tiles, heads, d]` (f32) of q on its grid and of k and v on the key grid, in
/// grid order, one launch.
fn tile_means(
    qkv: [&Tensor; 3],
    q_grid: [usize; 3],
    k_grid: [usize; 3],
    row: usize,
) -> Result<[CudaStorage; 3]> {
    let [q, k, v] = qkv;
    let name = format!("vsa_tile_means_{}", suffix(q.dtype())?);
    let (qs, ks, vs) = (storage(q)?, storage(k)?, storage(v)?);
    let dev = &qs.dev;
    let (nq, nk) = (tiles_of(q_grid), tiles_of(k_grid));
    let mut qm = CudaStorage::alloc(dev, DType::F32, nq * row)?;
    let mut km = CudaStorage::alloc(dev, DType::F32, nk * row)?;
    let mut vm = CudaStorage::alloc(dev, DType::F32, nk * row)?;
    let chunks = row.div_ceil(MEAN_THREADS * 16 / q.dtype().size_in_bytes());
    let blocks = (nq + 2 * nk) * chunks;
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(blocks).map_err(|_| dev.err(format!("vsa: {blocks} means blocks")))?,
            1,
            1,
        ),
        block_dim: (MEAN_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let [qt, qh, qw] = q_grid.map(|x| x as i32);
    let [kt, kh, kw] = k_grid.map(|x| x as i32);
    let (nq32, nk32, row32, chunks32) = (nq as i32, nk as i32, row as i32, chunks as i32);
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
            b.arg(&qt).arg(&qh).arg(&qw).arg(&kt).arg(&kh).arg(&kw);
            b.arg(&nq32).arg(&nk32).arg(&row32).arg(&chunks32);
        }
    );
    Ok([qm, km, vm])
}

pub fn vsa_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gate: Option<&Tensor>,
    q_grid: [usize; 3],
    k_grid: [usize; 3],
    top_k: usize,
) -> Result<Tensor> {
    let s = storage(q)?;
    let dev = s.dev.clone();
    let dt = q.dtype();
    let (lq, heads, d) = (q.dim(0), q.dim(1), q.dim(2));
    if d > 256 {
        return Err(dev.err(format!("vsa: head_dim {d} > 256")));
    }
    let (nq, nk) = (tiles_of(q_grid), tiles_of(k_grid));
    let nks = nk.next_multiple_of(4);
    let (Some((r, score_smem)), Some((warps, select_smem))) = (scores_shape(d), select_shape(nks))
    else {
        return Err(dev.err(format!(
            "vsa: {nk} key tiles of head dim {d} exceed the coarse kernels' shared memory"
        )));
    };
    let i32_of = |what: &str, n: usize| {
        i32::try_from(n).map_err(|_| dev.err(format!("vsa: {what} {n} exceeds i32")))
    };
    i32_of("row", heads * d)?;
    let rows = i32_of("score rows", heads * nq)? as usize;
    let (k, v) = (cast(k, dt)?, cast(v, dt)?);
    let gate = gate.map(|g| cast(g, dt)).transpose()?;
    let [qc, kc, vc] = tile_means([q, &k, &v], q_grid, k_grid, heads * d)?;
    let (qcd, kcd, vcd) = (f32_data(&qc)?, f32_data(&kc)?, f32_data(&vc)?);
    let e = |e| dev.err(e);
    let fused = std::env::var("WORLDLINE_VSA_COARSE").is_ok_and(|v| v == "fused");
    let mut kept = dev
        .stream
        .alloc_zeros::<i32>(nq * heads * top_k)
        .map_err(e)?;
    let mut coarse = CudaStorage::alloc(&dev, DType::F32, nq * heads * d)?;
    let scale = 1.0 / (d as f32).sqrt();
    if fused {
        let Some((qg, smem)) = coarse_shape(nk) else {
            return Err(dev.err(format!(
                "vsa: {nk} key tiles exceed the coarse kernel's shared memory"
            )));
        };
        let cfg = LaunchConfig {
            grid_dim: (nq.div_ceil(qg) as u32, heads as u32, 1),
            block_dim: (COARSE_THREADS as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (nq32, nk32, h32, d32, k32) =
            (nq as i32, nk as i32, heads as i32, d as i32, top_k as i32);
        launch!(kind = "vsa coarse+top-k"; &dev, "vsa", &format!("vsa_coarse_{qg}"), cfg, |b| {
            push_mut(b, &mut coarse.data);
            b.arg(&mut kept).arg(qcd).arg(kcd).arg(vcd);
            b.arg(&nq32).arg(&nk32).arg(&h32).arg(&d32).arg(&k32).arg(&scale);
        });
    } else {
        // The coarse scores as total-order keys, one row of nks per (head, query tile); the
        // selection turns each row into its softmax weights in place.
        // SAFETY: vsa_coarse_scores writes every score the selection reads (columns below nk), and
        // the selection writes the whole row (weights, then zeros) before the weighted means read it.
        // (i32 on the host: both vendors move i32 buffers; the kernels read the bits as unsigned.)
        let mut keys = unsafe { dev.stream.alloc::<i32>((rows * nks).max(1)) }.map_err(e)?;
        let (nq32, nk32, h32, d32, nks32, k32) = (
            nq as i32,
            nk as i32,
            heads as i32,
            d as i32,
            nks as i32,
            i32_of("top_k", top_k)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (
                nk.div_ceil(SCORE_KEYS) as u32,
                nq.div_ceil(8 * r) as u32,
                heads as u32,
            ),
            block_dim: (SCORE_THREADS as u32, 1, 1),
            shared_mem_bytes: score_smem as u32,
        };
        launch!(kind = "vsa coarse+top-k"; &dev, "vsa", &format!("vsa_coarse_scores_{r}"), cfg, |b| {
            b.arg(&mut keys).arg(qcd).arg(kcd);
            b.arg(&nq32).arg(&nk32).arg(&h32).arg(&d32).arg(&nks32).arg(&scale);
        });
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
            block_dim: ((warps * dev.warp_size()) as u32, 1, 1),
            shared_mem_bytes: select_smem as u32,
        };
        launch!(kind = "vsa coarse+top-k"; &dev, "vsa", "vsa_select_rows", cfg, |b| {
            b.arg(&mut kept).arg(&mut keys);
            b.arg(&nq32).arg(&nk32).arg(&h32).arg(&nks32).arg(&k32);
        });
        let cfg = LaunchConfig {
            grid_dim: (nq.div_ceil(OUT_QUERIES) as u32, heads as u32, 1),
            block_dim: (OUT_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(kind = "vsa coarse+top-k"; &dev, "vsa", "vsa_coarse_weighted", cfg, |b| {
            push_mut(b, &mut coarse.data);
            b.arg(&keys).arg(vcd);
            b.arg(&nq32).arg(&nk32).arg(&h32).arg(&d32).arg(&nks32);
        });
    }
    // Tensor cores where the vendor module has them (CUDA on sm_90a: TMA boxes of 4×4×4 tokens).
    if let Some(out) = super::vsa_fine_fast(
        q,
        &k,
        &v,
        gate.as_ref(),
        f32_data(&coarse)?,
        &kept,
        q_grid,
        k_grid,
        top_k,
    )? {
        return Ok(out);
    }
    // The portable fine kernel takes the tilings as index arrays.
    let (qt, kt) = (Tiling::new(q_grid, TILE), Tiling::new(k_grid, TILE));
    let mut q_tile = vec![0usize; lq];
    for j in 0..nq {
        q_tile[qt.offsets[j]..qt.offsets[j] + qt.sizes[j]].fill(j);
    }
    let q_order = upload(&dev, &qt.order)?;
    let ki = [
        upload(&dev, &kt.order)?,
        upload(&dev, &kt.offsets)?,
        upload(&dev, &kt.sizes)?,
    ];
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
    let has_gate = gs.is_some() as i32;
    let (lq32, h32, d32, k32) = (lq as i32, heads as i32, d as i32, top_k as i32);
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
            b.arg(&has_gate).arg(cd).arg(&kept).arg(&q_order).arg(&q_tile);
            b.arg(&ki[0]).arg(&ki[1]).arg(&ki[2]);
            b.arg(&lq32).arg(&h32).arg(&d32).arg(&k32).arg(&scale);
        }
    );
    Ok(wrap(out, q.shape()))
}
