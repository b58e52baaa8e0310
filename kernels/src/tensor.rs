use std::borrow::Cow;
use std::sync::Arc;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::shape_err;
use crate::{fp8, DType, Device, Error, Fp8Scale, Result};

/// Element storage of the CPU backend.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F8E4M3 { codes: Vec<u8>, scale: Fp8Scale },
}

/// Backend storage. A GPU backend adds its variant here and an arm to each op in `ops`.
#[derive(Clone, Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(crate::cuda::CudaStorage),
    Rocm(crate::rocm::RocmStorage),
}

impl Storage {
    /// The backend's name, for errors.
    pub fn device_name(&self) -> &'static str {
        match self {
            Storage::Cpu(_) => "cpu",
            Storage::Cuda(_) => "cuda",
            Storage::Rocm(_) => "rocm",
        }
    }
}

/// A dense, contiguous, row-major tensor. Cloning and reshaping share the storage; ops return
/// new tensors, and the few in-place ops (cache writes) copy first only if the storage is shared.
#[derive(Clone)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Arc<Storage>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?}, {}, {})",
            self.shape,
            self.dtype().name(),
            self.device()
        )
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl CpuStorage {
    fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::F8E4M3 { codes, .. } => codes.len(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::F8E4M3 { .. } => DType::F8E4M3,
        }
    }

    /// Stores f32 values as `dtype`, rounding to nearest even. fp8 needs a scale, so it goes
    /// through `ops::quantize_fp8` instead.
    pub fn from_f32(data: Vec<f32>, dtype: DType) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(data),
            // In parallel: random weights of the large models pass through here.
            DType::BF16 => CpuStorage::BF16(data.par_iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => CpuStorage::F16(data.par_iter().map(|&x| f16::from_f32(x)).collect()),
            DType::F8E4M3 => {
                return Err(Error::DType {
                    op: "from_f32",
                    got: dtype,
                    msg: "fp8 needs a scale: use ops::quantize_fp8",
                })
            }
        })
    }

    /// The values as f32, borrowed when already f32.
    pub fn to_f32(&self, cols: usize) -> Cow<'_, [f32]> {
        match self {
            CpuStorage::F32(v) => Cow::Borrowed(v),
            CpuStorage::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
            CpuStorage::F16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
            CpuStorage::F8E4M3 { codes, scale } => {
                let mut out = vec![0f32; codes.len()];
                match scale {
                    Fp8Scale::Tensor(s) => fp8::dequantize_into(codes, *s, &mut out),
                    Fp8Scale::Rows(rows) => {
                        for ((o, c), s) in out.chunks_mut(cols).zip(codes.chunks(cols)).zip(rows) {
                            fp8::dequantize_into(c, *s, o);
                        }
                    }
                }
                Cow::Owned(out)
            }
        }
    }
}

impl Tensor {
    pub(crate) fn from_storage(storage: Storage, shape: Vec<usize>) -> Self {
        Tensor {
            shape,
            storage: Arc::new(storage),
        }
    }

