//! Attention with e4m3 operands over a KV cache kept in fp8 beside its bf16 copy.
//!
//! The numbers: q, k and v are quantized with one scale per (tile of 128 rows, head) (`amax /
//! 448` over the tile, the codec of [`crate::fp8`]; `kernels/gpu/attention_fp8.cu` says why per
//! tile); scores and softmax run in f32 on the dequantized values. What this module's CPU path
//! computes is the definition; the CUDA kernel also rounds the softmax weights to e4m3 (scaled
//! into the top of the format's range), which its test bounds against this reference.
//!
//! The store is written as the cache is: a write requantizes only the key tiles it touches.

use crate::cpu::attention::{attention as cpu_attention, AttnDims};
use crate::error::shape_err;
use crate::tensor::CpuStorage;
use crate::{cuda, fp8, DType, Device, Error, Result, Storage, Tensor};

/// Head dim the fp8 attention takes (Wan's).
pub const FP8_HEAD_DIM: usize = 128;

/// Rows per quantization tile (the kernel's key and query tiles); keys are stored in whole tiles.
pub const FP8_TILE: usize = 128;

/// The key a cache's transposed V holds at `slot` of each group of 32 keys: the order in which
/// a thread's softmax weights already sit in the fp8 matrix-multiply operand (attention_fp8.cu's
/// `fp8_vt_key`).
pub fn vt_key(slot: usize) -> usize {
    let (half, p) = (slot & 16, slot & 15);
    let (t, i) = (p >> 2, p & 3);
    half + 2 * t + (i & 1) + ((i >> 1) << 3)
}

/// Where key `key` sits in a transposed V: its group of 32, at the slot [`vt_key`] gives it.
pub fn vt_slot(key: usize) -> usize {
    let r = key & 15;
    (key & !15) | (((r & 7) >> 1) << 2) | (r & 1) | ((r >> 3) << 1)
}

/// The keys and values of a cache as the fp8 attention reads them, for `capacity` keys of
/// `heads` heads:
/// - `k`: codes `[capacity, heads, 128]` (stored as an fp8 tensor of unit scale), `k_scale`
///   `[heads, capacity / 128]`, one per key tile;
/// - `vt`: V transposed, codes `[heads, 128, capacity]`, keys in [`vt_key`] order within each
///   group of 32; `v_scale` `[heads, capacity / 128]`.
#[derive(Clone, Debug)]
pub struct Fp8Kv {
    heads: usize,
    capacity: usize,
    k: Tensor,
    k_scale: Tensor,
    vt: Tensor,
    v_scale: Tensor,
}

