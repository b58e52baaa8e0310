//! `nccl.rs` over CUDA devices and NCCL.

pub(crate) use kernels::cuda::{
    backend as open, CudaBackend as Backend, CudaMarker as Marker, CudaStorage as GpuStorage,
};
use kernels::{Device, Storage, Tensor};

pub(crate) const FLAVOR: rccl_sys::Flavor = rccl_sys::Flavor::Nccl;

pub(crate) fn device(ordinal: usize) -> Device {
    Device::Cuda(ordinal)
}

/// `t`'s storage if it lives on CUDA device `ordinal`.
pub(crate) fn on_device(t: &Tensor, ordinal: usize) -> Option<&GpuStorage> {
    match t.storage() {
        Storage::Cuda(s) if s.dev.ordinal == ordinal => Some(s),
        _ => None,
    }
}

// One source compiled once per vendor, on purpose.
#[allow(clippy::duplicate_mod)]
#[path = "nccl.rs"]
pub mod nccl;
