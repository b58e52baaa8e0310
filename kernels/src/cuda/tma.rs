//! Tensor maps for the TMA copies of the attention kernel: the driver encodes where a tensor lives,
//! its shape and the box one copy moves; the kernel takes the map by value.

use std::ffi::c_void;

use cudarc::driver::{sys, DeviceRepr};

/// A `CUtensorMap` (128 bytes, 64-byte aligned), passed to a kernel as a `__grid_constant__`.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct TensorMap([u64; 16]);

// SAFETY: plain bytes written by the driver; the kernel parameter (`wl_tmap` in vendor/cuda.h)
// has the same size and alignment.
unsafe impl DeviceRepr for TensorMap {}

/// A bf16 tensor of `R` dims (`dims` innermost first, `strides` in bytes for dims 1..R) at
/// device address `addr`, copied in boxes of `boxes` elements into 128-byte-swizzled shared
/// memory; a box's parts outside the tensor arrive as zeros.
pub fn bf16<const R: usize>(
    addr: u64,
    dims: [u64; R],
    strides: &[u64],
    boxes: [u32; R],
) -> Result<TensorMap, String> {
    tiled(
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        addr,
        dims,
        strides,
        boxes,
    )
}

/// [`bf16`] for a tensor of bytes (fp8 codes).
pub fn u8<const R: usize>(
    addr: u64,
    dims: [u64; R],
    strides: &[u64],
    boxes: [u32; R],
) -> Result<TensorMap, String> {
    tiled(
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        addr,
        dims,
        strides,
        boxes,
    )
}

fn tiled<const R: usize>(
    dtype: sys::CUtensorMapDataType,
    addr: u64,
    dims: [u64; R],
    strides: &[u64],
    boxes: [u32; R],
) -> Result<TensorMap, String> {
    if strides.len() + 1 != R {
        return Err(format!(
            "tensor map of rank {R} with {} strides",
            strides.len()
        ));
    }
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    let elem = [1u32; R];
    // SAFETY: `map` is writable for one CUtensorMap; the arrays outlive the call and hold R
    // (R - 1 strides) values; the driver checks the address, shape and box and returns an
    // error for what it cannot map.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            R as u32,
            addr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "cuTensorMapEncodeTiled (dims {dims:?}, strides {strides:?}, box {boxes:?}): {r:?}"
        ));
    }
    // SAFETY: initialised by the successful call above.
    Ok(TensorMap(unsafe { map.assume_init() }.opaque))
}