impl Fp8Kv {
    /// An empty store for at least `keys` keys on `device` (zeros: keys never written are finite
    /// and masked).
    pub fn new(keys: usize, heads: usize, device: Device) -> Result<Self> {
        let capacity = keys.div_ceil(FP8_TILE).max(1) * FP8_TILE;
        let scales = || Tensor::zeros_on(&[heads, capacity / FP8_TILE], DType::F32, device);
        let codes = |shape: &[usize]| Tensor::zeros_on(shape, DType::F8E4M3, device);
        Ok(Fp8Kv {
            heads,
            capacity,
            k: codes(&[capacity, heads, FP8_HEAD_DIM])?,
            k_scale: scales()?,
            vt: codes(&[heads, FP8_HEAD_DIM, capacity])?,
            v_scale: scales()?,
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn heads(&self) -> usize {
        self.heads
    }

    pub fn device(&self) -> Device {
        self.k.device()
    }

    /// Requantizes the key tiles that overlap `keys` from `k`, `v` `[rows, heads, 128]` (f32 or
    /// bf16: the cache's whole storage, of which the first `valid` rows hold keys; a tile's rows
    /// at or past `valid` become zeros).
    pub fn requantize(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        keys: std::ops::Range<usize>,
        valid: usize,
    ) -> Result<()> {
        let ok = k.shape() == v.shape()
            && k.rank() == 3
            && k.dim(1) == self.heads
            && k.dim(2) == FP8_HEAD_DIM
            && valid <= k.dim(0)
            && keys.end <= valid
            && valid <= self.capacity;
        if !ok {
            return Err(shape_err(
                "Fp8Kv::requantize",
                format!(
                    "k {:?} v {:?}, keys {keys:?} of {valid} valid, into a store of {} keys × {} \
                     heads × {FP8_HEAD_DIM}",
                    k.shape(),
                    v.shape(),
                    self.capacity,
                    self.heads
                ),
            ));
        }
        if k.dtype() == DType::F8E4M3 || v.dtype() == DType::F8E4M3 {
            return Err(Error::DType {
                op: "Fp8Kv::requantize",
                got: DType::F8E4M3,
                msg: "f32 or bf16 keys and values (they are quantized here)",
            });
        }
        if keys.is_empty() {
            return Ok(());
        }
        let tiles = keys.start / FP8_TILE..keys.end.div_ceil(FP8_TILE);
        match k.storage() {
            Storage::Cpu(_) => self.requantize_cpu(k, v, tiles, valid),
            Storage::Cuda(_) => cuda::ops::fp8_kv_store(self.parts_mut(), k, v, tiles, valid),
            Storage::Rocm(_) => {
                crate::rocm::ops::fp8_kv_store(self.parts_mut(), k, v, tiles, valid)
            }
        }
    }

    /// The store's four tensors, mutably, for a backend's writer: k codes, k scales, vᵀ codes,
    /// v scales.
    pub(crate) fn parts_mut(&mut self) -> [&mut Tensor; 4] {
        [
            &mut self.k,
            &mut self.k_scale,
            &mut self.vt,
            &mut self.v_scale,
        ]
    }

    /// The store's four tensors (as [`parts_mut`](Self::parts_mut)): what a test compares
    /// between backends.
    pub fn parts(&self) -> [&Tensor; 4] {
        [&self.k, &self.k_scale, &self.vt, &self.v_scale]
    }

    fn requantize_cpu(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        tiles: std::ops::Range<usize>,
        valid: usize,
    ) -> Result<()> {
        let (heads, cap, d) = (self.heads, self.capacity, FP8_HEAD_DIM);
        let ntiles = cap / FP8_TILE;
        let (kf, vf) = (k.cpu_f32(), v.cpu_f32());
        for tile in tiles {
            let (r0, r1) = (tile * FP8_TILE, ((tile + 1) * FP8_TILE).min(valid));
            for h in 0..heads {
                let (kq, sk) = quantize_tile(&kf, r0, r1, heads, h);
                let (vq, sv) = quantize_tile(&vf, r0, r1, heads, h);
                let kc = cpu_codes_mut(&mut self.k)?;
                for (i, row) in kq.chunks_exact(d).enumerate() {
                    kc[((r0 + i) * heads + h) * d..][..d].copy_from_slice(row);
                }
                let vtc = cpu_codes_mut(&mut self.vt)?;
                for (i, row) in vq.chunks_exact(d).enumerate() {
                    let slot = vt_slot(r0 + i);
                    for (dim, c) in row.iter().enumerate() {
                        vtc[(h * d + dim) * cap + slot] = *c;
                    }
                }
                cpu_f32_mut(&mut self.k_scale)?[h * ntiles + tile] = sk;
                cpu_f32_mut(&mut self.v_scale)?[h * ntiles + tile] = sv;
            }
        }
        Ok(())
    }
}

/// Rows `r0 .. r0 + 128` of head `h` of `x` `[rows, heads, 128]` as codes with one scale (rows at
/// or past `r1` as zeros).
fn quantize_tile(x: &[f32], r0: usize, r1: usize, heads: usize, h: usize) -> (Vec<u8>, f32) {
    let d = FP8_HEAD_DIM;
    let row = |r: usize| &x[(r * heads + h) * d..][..d];
    let amax = (r0..r1).map(|r| fp8::amax(row(r))).fold(0.0f32, f32::max);
    let s = fp8::scale_for_amax(amax);
    let mut codes = vec![0u8; FP8_TILE * d];
    for r in r0..r1 {
        fp8::quantize_into(row(r), s, &mut codes[(r - r0) * d..][..d]);
    }
    (codes, s)
}

fn cpu_codes_mut(t: &mut Tensor) -> Result<&mut [u8]> {
    match t.storage_mut() {
        Storage::Cpu(CpuStorage::F8E4M3 { codes, .. }) => Ok(codes),
        _ => Err(shape_err("Fp8Kv", "fp8 codes on the CPU expected")),
    }
}

fn cpu_f32_mut(t: &mut Tensor) -> Result<&mut [f32]> {
    match t.storage_mut() {
        Storage::Cpu(CpuStorage::F32(v)) => Ok(v),
        _ => Err(shape_err("Fp8Kv", "f32 scales on the CPU expected")),
    }
}

fn cpu_codes(t: &Tensor) -> Result<&[u8]> {
    match t.storage() {
        Storage::Cpu(CpuStorage::F8E4M3 { codes, .. }) => Ok(codes),
        _ => Err(shape_err("Fp8Kv", "fp8 codes on the CPU expected")),
    }
}

/// Attention of `q: [lq, heads, 128]` (f32 or bf16) over the first `kv_len` keys of `kv`, scaled
/// by `1/sqrt(128)`, no mask; the output in `q`'s dtype. See the module's text for the numbers.
pub fn attention_fp8(q: &Tensor, kv: &Fp8Kv, kv_len: usize) -> Result<Tensor> {
    let ok = q.rank() == 3
        && q.dim(1) == kv.heads
        && q.dim(2) == FP8_HEAD_DIM
        && kv_len >= 1
        && kv_len <= kv.capacity;
    if !ok {
        return Err(shape_err(
            "attention_fp8",
            format!(
                "q {:?} over {kv_len} keys of a store of {} keys × {} heads × {FP8_HEAD_DIM}",
                q.shape(),
                kv.capacity,
                kv.heads
            ),
        ));
    }
    if q.dtype() == DType::F8E4M3 {
        return Err(Error::DType {
            op: "attention_fp8",
            got: DType::F8E4M3,
            msg: "f32 or bf16 queries (they are quantized here)",
        });
    }
    if q.device() != kv.device() {
        return Err(Error::DeviceMismatch {
            op: "attention_fp8",
            a: q.device().to_string(),
            b: kv.device().to_string(),
        });
    }
    match q.storage() {
        Storage::Cpu(_) => attention_cpu(q, kv, kv_len),
        Storage::Cuda(_) => cuda::ops::attention_fp8(q, kv, kv_len),
        Storage::Rocm(_) => crate::rocm::ops::attention_fp8(q, kv, kv_len),
    }
}

/// Whether [`attention_fp8`] runs on `device`: the CPU (the reference), a Hopper GPU (sm_90a's
/// wgmma kernel) or a gfx950 (its MFMA kernel). Elsewhere it errors, saying so; a device that
/// does not open answers false.
pub fn supported(device: Device) -> bool {
    match device {
        Device::Cpu => true,
        Device::Cuda(i) => cuda::backend(i).is_ok_and(|b| b.arch == "sm_90a"),
        Device::Rocm(i) => {
            crate::rocm::backend(i).is_ok_and(|b| crate::rocm::ops::has_fp8_attention(&b.arch))
        }
    }
}

/// Runs [`attention_fp8`] on `device` and on the CPU over the same small store (150 queries, 300
/// keys written in two pieces, 2 heads, fixed pseudo-random values with key tiles at different
/// magnitudes) and returns the relative L2 distance; an error if it exceeds 4e-2 (the e4m3
/// rounding of P is ~2.5 % here; a wrong layout or scale is order one). For backends that have
/// never run on the project's machines (ROCm), before a model takes the path.
pub fn check(device: Device) -> Result<f64> {
    let (lq, kv_len, heads) = (150, 300, 2);
    let mut seed = 0x5eed_u64;
    let mut values = |n: usize, gain: &dyn Fn(usize) -> f32| -> Vec<f32> {
        (0..n)
            .map(|i| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * gain(i)
            })
            .collect()
    };
    let row = heads * FP8_HEAD_DIM;
    let tile_gain = |g: [f32; 3]| move |i: usize| g[i / row / FP8_TILE];
    let q = Tensor::from_vec(values(lq * row, &|_| 1.0), &[lq, heads, FP8_HEAD_DIM])?
        .to_dtype(DType::BF16)?;
    let k = Tensor::from_vec(
        values(kv_len * row, &tile_gain([1.0, 2.0, 0.5])),
        &[kv_len, heads, FP8_HEAD_DIM],
    )?
    .to_dtype(DType::BF16)?;
    let v = Tensor::from_vec(
        values(kv_len * row, &tile_gain([1.0, 4.0, 0.25])),
        &[kv_len, heads, FP8_HEAD_DIM],
    )?
    .to_dtype(DType::BF16)?;
    let mut cpu = Fp8Kv::new(kv_len, heads, Device::Cpu)?;
    let mut dev = Fp8Kv::new(kv_len, heads, device)?;
    let (kd, vd) = (k.to_device(device)?, v.to_device(device)?);
    for (a, b) in [(0, 213), (213, kv_len)] {
        cpu.requantize(&k, &v, a..b, b)?;
        dev.requantize(&kd, &vd, a..b, b)?;
    }
    let want = attention_fp8(&q, &cpu, kv_len)?.to_vec_f32();
    let got = attention_fp8(&q.to_device(device)?, &dev, kv_len)?.to_vec_f32();
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(&want) {
        num += (f64::from(*g) - f64::from(*w)).powi(2);
        den += f64::from(*w).powi(2);
    }
    let rel = (num / den.max(1e-30)).sqrt();
    // NaN fails too.
    if rel.is_nan() || rel > 4e-2 {
        return Err(Error::Device {
            device: device.to_string(),
            msg: format!(
                "fp8 attention check: relative L2 {rel:.3e} from the CPU reference exceeds 4e-2; \
                 this GPU computes wrong results on that path: run attention in bf16"
            ),
        });
    }
    Ok(rel)
}

/// The reference: every operand dequantized from its codes, then the f32 attention of the CPU
/// backend (exact softmax).
fn attention_cpu(q: &Tensor, kv: &Fp8Kv, kv_len: usize) -> Result<Tensor> {
    let (lq, heads, cap, d) = (q.dim(0), kv.heads, kv.capacity, FP8_HEAD_DIM);
    let qf = q.cpu_f32();
    let mut qd = vec![0f32; lq * heads * d];
    for tile in 0..lq.div_ceil(FP8_TILE) {
        let (r0, r1) = (tile * FP8_TILE, ((tile + 1) * FP8_TILE).min(lq));
        for h in 0..heads {
            let (codes, s) = quantize_tile(&qf, r0, r1, heads, h);
            for r in r0..r1 {
                let at = (r * heads + h) * d;
                fp8::dequantize_into(&codes[(r - r0) * d..][..d], s, &mut qd[at..at + d]);
            }
        }
    }
    let (kc, vtc) = (cpu_codes(&kv.k)?, cpu_codes(&kv.vt)?);
    let (ksc, vsc) = (kv.k_scale.cpu_f32(), kv.v_scale.cpu_f32());
    let ntiles = cap / FP8_TILE;
    let mut kd = vec![0f32; kv_len * heads * d];
    let mut vd = vec![0f32; kv_len * heads * d];
    for key in 0..kv_len {
        let slot = vt_slot(key);
        for h in 0..heads {
            let at = h * ntiles + key / FP8_TILE;
            let (sk, sv) = (ksc[at], vsc[at]);
            let row = (key * heads + h) * d;
            for dim in 0..d {
                kd[row + dim] = fp8::decode(kc[row + dim]) * sk;
                vd[row + dim] = fp8::decode(vtc[(h * d + dim) * cap + slot]) * sv;
            }
        }
    }
    let dims = AttnDims {
        lq,
        kv_len,
        heads,
        d,
    };
    let scale = 1.0 / (d as f32).sqrt();
    let out = cpu_attention(&qd, &kd, &vd, dims, scale, None, |_| kv_len);
    Tensor::from_f32(out, q.shape(), q.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vt_slot_inverts_vt_key_within_each_group() {
        let mut seen = [false; 32];
        for s in 0..32 {
            let k = vt_key(s);
            assert!(k < 32 && !seen[k], "slot {s} -> key {k}");
            seen[k] = true;
            assert_eq!(vt_slot(64 + k), 64 + s);
        }
        // A thread's accumulator columns 2t, 2t+1, 8+2t, 9+2t are the A fragment's 4t..4t+3.
        for t in 0..4 {
            assert_eq!(
                [0, 1, 2, 3].map(|i| vt_key(4 * t + i)),
                [2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t]
            );
        }
    }

    fn normals(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                // Sum of four uniforms: close enough to normal for attention inputs.
                (0..4)
                    .map(|_| {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                    })
                    .sum::<f32>()
                    * 1.7
            })
            .collect()
    }

    /// The reference written in three unaligned chunks stays close to attention on the
    /// unquantized inputs: a wrong transposition or slot order of V, or a scale on the wrong
    /// key, gives errors of order one.
    #[test]
    fn fp8_reference_tracks_unquantized_attention() -> Result<()> {
        let (lq, kv_len, heads, d) = (40, 150, 3, FP8_HEAD_DIM);
        let q = Tensor::from_vec(normals(lq * heads * d, 1), &[lq, heads, d])?;
        let k = Tensor::from_vec(normals(kv_len * heads * d, 2), &[kv_len, heads, d])?;
        let mut v = normals(kv_len * heads * d, 3);
        // Keys of very different magnitudes (1× to 7×) inside each 128-key tile.
        for (i, x) in v.iter_mut().enumerate() {
            *x *= 1.0 + (i / (heads * d) % 7) as f32;
        }
        let v = Tensor::from_vec(v, &[kv_len, heads, d])?;
        let mut kv = Fp8Kv::new(kv_len, heads, Device::Cpu)?;
        assert_eq!(kv.capacity(), 256);
        // Written as a cache fills: each write requantizes the tiles it touches.
        for (a, b) in [(0, 45), (45, 101), (101, kv_len)] {
            kv.requantize(&k, &v, a..b, b)?;
        }
        let got = attention_fp8(&q, &kv, kv_len)?.to_vec_f32();
        let want = crate::ops::attention(&q, &k, &v, kv_len, crate::AttnMask::None)?.to_vec_f32();
        let (num, den) = got.iter().zip(&want).fold((0f64, 0f64), |(n, d), (g, w)| {
            (n + ((g - w) as f64).powi(2), d + (*w as f64).powi(2))
        });
        let e = (num / den).sqrt();
        assert!(e < 6e-2, "rel L2 {e}");
        // Writing past the store, and queries of another head count, are refused.
        assert!(kv.requantize(&k, &v, 100..160, 160).is_err());
        assert!(attention_fp8(&q.narrow(1, 0, 2)?, &kv, kv_len).is_err());
        Ok(())
    }
}
