//! VSA on a GPU (`kernels/gpu/vsa.cu`), one source for both vendors (declared by `cuda::ops`
//! and `rocm::ops` with `#[path]`): tile means, the coarse branch with the top-k selection, the
//! fine branch over the kept tiles (on sm_90a the wgmma kernel of attention.cu). The tiling
//! travels as index arrays.

#[allow(unused_imports)] // the ROCm side has these as inherent methods
use super::PushKernelArg;
use super::{
    cast, push, push_mut, storage, suffix, wrap, Backend as CudaBackend, DeviceBuf as CudaSlice,
    GpuData as CudaData, GpuStorage as CudaStorage, LaunchConfig,
};
use crate::vsa::Tiling;
use crate::{DType, Result, Tensor};

/// Warps per block of the fine kernel (`WL_VSA_WARPS`).
const FINE_WARPS: usize = 4;
/// Dynamic shared memory of the wgmma fine kernel: a 64-token query tile, then two stages of a
/// key tile and its transposed V, 64 × 128 bf16 each.
const WGMMA_FINE_SMEM: u32 = 5 * 64 * 128 * 2;
/// Dynamic shared memory of the coarse kernel: a score and a flag per key tile, within the
/// default 48 KiB.
const COARSE_SMEM_LIMIT: usize = 48 << 10;