    /// A CPU tensor of f32 values stored as `dtype` (not fp8).
    pub fn from_f32(data: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Self> {
        if data.len() != numel(shape) {
            return Err(shape_err(
                "from_f32",
                format!("{} values for shape {shape:?}", data.len()),
            ));
        }
        let st = CpuStorage::from_f32(data, dtype)?;
        Ok(Self::from_storage(Storage::Cpu(st), shape.to_vec()))
    }

    /// An f32 CPU tensor.
    pub fn from_vec(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        Self::from_f32(data, shape, DType::F32)
    }

    /// A tensor from ready CPU storage (used by the weight loader).
    pub fn from_cpu_storage(st: CpuStorage, shape: &[usize]) -> Result<Self> {
        if st.len() != numel(shape) {
            return Err(shape_err(
                "from_cpu_storage",
                format!("{} values for shape {shape:?}", st.len()),
            ));
        }
        if let CpuStorage::F8E4M3 {
            scale: Fp8Scale::Rows(r),
            ..
        } = &st
        {
            let rows = numel(shape) / shape.last().copied().unwrap_or(1).max(1);
            if r.len() != rows {
                return Err(shape_err(
                    "from_cpu_storage",
                    "one fp8 scale per row expected",
                ));
            }
        }
        Ok(Self::from_storage(Storage::Cpu(st), shape.to_vec()))
    }

    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Self> {
        Self::from_f32(vec![0.0; numel(shape)], shape, dtype)
    }

    /// Zeros made where they will live: on a GPU the memory is set there, with no host buffer
    /// and no upload. e4m3 zeros carry one tensorwise scale of 1.
    pub fn zeros_on(shape: &[usize], dtype: DType, device: Device) -> Result<Self> {
        let n = numel(shape);
        let storage = match device {
            Device::Cpu if dtype == DType::F8E4M3 => Storage::Cpu(CpuStorage::F8E4M3 {
                codes: vec![0; n],
                scale: crate::Fp8Scale::Tensor(1.0),
            }),
            Device::Cpu => return Self::zeros(shape, dtype),
            Device::Cuda(i) => Storage::Cuda(crate::cuda::CudaStorage::zeros(
                &crate::cuda::backend(i)?,
                dtype,
                n,
            )?),
            Device::Rocm(i) => Storage::Rocm(crate::rocm::RocmStorage::zeros(
                &crate::rocm::backend(i)?,
                dtype,
                n,
            )?),
        };
        Ok(Self::from_storage(storage, shape.to_vec()))
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Size of dimension `i`; negative counts from the end.
    pub fn dim(&self, i: isize) -> usize {
        let i = if i < 0 {
            self.shape.len() as isize + i
        } else {
            i
        };
        self.shape[i as usize]
    }

    pub fn elem_count(&self) -> usize {
        numel(&self.shape)
    }

    pub fn dtype(&self) -> DType {
        match &*self.storage {
            Storage::Cpu(s) => s.dtype(),
            Storage::Cuda(s) => s.data.dtype(),
            Storage::Rocm(s) => s.data.dtype(),
        }
    }

    pub fn device(&self) -> Device {
        match &*self.storage {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => Device::Cuda(s.dev.ordinal),
            Storage::Rocm(s) => Device::Rocm(s.dev.ordinal),
        }
    }

    /// This tensor on `device` (the same tensor when already there).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        let cpu = match &*self.storage {
            Storage::Cpu(s) => s.clone(),
            Storage::Cuda(s) => s.download()?,
            Storage::Rocm(s) => s.download()?,
        };
        let storage = match device {
            Device::Cpu => Storage::Cpu(cpu),
            Device::Cuda(i) => Storage::Cuda(crate::cuda::CudaStorage::upload(
                &crate::cuda::backend(i)?,
                &cpu,
            )?),
            Device::Rocm(i) => Storage::Rocm(crate::rocm::RocmStorage::upload(
                &crate::rocm::backend(i)?,
                &cpu,
            )?),
        };
        Ok(Tensor {
            shape: self.shape.clone(),
            storage: Arc::new(storage),
        })
    }

    /// The values as f32, copied to the host when on a device.
    pub fn try_to_vec_f32(&self) -> Result<Vec<f32>> {
        match &*self.storage {
            Storage::Cpu(s) => Ok(s.to_f32(self.cols()).into_owned()),
            Storage::Cuda(s) => Ok(s.download()?.to_f32(self.cols()).into_owned()),
            Storage::Rocm(s) => Ok(s.download()?.to_f32(self.cols()).into_owned()),
        }
    }

    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The shared storage itself, for caches that follow a tensor's life (a weak reference).
    pub(crate) fn storage_arc(&self) -> &Arc<Storage> {
        &self.storage
    }

    pub(crate) fn storage_mut(&mut self) -> &mut Storage {
        Arc::make_mut(&mut self.storage)
    }

