//! `nccl.rs` over ROCm devices and RCCL.

pub(crate) use kernels::rocm::{
    backend as open, RocmBackend as Backend, RocmMarker as Marker, RocmStorage as GpuStorage,
};
use kernels::{Device, Storage, Tensor};

pub(crate) const FLAVOR: rccl_sys::Flavor = rccl_sys::Flavor::Rccl;

pub(crate) fn device(ordinal: usize) -> Device {
    Device::Rocm(ordinal)
}

/// `t`'s storage if it lives on ROCm device `ordinal`.
pub(crate) fn on_device(t: &Tensor, ordinal: usize) -> Option<&GpuStorage> {
    match t.storage() {
        Storage::Rocm(s) if s.dev.ordinal == ordinal => Some(s),
        _ => None,
    }
}

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "nccl.rs"]
pub mod nccl;
