//! CUDA's side of the shared storage (`gpu_common/storage.rs`): cudarc's buffers, `cuMemsetD8Async`.

pub(crate) use super::CudaBackend as Backend;
pub(crate) use cudarc::driver::{CudaSlice as DeviceBuf, DevicePtr, DevicePtrMut};

use crate::{Result, Storage};

/// Sets `bytes` bytes at device address `ptr` to `value`, in stream order.
fn fill(dev: &Backend, ptr: u64, value: u8, bytes: usize) -> Result<()> {
    // SAFETY: the caller's region of `bytes` bytes, allocated on this stream.
    unsafe { cudarc::driver::sys::cuMemsetD8Async(ptr, value, bytes, dev.stream.cu_stream()) }
        .result()
        .map_err(|e| dev.err(e))
}

fn into_storage(s: CudaStorage) -> Storage {
    Storage::Cuda(s)
}

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/storage.rs"]
mod shared;
pub use shared::{GpuData as CudaData, GpuStorage as CudaStorage};