    /// Size of the last dimension (the row length for rowwise fp8 scales).
    pub(crate) fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1).max(1)
    }

    /// The values as f32 on the host, dequantized or widened as needed.
    ///
    /// # Panics
    /// When a device copy fails (the device is lost); `try_to_vec_f32` returns that error.
    pub fn to_vec_f32(&self) -> Vec<f32> {
        match self.try_to_vec_f32() {
            Ok(v) => v,
            Err(e) => panic!("copying {self:?} to the host: {e}"),
        }
    }

    /// The values as f32, borrowed when already f32 on the CPU (copied from a device otherwise).
    pub fn cpu_f32(&self) -> Cow<'_, [f32]> {
        match &*self.storage {
            Storage::Cpu(s) => s.to_f32(self.cols()),
            Storage::Cuda(_) | Storage::Rocm(_) => Cow::Owned(self.to_vec_f32()),
        }
    }

    fn on_cuda(&self) -> bool {
        matches!(&*self.storage, Storage::Cuda(_))
    }

    fn on_rocm(&self) -> bool {
        matches!(&*self.storage, Storage::Rocm(_))
    }

    /// Same data, new shape (no copy).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != self.elem_count() {
            return Err(shape_err(
                "reshape",
                format!("{:?} to {shape:?}", self.shape),
            ));
        }
        if self.dtype() == DType::F8E4M3 && shape.last() != self.shape.last() {
            if let Storage::Cpu(CpuStorage::F8E4M3 {
                scale: Fp8Scale::Rows(_),
                ..
            }) = &*self.storage
            {
                return Err(shape_err("reshape", "rowwise fp8 keeps its row length"));
            }
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: self.storage.clone(),
        })
    }

    /// Converts to another non-fp8 dtype (rounding to nearest even); fp8 goes through
    /// `ops::quantize_fp8`.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        if dtype == DType::F8E4M3 {
            return Err(Error::DType {
                op: "to_dtype",
                got: dtype,
                msg: "fp8 needs a scale: use ops::quantize_fp8",
            });
        }
        if self.on_cuda() {
            return crate::cuda::ops::cast(self, dtype);
        }
        if self.on_rocm() {
            return crate::rocm::ops::cast(self, dtype);
        }
        Tensor::from_f32(self.to_vec_f32(), &self.shape, dtype)
    }

    /// Rows `[start, start + len)` of dimension `dim`, copied.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        if dim >= self.rank() || start + len > self.shape[dim] {
            return Err(shape_err(
                "narrow",
                format!("dim {dim} [{start}, {}) of {:?}", start + len, self.shape),
            ));
        }
        if self.on_cuda() {
            self.plain_dtype("narrow")?;
            return crate::cuda::ops::narrow(self, dim, start, len);
        }
        if self.on_rocm() {
            self.plain_dtype("narrow")?;
            return crate::rocm::ops::narrow(self, dim, start, len);
        }
        let outer: usize = self.shape[..dim].iter().product();
        let inner: usize = self.shape[dim + 1..].iter().product();
        let dtype = self.plain_dtype("narrow")?;
        // The kept runs, copied in the stored dtype: a narrow of a bf16 tensor reads only what
        // it keeps (converting the whole tensor to f32 first made a cache slice cost its size).
        let keep = [outer, self.shape[dim], start, len, inner];
        let mut shape = self.shape.clone();
        shape[dim] = len;
        let storage = match &*self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => CpuStorage::F32(runs(v, keep)),
            Storage::Cpu(CpuStorage::BF16(v)) => CpuStorage::BF16(runs(v, keep)),
            Storage::Cpu(CpuStorage::F16(v)) => CpuStorage::F16(runs(v, keep)),
            _ => return Err(shape_err("narrow", format!("{dtype:?} storage"))),
        };
        Tensor::from_cpu_storage(storage, &shape)
    }

    /// Concatenation along `dim`; all other dimensions and the dtype must agree.
    pub fn cat(parts: &[&Tensor], dim: usize) -> Result<Tensor> {
        let first = parts
            .first()
            .ok_or_else(|| shape_err("cat", "nothing to concatenate"))?;
        let dtype = first.plain_dtype("cat")?;
        let mut shape = first.shape.clone();
        if dim >= shape.len() {
            return Err(shape_err("cat", format!("dim {dim} of {shape:?}")));
        }
        shape[dim] = 0;
        for p in parts {
            let same_rest = p.rank() == first.rank()
                && (0..p.rank()).all(|d| d == dim || p.shape[d] == first.shape[d]);
            if !same_rest || p.dtype() != dtype {
                return Err(shape_err(
                    "cat",
                    format!(
                        "{:?} {:?} with {:?} {:?}",
                        first.shape,
                        dtype,
                        p.shape,
                        p.dtype()
                    ),
                ));
            }
            if p.device() != first.device() {
                return Err(Error::DeviceMismatch {
                    op: "cat",
                    a: first.device().to_string(),
                    b: p.device().to_string(),
                });
            }
            shape[dim] += p.shape[dim];
        }
        if first.on_cuda() {
            return crate::cuda::ops::cat(parts, dim, &shape);
        }
        if first.on_rocm() {
            return crate::rocm::ops::cat(parts, dim, &shape);
        }
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        let srcs: Vec<_> = parts.iter().map(|p| p.cpu_f32()).collect();
        let mut out = Vec::with_capacity(numel(&shape));
        for o in 0..outer {
            for (p, s) in parts.iter().zip(&srcs) {
                let n = p.shape[dim] * inner;
                out.extend_from_slice(&s[o * n..(o + 1) * n]);
            }
        }
        Tensor::from_f32(out, &shape, dtype)
    }

    /// Reorders dimensions: output dimension `i` is input dimension `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let r = self.rank();
        let mut seen = vec![false; r];
        if perm.len() != r
            || perm
                .iter()
                .any(|&p| p >= r || std::mem::replace(&mut seen[p], true))
        {
            return Err(shape_err(
                "permute",
                format!("{perm:?} of {:?}", self.shape),
            ));
        }
        let shape: Vec<usize> = perm.iter().map(|&p| self.shape[p]).collect();
        let mut in_strides = vec![1usize; r];
        for d in (0..r.saturating_sub(1)).rev() {
            in_strides[d] = in_strides[d + 1] * self.shape[d + 1];
        }
        let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
        if self.on_cuda() {
            self.plain_dtype("permute")?;
            return crate::cuda::ops::permute(self, &shape, &strides);
        }
        if self.on_rocm() {
            self.plain_dtype("permute")?;
            return crate::rocm::ops::permute(self, &shape, &strides);
        }
        let src = self.cpu_f32();
        let n = numel(&shape);
        // When the last axis stays last, whole rows are contiguous in the source: copy them as
        // runs (the decoder's time interleave moves 128-wide rows this way).
        let (outer, run) = match r {
            0 => (0, 1),
            _ if strides[r - 1] == 1 => (r - 1, shape[r - 1]),
            _ => (r, 1),
        };
        let mut out = Vec::with_capacity(n);
        let mut idx = vec![0usize; outer];
        for _ in 0..n.checked_div(run).unwrap_or(0) {
            let off: usize = idx.iter().zip(&strides).map(|(i, s)| i * s).sum();
            out.extend_from_slice(&src[off..off + run]);
            for d in (0..outer).rev() {
                idx[d] += 1;
                if idx[d] < shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Tensor::from_f32(out, &shape, self.plain_dtype("permute")?)
    }

    /// The dtype, refusing fp8 for data movement that would need to re-derive scales.
    fn plain_dtype(&self, op: &'static str) -> Result<DType> {
        match self.dtype() {
            DType::F8E4M3 => Err(Error::DType {
                op,
                got: DType::F8E4M3,
                msg: "dequantize first",
            }),
            d => Ok(d),
        }
    }
}

/// `[outer, extent, inner]` data narrowed to `len` of `extent` from `start`:
/// `keep = [outer, extent, start, len, inner]`.
fn runs<T: Copy>(src: &[T], [outer, extent, start, len, inner]: [usize; 5]) -> Vec<T> {
    let mut out = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        let base = (o * extent + start) * inner;
        out.extend_from_slice(&src[base..base + len * inner]);
    }
    out
}
