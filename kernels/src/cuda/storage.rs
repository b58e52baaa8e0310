use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::CudaBackend;
use crate::tensor::CpuStorage;
use crate::{DType, Fp8Scale, Result};

/// Device buffers by element type.
#[derive(Clone, Debug)]
pub enum CudaData {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<bf16>),
    /// e4m3fn codes with one scale (`rowwise == false`) or one per row, kept on the device so
    /// quantization needs no host round trip.
    F8 {
        codes: CudaSlice<u8>,
        scales: CudaSlice<f32>,
        rowwise: bool,
    },
}

/// A tensor's storage on a CUDA device.
#[derive(Clone, Debug)]
pub struct CudaStorage {
    pub dev: Arc<CudaBackend>,
    pub data: CudaData,
}

impl CudaData {
    pub fn dtype(&self) -> DType {
        match self {
            CudaData::F32(_) => DType::F32,
            CudaData::BF16(_) => DType::BF16,
            CudaData::F8 { .. } => DType::F8E4M3,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn len(&self) -> usize {
        match self {
            CudaData::F32(s) => s.len(),
            CudaData::BF16(s) => s.len(),
            CudaData::F8 { codes, .. } => codes.len(),
        }
    }
}

impl CudaStorage {
    pub fn upload(dev: &Arc<CudaBackend>, st: &CpuStorage) -> Result<Self> {
        let s = &dev.stream;
        let e = |e| dev.err(e);
        let data = match st {
            CpuStorage::F32(v) => CudaData::F32(s.clone_htod(v).map_err(e)?),
            CpuStorage::BF16(v) => CudaData::BF16(s.clone_htod(v).map_err(e)?),
            CpuStorage::F16(v) => {
                let f: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                CudaData::F32(s.clone_htod(&f).map_err(e)?)
            }
            CpuStorage::F8E4M3 { codes, scale } => {
                let (scales, rowwise) = match scale {
                    Fp8Scale::Tensor(x) => (vec![*x], false),
                    Fp8Scale::Rows(r) => (r.clone(), true),
                };
                CudaData::F8 {
                    codes: s.clone_htod(codes).map_err(e)?,
                    scales: s.clone_htod(&scales).map_err(e)?,
                    rowwise,
                }
            }
        };
        Ok(CudaStorage {
            dev: dev.clone(),
            data,
        })
    }

    pub fn download(&self) -> Result<CpuStorage> {
        let s = &self.dev.stream;
        let e = |e| self.dev.err(e);
        Ok(match &self.data {
            CudaData::F32(d) => CpuStorage::F32(s.clone_dtoh(d).map_err(e)?),
            CudaData::BF16(d) => CpuStorage::BF16(s.clone_dtoh(d).map_err(e)?),
            CudaData::F8 {
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

    /// Uninitialised f32 or bf16 storage of `n` elements. With `WORLDLINE_POISON=1` it is filled
    /// with NaN first, so a kernel that skips an element fails the tests instead of passing on
    /// leftover values.
    pub fn alloc(dev: &Arc<CudaBackend>, dtype: DType, n: usize) -> Result<Self> {
        let s = &dev.stream;
        // SAFETY: every op writes all `n` elements before the buffer is read.
        let mut data = unsafe {
            match dtype {
                DType::F32 => CudaData::F32(s.alloc::<f32>(n).map_err(|e| dev.err(e))?),
                DType::BF16 => CudaData::BF16(s.alloc::<bf16>(n).map_err(|e| dev.err(e))?),
                d => {
                    return Err(crate::Error::DType {
                        op: "cuda alloc",
                        got: d,
                        msg: "f32 or bf16 on CUDA",
                    })
                }
            }
        };
        if poison() {
            let bytes = n * dtype.size_in_bytes();
            let ptr = match &mut data {
                CudaData::F32(d) => d.device_ptr_mut(s).0,
                CudaData::BF16(d) => d.device_ptr_mut(s).0,
                CudaData::F8 { .. } => unreachable!("alloc makes f32 or bf16"),
            };
            // SAFETY: `ptr` addresses `bytes` bytes just allocated on this stream; all ones is NaN
            // in f32 and bf16.
            unsafe { cudarc::driver::sys::cuMemsetD8Async(ptr, 0xff, bytes, s.cu_stream()) }
                .result()
                .map_err(|e| dev.err(e))?;
        }
        Ok(CudaStorage {
            dev: dev.clone(),
            data,
        })
    }
}

impl CudaStorage {
    /// The device address of the elements (f32 or bf16; fp8 storage has two buffers and is
    /// refused), for libraries that read it on this storage's stream (NCCL/RCCL sends). The
    /// address stays valid while `self` lives; stream-ordered frees keep it valid for work
    /// queued on the same stream before the free.
    pub fn device_ptr(&self) -> Result<u64> {
        let s = &self.dev.stream;
        Ok(match &self.data {
            CudaData::F32(d) => d.device_ptr(s).0,
            CudaData::BF16(d) => d.device_ptr(s).0,
            CudaData::F8 { .. } => return Err(self.no_raw_fp8()),
        })
    }

    /// [`device_ptr`](Self::device_ptr) with the intent to write (NCCL/RCCL receives).
    pub fn device_ptr_mut(&mut self) -> Result<u64> {
        let s = &self.dev.stream;
        Ok(match &mut self.data {
            CudaData::F32(d) => d.device_ptr_mut(s).0,
            CudaData::BF16(d) => d.device_ptr_mut(s).0,
            CudaData::F8 { .. } => return Err(self.no_raw_fp8()),
        })
    }

    fn no_raw_fp8(&self) -> crate::Error {
        crate::Error::DType {
            op: "cuda device pointer",
            got: DType::F8E4M3,
            msg: "f32 or bf16 (fp8 keeps codes and scales apart)",
        }
    }

    /// A tensor of `shape` over this storage.
    pub fn into_tensor(self, shape: &[usize]) -> Result<crate::Tensor> {
        if shape.iter().product::<usize>() != self.data.len() {
            return Err(crate::error::shape_err(
                "cuda into_tensor",
                format!("{} elements for shape {shape:?}", self.data.len()),
            ));
        }
        Ok(crate::Tensor::from_storage(
            crate::Storage::Cuda(self),
            shape.to_vec(),
        ))
    }
}

fn poison() -> bool {
    static POISON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POISON.get_or_init(|| std::env::var("WORLDLINE_POISON").is_ok_and(|v| v == "1"))
}
