use std::sync::Arc;

use half::bf16;

use super::hip::DeviceBuf;
use super::RocmBackend;
use crate::tensor::CpuStorage;
use crate::{DType, Fp8Scale, Result};

/// Device buffers by element type.
#[derive(Clone, Debug)]
pub enum RocmData {
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

/// A tensor's storage on a ROCm device.
#[derive(Clone, Debug)]
pub struct RocmStorage {
    pub dev: Arc<RocmBackend>,
    pub data: RocmData,
}

impl RocmData {
    pub fn dtype(&self) -> DType {
        match self {
            RocmData::F32(_) => DType::F32,
            RocmData::BF16(_) => DType::BF16,
            RocmData::F8 { .. } => DType::F8E4M3,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn len(&self) -> usize {
        match self {
            RocmData::F32(s) => s.len(),
            RocmData::BF16(s) => s.len(),
            RocmData::F8 { codes, .. } => codes.len(),
        }
    }
}

impl RocmStorage {
    pub fn upload(dev: &Arc<RocmBackend>, st: &CpuStorage) -> Result<Self> {
        let s = &dev.stream;
        let e = |e| dev.err(e);
        let data = match st {
            CpuStorage::F32(v) => RocmData::F32(s.clone_htod(v).map_err(e)?),
            CpuStorage::BF16(v) => RocmData::BF16(s.clone_htod(v).map_err(e)?),
            CpuStorage::F16(v) => {
                let f: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                RocmData::F32(s.clone_htod(&f).map_err(e)?)
            }
            CpuStorage::F8E4M3 { codes, scale } => {
                let (scales, rowwise) = match scale {
                    Fp8Scale::Tensor(x) => (vec![*x], false),
                    Fp8Scale::Rows(r) => (r.clone(), true),
                };
                RocmData::F8 {
                    codes: s.clone_htod(codes).map_err(e)?,
                    scales: s.clone_htod(&scales).map_err(e)?,
                    rowwise,
                }
            }
        };
        Ok(RocmStorage {
            dev: dev.clone(),
            data,
        })
    }

    pub fn download(&self) -> Result<CpuStorage> {
        let s = &self.dev.stream;
        let e = |e| self.dev.err(e);
        Ok(match &self.data {
            RocmData::F32(d) => CpuStorage::F32(s.clone_dtoh(d).map_err(e)?),
            RocmData::BF16(d) => CpuStorage::BF16(s.clone_dtoh(d).map_err(e)?),
            RocmData::F8 {
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
    pub fn alloc(dev: &Arc<RocmBackend>, dtype: DType, n: usize) -> Result<Self> {
        let s = &dev.stream;
        // SAFETY: every op writes all `n` elements before the buffer is read.
        let mut data = unsafe {
            match dtype {
                DType::F32 => RocmData::F32(s.alloc::<f32>(n).map_err(|e| dev.err(e))?),
                DType::BF16 => RocmData::BF16(s.alloc::<bf16>(n).map_err(|e| dev.err(e))?),
                d => {
                    return Err(crate::Error::DType {
                        op: "rocm alloc",
                        got: d,
                        msg: "f32 or bf16 on ROCm",
                    })
                }
            }
        };
        if poison() {
            let bytes = n * dtype.size_in_bytes();
            let ptr = match &mut data {
                RocmData::F32(d) => d.device_ptr_mut(s).0,
                RocmData::BF16(d) => d.device_ptr_mut(s).0,
                RocmData::F8 { .. } => unreachable!("alloc makes f32 or bf16"),
            };
            // All ones is NaN in f32 and bf16.
            s.memset(ptr, 0xff, bytes).map_err(|e| dev.err(e))?;
        }
        Ok(RocmStorage {
            dev: dev.clone(),
            data,
        })
    }
}

impl RocmStorage {
    /// The device address of the elements (f32 or bf16; fp8 storage has two buffers and is
    /// refused), for libraries that read it on this storage's stream (RCCL sends). The
    /// address stays valid while `self` lives; stream-ordered frees keep it valid for work
    /// queued on the same stream before the free.
    pub fn device_ptr(&self) -> Result<u64> {
        let s = &self.dev.stream;
        Ok(match &self.data {
            RocmData::F32(d) => d.device_ptr(s).0,
            RocmData::BF16(d) => d.device_ptr(s).0,
            RocmData::F8 { .. } => return Err(self.no_raw_fp8()),
        })
    }

    /// [`device_ptr`](Self::device_ptr) with the intent to write (RCCL receives).
    pub fn device_ptr_mut(&mut self) -> Result<u64> {
        let s = &self.dev.stream;
        Ok(match &mut self.data {
            RocmData::F32(d) => d.device_ptr_mut(s).0,
            RocmData::BF16(d) => d.device_ptr_mut(s).0,
            RocmData::F8 { .. } => return Err(self.no_raw_fp8()),
        })
    }

    fn no_raw_fp8(&self) -> crate::Error {
        crate::Error::DType {
            op: "rocm device pointer",
            got: DType::F8E4M3,
            msg: "f32 or bf16 (fp8 keeps codes and scales apart)",
        }
    }

    /// A tensor of `shape` over this storage.
    pub fn into_tensor(self, shape: &[usize]) -> Result<crate::Tensor> {
        if shape.iter().product::<usize>() != self.data.len() {
            return Err(crate::error::shape_err(
                "rocm into_tensor",
                format!("{} elements for shape {shape:?}", self.data.len()),
            ));
        }
        Ok(crate::Tensor::from_storage(
            crate::Storage::Rocm(self),
            shape.to_vec(),
        ))
    }
}

fn poison() -> bool {
    static POISON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POISON.get_or_init(|| std::env::var("WORLDLINE_POISON").is_ok_and(|v| v == "1"))
}