fn upload(dev: &CudaBackend, v: &[usize]) -> Result<CudaSlice<i32>> {
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

/// Tile means `[tiles, heads, d]` (f32) of `x` in grid order.
fn tile_means(
    x: &Tensor,
    t: &Tiling,
    idx: &[CudaSlice<i32>; 3],
    heads: usize,
    d: usize,
) -> Result<CudaStorage> {
    let s = storage(x)?;
    let mut out = CudaStorage::alloc(&s.dev, DType::F32, t.tiles() * heads * d)?;
    let cfg = LaunchConfig {
        grid_dim: (t.tiles() as u32, heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (h32, d32) = (heads as i32, d as i32);
    launch!(
        kind = "vsa means";
        &s.dev,
        "vsa",
        &format!("vsa_tile_means_{}", suffix(x.dtype())?),
        cfg,
        |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            b.arg(&idx[0]).arg(&idx[1]).arg(&idx[2]).arg(&h32).arg(&d32);
        }
    );
    Ok(out)
}

pub fn vsa_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gate: Option<&Tensor>,
    qt: &Tiling,
    kt: &Tiling,
    top_k: usize,
) -> Result<Tensor> {
    let s = storage(q)?;
    let dev = s.dev.clone();
    let dt = q.dtype();
    let (lq, heads, d) = (q.dim(0), q.dim(1), q.dim(2));
    if d > 256 {
        return Err(dev.err(format!("vsa: head_dim {d} > 256")));
    }
    let (nq, nk) = (qt.tiles(), kt.tiles());
    let smem = nk * 8;
    if smem > COARSE_SMEM_LIMIT {
        return Err(dev.err(format!(
            "vsa: {nk} key tiles exceed the coarse kernel's shared memory"
        )));
    }
    let (k, v) = (cast(k, dt)?, cast(v, dt)?);
    let gate = gate.map(|g| cast(g, dt)).transpose()?;
    let mut q_tile = vec![0usize; lq];
    for j in 0..nq {
        q_tile[qt.offsets[j]..qt.offsets[j] + qt.sizes[j]].fill(j);
    }
    let qi = [
        upload(&dev, &qt.order)?,
        upload(&dev, &qt.offsets)?,
        upload(&dev, &qt.sizes)?,
    ];
    let ki = [
        upload(&dev, &kt.order)?,
        upload(&dev, &kt.offsets)?,
        upload(&dev, &kt.sizes)?,
    ];
    let q_tile = upload(&dev, &q_tile)?;
    let qc = tile_means(q, qt, &qi, heads, d)?;
    let kc = tile_means(&k, kt, &ki, heads, d)?;
    let vc = tile_means(&v, kt, &ki, heads, d)?;
    let mut coarse = CudaStorage::alloc(&dev, DType::F32, nq * heads * d)?;
    let mut kept = dev
        .stream
        .alloc_zeros::<i32>(nq * heads * top_k)
        .map_err(|e| dev.err(e))?;
    let scale = 1.0 / (d as f32).sqrt();
    let (nk32, h32, d32, k32) = (nk as i32, heads as i32, d as i32, top_k as i32);
    let cfg = LaunchConfig {
        grid_dim: (nq as u32, heads as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (qcd, kcd, vcd) = (f32_data(&qc)?, f32_data(&kc)?, f32_data(&vc)?);
    launch!(kind = "vsa coarse+top-k"; &dev, "vsa", "vsa_coarse", cfg, |b| {
        push_mut(b, &mut coarse.data);
        b.arg(&mut kept).arg(qcd).arg(kcd).arg(vcd);
        b.arg(&nk32).arg(&h32).arg(&d32).arg(&k32).arg(&scale);
    });
    let mut out = CudaStorage::alloc(&dev, dt, q.elem_count())?;
    if dt == DType::BF16 && d == 128 && dev.arch == "sm_90a" {
        // Tensor cores (attention.cu): one warpgroup per query tile and head, key tiles as
        // 64-slot blocks of a transposed V.
        let stride = nk * 64;
        let mut vt = CudaStorage::alloc(&dev, DType::BF16, heads * 128 * stride)?;
        let stride32 = stride as i32;
        let vs = storage(&v)?;
        let cfg = LaunchConfig {
            grid_dim: ((stride / 32) as u32, (heads * 128 / 32) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(kind = "vsa V transpose"; &dev, "attention", "vsa_v_transpose_bf16", cfg, |b| {
            push_mut(b, &mut vt.data);
            push(b, &vs.data);
            b.arg(&ki[0])
                .arg(&ki[1])
                .arg(&ki[2])
                .arg(&h32)
                .arg(&stride32);
        });
        let smem = WGMMA_FINE_SMEM;
        let func = dev.func("attention", "vsa_fine_wgmma_bf16_d128")?;
        dev.allow_dynamic_smem(&func, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (nq as u32, heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem,
        };
        let ks = storage(&k)?;
        let gs = gate.as_ref().map(storage).transpose()?;
        let has_gate = gs.is_some() as i32;
        let cd = f32_data(&coarse)?;
        launch!(kind = "vsa fine"; &dev, "attention", "vsa_fine_wgmma_bf16_d128", cfg, |b| {
            push_mut(b, &mut out.data);
            push(b, &s.data);
            push(b, &ks.data);
            push(b, &vt.data);
            // Without a gate the kernel never reads this pointer; q stands in.
            push(b, &gs.unwrap_or(s).data);
            b.arg(&has_gate).arg(cd).arg(&kept);
            b.arg(&qi[0]).arg(&qi[1]).arg(&qi[2]);
            b.arg(&ki[0]).arg(&ki[1]).arg(&ki[2]);
            b.arg(&h32).arg(&k32).arg(&stride32).arg(&scale);
        });
        return Ok(wrap(out, q.shape()));
    }
    let jobs = lq * heads;
    let cfg = LaunchConfig {
        grid_dim: (jobs.div_ceil(FINE_WARPS) as u32, 1, 1),
        block_dim: ((FINE_WARPS * dev.warp_size()) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (ks, vs) = (storage(&k)?, storage(&v)?);
    let gs = gate.as_ref().map(storage).transpose()?;
    let has_gate = gs.is_some() as i32;
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
            b.arg(&has_gate).arg(cd).arg(&kept).arg(&qi[0]).arg(&q_tile);
            b.arg(&ki[0]).arg(&ki[1]).arg(&ki[2]);
            b.arg(&lq32).arg(&h32).arg(&d32).arg(&k32).arg(&scale);
        }
    );
    Ok(wrap(out, q.shape()))
}
