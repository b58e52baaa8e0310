//! The fp8 attention on Hopper (`flash_fp8_d128_s*` in attention_fp8.cu): q quantized per
//! (token, head) here, the keys and values read from the cache's fp8 store, the tail split of the
//! bf16 kernel.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{
    push, push_mut, split_buffers, storage, suffix, tail_split, wrap, FlashSplit,
    FLASH_BLOCK_QUERIES, FLASH_TMA_THREADS,
};
use crate::cuda::{CudaData, CudaStorage};
use crate::fp8_attention::{Fp8Kv, FP8_HEAD_DIM, FP8_TILE};
use crate::{DType, Error, Result, Tensor};

/// Stages of K and Vᵀ tiles in flight: the kernel is built for 4 and 6 (`WORLDLINE_FP8_STAGES`
/// picks, for `bench kernels`).
fn stages() -> usize {
    match std::env::var("WORLDLINE_FP8_STAGES").as_deref() {
        Ok("6") => 6,
        _ => 4,
    }
}

/// Dynamic shared memory: the Q tile (128 rows × 128 bytes), the stages (a K and a Vᵀ tile of
/// 16 KiB each), then full and empty barriers per stage and one for Q.
fn smem_bytes(stages: usize) -> u32 {
    (FLASH_BLOCK_QUERIES * 128 + stages * 2 * FP8_TILE * 128 + (2 * stages + 1) * 8) as u32
}

pub fn attention_fp8(q: &Tensor, kv: &Fp8Kv, kv_len: usize) -> Result<Tensor> {
    let s = storage(q)?;
    let dev = &s.dev;
    if dev.arch != "sm_90a" {
        return Err(Error::Invalid {
            op: "attention_fp8",
            msg: format!(
                "the fp8 attention kernel needs Hopper (sm_90a, wgmma); this device is {}",
                dev.arch
            ),
        });
    }
    let (lq, heads) = (q.dim(0), q.dim(1));
    let cap = kv.capacity();
    let st = &dev.stream;
    let e = |e| dev.err(e);
    // q as codes in whole 128-row tiles with one scale per (tile, head).
    let q_tiles = lq.div_ceil(FP8_TILE);
    // SAFETY: the launch below writes every code of every tile (zeros past lq) and every scale.
    let mut q_codes =
        unsafe { st.alloc::<u8>(q_tiles * FP8_TILE * heads * FP8_HEAD_DIM) }.map_err(e)?;
    let mut q_scales = unsafe { st.alloc::<f32>(q_tiles * heads) }.map_err(e)?;
    let (lq32, h32) = (lq as i32, heads as i32);
    {
        let func = dev.func("attention", &format!("fp8_q_tiles_{}", suffix(q.dtype())?))?;
        let mut b = st.launch_builder(&func);
        b.arg(&mut q_codes).arg(&mut q_scales);
        push(&mut b, &s.data);
        b.arg(&lq32).arg(&h32);
        let cfg = LaunchConfig {
            grid_dim: (q_tiles as u32, heads as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        dev.timed("fp8", || {
            // SAFETY: codes hold q_tiles·128 rows × heads × 128, scales heads × q_tiles; q is
            // [lq, heads, 128] in f32 or bf16.
            unsafe { b.launch(cfg) }.map_err(|e| dev.err(format!("fp8_q_tiles: {e}")))?;
            Ok(())
        })?;
    }
    let [k8, ksc, vt, vsc] = kv.parts();
    let (ks, vts) = (storage(k8)?, storage(vt)?);
    let (ksc, vsc) = (storage(ksc)?, storage(vsc)?);
    let (CudaData::F8 { codes: k_codes, .. }, CudaData::F8 { codes: v_codes, .. }) =
        (&ks.data, &vts.data)
    else {
        return Err(dev.err("attention_fp8: fp8 codes expected"));
    };
    let (q_p, _g1) = q_codes.device_ptr(st);
    let (k_p, _g2) = k_codes.device_ptr(st);
    let (v_p, _g3) = v_codes.device_ptr(st);
    let (h, d, c) = (heads as u64, FP8_HEAD_DIM as u64, cap as u64);
    let tile = FP8_TILE as u32;
    let m = |r: std::result::Result<_, String>| r.map_err(|e| dev.err(e));
    // k rows past kv_len are outside its map and arrive as zeros; Vᵀ is mapped whole (a tile's
    // permuted keys may sit past kv_len), its unwritten keys zeros.
    let tq = m(super::super::tma::u8(
        q_p,
        [d, h, (q_tiles * FP8_TILE) as u64],
        &[d, h * d],
        [128, 1, FLASH_BLOCK_QUERIES as u32],
    ))?;
    let tk = m(super::super::tma::u8(
        k_p,
        [d, h, kv_len as u64],
        &[d, h * d],
        [128, 1, tile],
    ))?;
    let tv = m(super::super::tma::u8(
        v_p,
        [c, d, h],
        &[c, d * c],
        [tile, 128, 1],
    ))?;
    let (kv32, cap32) = (kv_len as i32, cap as i32);
    let stages = stages();
    let smem = smem_bytes(stages);
    let name = format!("flash_fp8_d128_s{stages}");
    let func = dev.func("attention", &name)?;
    dev.allow_dynamic_smem(&func, smem)?;
    let items = lq.div_ceil(FLASH_BLOCK_QUERIES) * heads;
    let (whole, parts) = tail_split(items, dev.sms, kv_len.div_ceil(FP8_TILE));
    let (mut po, mut pml) = split_buffers(dev, (items - whole) * parts)?;
    let (po_p, _g4) = po.device_ptr_mut(st);
    let (pml_p, _g5) = pml.device_ptr_mut(st);
    let plan = FlashSplit {
        whole: whole as i32,
        parts: parts as i32,
        o: po_p,
        ml: pml_p,
    };
    let mut out = CudaStorage::alloc(dev, DType::BF16, q.elem_count())?;
    let (CudaData::F32(ksv), CudaData::F32(vsv)) = (&ksc.data, &vsc.data) else {
        return Err(dev.err("attention_fp8: f32 scales expected"));
    };
    let scale = 1.0f32 / (FP8_HEAD_DIM as f32).sqrt();
    let cfg = LaunchConfig {
        grid_dim: ((whole + (items - whole) * parts) as u32, 1, 1),
        block_dim: (FLASH_TMA_THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    let mut b = st.launch_builder(&func);
    push_mut(&mut b, &mut out.data);
    b.arg(&tq).arg(&tk).arg(&tv);
    b.arg(&q_scales).arg(ksv).arg(vsv);
    b.arg(&lq32)
        .arg(&kv32)
        .arg(&h32)
        .arg(&cap32)
        .arg(&scale)
        .arg(&plan);
    dev.timed("attention", || {
        // SAFETY: the maps describe the live code buffers (q [128·q_tiles, heads, 128], k [cap,
        // heads, 128], vᵀ [heads, 128, cap]), held until the launch is enqueued; q's scales hold
        // heads × q_tiles floats, the k and v scales heads × cap / 128; the split buffers hold
        // the split's ranges.
        unsafe { b.launch(cfg) }.map_err(|e| dev.err(format!("{name}: {e}")))?;
        Ok(())
    })?;
    if whole < items {
        super::flash_split_combine(dev, &mut out, &plan, items - whole, lq, heads)?;
    }
    super::cast(&wrap(out, q.shape()), q.dtype())
}
