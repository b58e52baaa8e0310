//! ROCm's side of the shared storage (`gpu_common/storage.rs`): the HIP layer's buffers and memset.

pub(crate) use super::hip::DeviceBuf;
pub(crate) use super::RocmBackend as Backend;

use crate::{Result, Storage};

/// cudarc's method traits, which the shared source imports; the HIP layer has the methods
/// inherent, so these are names only.
#[allow(dead_code)]
pub(crate) trait DevicePtr {}
#[allow(dead_code)]
pub(crate) trait DevicePtrMut {}

/// Sets `bytes` bytes at device address `ptr` to `value`, in stream order.
fn fill(dev: &Backend, ptr: u64, value: u8, bytes: usize) -> Result<()> {
    dev.stream.memset(ptr, value, bytes).map_err(|e| dev.err(e))
}

fn into_storage(s: RocmStorage) -> Storage {
    Storage::Rocm(s)
}

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "../gpu_common/storage.rs"]
mod shared;
pub use shared::{GpuData as RocmData, GpuStorage as RocmStorage};
