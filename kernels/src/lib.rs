//! Worldline's tensor layer: [`Device`], [`Tensor`], [`DType`], and the op set a Wan/LingBot DiT
//! needs, with the CPU reference backend. Every GPU backend implements the same ops and is
//! tested against this one.

mod cpu;
pub mod cuda;
mod device;
mod dtype;
mod error;
pub mod fp8;
pub mod fp8_attention;
pub mod gpu_source;
mod kv_cache;
pub mod ops;
pub mod rocm;
mod rope;
mod self_check;
mod tensor;
pub mod vsa;

pub use device::Device;
pub use dtype::{DType, Fp8Scale, ScaleKind};
pub use error::{Error, Result};
pub use fp8_attention::{attention_fp8, Fp8Kv};
pub use kv_cache::{KvCache, SumRows};
pub use ops::{AttnMask, ConvEpilogue, NormOut, Padding3d};
pub use rope::RopeTable;
pub use self_check::{self_check, Agreement};
pub use tensor::{CpuStorage, Storage, Tensor};
