//! A tensor's device buffers and their copies to and from the host, one source for both GPU
//! backends (declared by `cuda/storage.rs` and `rocm/storage.rs` with `#[path]`, which name the
//! vendor's types and how to fill memory).

use std::sync::Arc;

use super::{fill, into_storage, Backend, DeviceBuf};
#[allow(unused_imports)] // the ROCm side has these as inherent methods
use super::{DevicePtr, DevicePtrMut};
use crate::tensor::CpuStorage;
use crate::{DType, Fp8Scale, Result};
use half::bf16;

/// Device buffers by element type.
#[derive(Clone, Debug)]
pub enum GpuData {
    F32(DeviceBuf<f32>),
    BF16(DeviceBuf<bf16>),
    /// e4m3fn codes with one scale (`rowwise == false`) or one per row, kept on the device so
    /// quantization needs no host round trip.
    F8 {
        codes: DeviceBuf<u8>,
        scales: DeviceBuf<f32>,
        rowwise: bool,
    },
}

/// A tensor's storage on a GPU.
#[derive(Clone, Debug)]
pub struct GpuStorage {
    pub dev: Arc<Backend>,
    pub data: GpuData,
}

impl GpuData {
    pub fn dtype(&self) -> DType {
        match self {
            GpuData::F32(_) => DType::F32,
            GpuData::BF16(_) => DType::BF16,
            GpuData::F8 { .. } => DType::F8E4M3,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn len(&self) -> usize {
        match self {
            GpuData::F32(s) => s.len(),
            GpuData::BF16(s) => s.len(),
            GpuData::F8 { codes, .. } => codes.len(),
        }
    }
}

impl GpuStorage {
    pub fn upload(dev: &Arc<Backend>, st: &CpuStorage) -> Result<Self> {
        let s = &dev.stream;
        let e = |e| dev.err(e);
        let data = match st {
            CpuStorage::F32(v) => GpuData::F32(s.clone_htod(v).map_err(e)?),
            CpuStorage::BF16(v) => GpuData::BF16(s.clone_htod(v).map_err(e)?),
            CpuStorage::F16(v) => {
                let f: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                GpuData::F32(s.clone_htod(&f).map_err(e)?)
            }
            CpuStorage::F8E4M3 { codes, scale } => {
                let (scales, rowwise) = match scale {
                    Fp8Scale::Tensor(x) => (vec![*x], false),
                    Fp8Scale::Rows(r) => (r.clone(), true),
                };
                GpuData::F8 {
                    codes: s.clone_htod(codes).map_err(e)?,
                    scales: s.clone_htod(&scales).map_err(e)?,
                    rowwise,
                }
            }
        };
        Ok(GpuStorage {
            dev: dev.clone(),
            data,
        })
    }

    pub fn download(&self) -> Result<CpuStorage> {
        let s = &self.dev.stream;
        let e = |e| self.dev.err(e);
        Ok(match &self.data {
            GpuData::F32(d) => CpuStorage::F32(s.clone_dtoh(d).map_err(e)?),
            GpuData::BF16(d) => CpuStorage::BF16(s.clone_dtoh(d).map_err(e)?),
            GpuData::F8 {
                codes,
                scales,
                rowwise,
            } => {
                let scales = s.clone_dtoh(scales).map_err(e)?;
                let scale = if *rowwise {
                    Fp8Scale::Rows(scales)
                } else {
                    Fp8Scale::Tensor(scales[0])
                };
                CpuStorage::F8E4M3 {
                    codes: s.clone_dtoh(codes).map_err(e)?,
                    scale,
                }
            }
        })
    }

    /// `n` zeros set on the device, so nothing crosses the bus: f32, bf16, or e4m3 codes with
    /// one tensorwise scale of 1. (A 14B engine's caches are ~23 GB of them.)
    pub fn zeros(dev: &Arc<Backend>, dtype: DType, n: usize) -> Result<Self> {
        let s = &dev.stream;
        let e = |e| dev.err(e);
        let data = match dtype {
            DType::F32 => GpuData::F32(s.alloc_zeros::<f32>(n).map_err(e)?),
            DType::BF16 => GpuData::BF16(s.alloc_zeros::<bf16>(n).map_err(e)?),
            DType::F8E4M3 => GpuData::F8 {
                codes: s.alloc_zeros::<u8>(n).map_err(e)?,
                scales: s.clone_htod(&[1.0f32][..]).map_err(e)?,
                rowwise: false,
            },
            d => {
                return Err(crate::Error::DType {
                    op: "gpu zeros",
                    got: d,
                    msg: "f32, bf16 or f8e4m3 on a GPU",
                })
            }
        };
        Ok(GpuStorage {
            dev: dev.clone(),
            data,
        })
    }

    /// Uninitialised f32 or bf16 storage of `n` elements. With `WORLDLINE_POISON=1` it is filled
    /// with NaN first, so a kernel that skips an element fails the tests instead of passing on
    /// leftover values.
    pub fn alloc(dev: &Arc<Backend>, dtype: DType, n: usize) -> Result<Self> {
        let s = &dev.stream;
        // SAFETY: every op writes all `n` elements before the buffer is read.
        let mut data = unsafe {
            match dtype {
                DType::F32 => GpuData::F32(s.alloc::<f32>(n).map_err(|e| dev.err(e))?),
                DType::BF16 => GpuData::BF16(s.alloc::<bf16>(n).map_err(|e| dev.err(e))?),
                d => {
                    return Err(crate::Error::DType {
                        op: "gpu alloc",
                        got: d,
                        msg: "f32 or bf16 on a GPU",
                    })
                }
            }
        };
        if poison() {
            let bytes = n * dtype.size_in_bytes();
            let ptr = match &mut data {
                GpuData::F32(d) => d.device_ptr_mut(s).0,
                GpuData::BF16(d) => d.device_ptr_mut(s).0,
                GpuData::F8 { .. } => unreachable!("alloc makes f32 or bf16"),
            };
            // All ones is NaN in f32 and bf16.
            fill(dev, ptr, 0xff, bytes)?;
        }
        Ok(GpuStorage {
            dev: dev.clone(),
            data,
        })
    }
}

impl GpuStorage {
    /// The device address of the elements (f32 or bf16; fp8 storage has two buffers and is
    /// refused), for libraries that read it on this storage's stream (NCCL or RCCL sends). The
    /// address stays valid while `self` lives; stream-ordered frees keep it valid for work
    /// queued on the same stream before the free.
    pub fn device_ptr(&self) -> Result<u64> {
        let s = &self.dev.stream;
        Ok(match &self.data {
            GpuData::F32(d) => d.device_ptr(s).0,
            GpuData::BF16(d) => d.device_ptr(s).0,
            GpuData::F8 { .. } => return Err(self.no_raw_fp8()),
        })
    }

    /// [`device_ptr`](Self::device_ptr) with the intent to write (NCCL/RCCL receives).
    pub fn device_ptr_mut(&mut self) -> Result<u64> {
        let s = &self.dev.stream;
        Ok(match &mut self.data {
            GpuData::F32(d) => d.device_ptr_mut(s).0,
            GpuData::BF16(d) => d.device_ptr_mut(s).0,
            GpuData::F8 { .. } => return Err(self.no_raw_fp8()),
        })
    }

    fn no_raw_fp8(&self) -> crate::Error {
        crate::Error::DType {
            op: "gpu device pointer",
            got: DType::F8E4M3,
            msg: "f32 or bf16 (fp8 keeps codes and scales apart)",
        }
    }

    /// A tensor of `shape` over this storage.
    pub fn into_tensor(self, shape: &[usize]) -> Result<crate::Tensor> {
        if shape.iter().product::<usize>() != self.data.len() {
            return Err(crate::error::shape_err(
                "gpu into_tensor",
                format!("{} elements for shape {shape:?}", self.data.len()),
            ));
        }
        Ok(crate::Tensor::from_storage(
            into_storage(self),
            shape.to_vec(),
        ))
    }
}

fn poison() -> bool {
    static POISON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POISON.get_or_init(|| std::env::var("WORLDLINE_POISON").is_ok_and(|v| v == "1"))
}
