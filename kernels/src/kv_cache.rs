use crate::error::shape_err;
use crate::{ops, DType, Error, Fp8Kv, Result, Tensor};

/// The self-attention K/V of one layer for a streaming session: at most `window_frames` latent
/// frames, the first `sink_frames` ever written kept for good, the rest a rolling window.
///
/// Keys are stored as given (already rotated, at their absolute positions) and never moved in
/// position space: eviction shifts rows left over the oldest non-sink frames, as upstream does.
/// Rewriting frames that are already held (the next denoising step of the same chunk, or its
/// clean-context refresh) overwrites them in place.
#[derive(Clone, Debug)]
pub struct KvCache {
    tokens_per_frame: usize,
    window_frames: usize,
    sink_frames: usize,
    /// Absolute latent-frame indices held, oldest first.
    frames: Vec<u64>,
    k: Tensor,
    v: Tensor,
    /// The same keys and values quantized for the fp8 attention, where asked for.
    fp8: Option<Fp8Kv>,
    /// Per-frame slab sums of the keys for VSA's key-tile means, where asked for.
    key_sums: Option<KeySums>,
}

/// The keys' 1×4×4 slab sums ([`crate::vsa::frame_sums`]) of every held frame, row for frame
/// as the keys: `[window_frames · slabs, heads, head_dim]` f32.
#[derive(Clone, Debug)]
struct KeySums {
    hw: [usize; 2],
    sums: Tensor,
}

/// Where a chunk's key sums go in a cache that keeps them ([`KvCache::write_with_sums`]): rows
/// `row ..` of `sums`, frames of `hw` tokens.
#[derive(Debug)]
pub struct SumRows<'a> {
    pub sums: &'a mut Tensor,
    pub row: usize,
    pub hw: [usize; 2],
}

impl KvCache {
    /// An empty cache on the CPU.
    pub fn new(
        window_frames: usize,
        sink_frames: usize,
        tokens_per_frame: usize,
        heads: usize,
        head_dim: usize,
        dtype: DType,
    ) -> Result<Self> {
        let cpu = crate::Device::Cpu;
        Self::new_on(
            window_frames,
            sink_frames,
            tokens_per_frame,
            heads,
            head_dim,
            dtype,
            cpu,
        )
    }

    /// An empty cache whose zeros are made on `device` (no host buffer, no upload: a 14B
    /// engine's caches are ~23 GB).
    pub fn new_on(
        window_frames: usize,
        sink_frames: usize,
        tokens_per_frame: usize,
        heads: usize,
        head_dim: usize,
        dtype: DType,
        device: crate::Device,
    ) -> Result<Self> {
        if window_frames == 0 || sink_frames >= window_frames || tokens_per_frame == 0 {
            return Err(Error::Invalid {
                op: "KvCache::new",
                msg: format!(
                    "window {window_frames} frames with {sink_frames} sink frames and {tokens_per_frame} tokens per frame"
                ),
            });
        }
        let shape = [window_frames * tokens_per_frame, heads, head_dim];
        Ok(KvCache {
            tokens_per_frame,
            window_frames,
            sink_frames,
            frames: Vec::with_capacity(window_frames),
            k: Tensor::zeros_on(&shape, dtype, device)?,
            v: Tensor::zeros_on(&shape, dtype, device)?,
            fp8: None,
            key_sums: None,
        })
    }

    /// The same (empty or not) cache with its storage on `device`.
    pub fn on_device(mut self, device: crate::Device) -> Result<Self> {
        self.k = self.k.to_device(device)?;
        self.v = self.v.to_device(device)?;
        if let Some(ks) = &mut self.key_sums {
            ks.sums = ks.sums.to_device(device)?;
        }
        if self.fp8.is_some() {
            self.fp8 = None;
            return self.with_fp8_attention();
        }
        Ok(self)
    }

    /// The same cache also kept in fp8 for [`crate::attention_fp8`] (head dim 128): every write
    /// requantizes the 128-key tiles it touches (one scale per tile and head), and an eviction
    /// requantizes the rows it moved. The bf16 (or f32) copy stays the cache's content.
    pub fn with_fp8_attention(mut self) -> Result<Self> {
        let (cap, heads) = (self.k.dim(0), self.k.dim(1));
        if self.k.dim(2) != crate::fp8_attention::FP8_HEAD_DIM {
            return Err(Error::Invalid {
                op: "KvCache::with_fp8_attention",
                msg: format!(
                    "the fp8 attention takes head dim {}, this cache has {}",
                    crate::fp8_attention::FP8_HEAD_DIM,
                    self.k.dim(2)
                ),
            });
        }
        let mut kv = Fp8Kv::new(cap, heads, self.k.device())?;
        let held = self.len_tokens();
        kv.requantize(&self.k, &self.v, 0..held, held)?;
        self.fp8 = Some(kv);
        Ok(self)
    }

    /// The same cache also keeping its keys' per-frame slab sums, for VSA over it
    /// ([`crate::vsa::attention_cached`]): a write sums the frames it writes, an eviction moves
    /// the sums with the keys, so a sparse attention call reads only its chunk's keys for the
    /// key-tile means, not the whole window. `hw` is a frame's rows and columns of tokens.
    pub fn with_key_sums(mut self, hw: [usize; 2]) -> Result<Self> {
        if hw[0] * hw[1] != self.tokens_per_frame {
            return Err(Error::Invalid {
                op: "KvCache::with_key_sums",
                msg: format!(
                    "{}×{} tokens per frame, the cache holds {}",
                    hw[0], hw[1], self.tokens_per_frame
                ),
            });
        }
        let slabs = crate::vsa::slabs_per_frame(hw);
        let shape = [self.window_frames * slabs, self.k.dim(1), self.k.dim(2)];
        let sums = Tensor::zeros_on(&shape, DType::F32, self.k.device())?;
        self.key_sums = Some(KeySums { hw, sums });
        self.resum(0, self.len_tokens())?;
        Ok(self)
    }

    /// The keys' per-frame slab sums (the first `frames().len()` frames' rows hold data), when
    /// the cache keeps them.
    pub fn key_sums(&self) -> Option<&Tensor> {
        self.key_sums.as_ref().map(|s| &s.sums)
    }

    /// Sums the keys of rows `at .. at + n` (whole frames) into the slab sums, if kept.
    fn resum(&mut self, at: usize, n: usize) -> Result<()> {
        let tpf = self.tokens_per_frame;
        match &mut self.key_sums {
            Some(ks) if n > 0 => {
                let grid = [n / tpf, ks.hw[0], ks.hw[1]];
                let slabs = crate::vsa::slabs_per_frame(ks.hw);
                crate::vsa::frame_sums_into(&mut ks.sums, at / tpf * slabs, &self.k, at, grid)
            }
            _ => Ok(()),
        }
    }

    /// The fp8 copy, when the cache keeps one.
    pub fn fp8(&self) -> Option<&Fp8Kv> {
        self.fp8.as_ref()
    }

    /// Quantizes rows `at .. at + n` of the cache into its fp8 copy, if it keeps one.
    fn requantize(&mut self, at: usize, n: usize) -> Result<()> {
        let held = self.len_tokens();
        match &mut self.fp8 {
            Some(kv) => kv.requantize(&self.k, &self.v, at..at + n, held),
            None => Ok(()),
        }
    }

    /// Writes the K/V of consecutive frames starting at absolute frame `first_frame`.
    pub fn write(&mut self, first_frame: u64, k: &Tensor, v: &Tensor) -> Result<()> {
        if k.shape() != v.shape() {
            return Err(shape_err(
                "KvCache::write",
                format!("k {:?} and v {:?} differ", k.shape(), v.shape()),
            ));
        }
        if k.dtype() != self.k.dtype() {
            return Err(Error::DType {
                op: "KvCache::write",
                got: k.dtype(),
                msg: "k and v must have the cache's dtype",
            });
        }
        self.write_keys_with(first_frame, v, |keys, row| ops::write_rows(keys, row, k))
    }

    /// [`write`](Self::write) with the keys made in place: `keys(storage, row)` must fill rows
    /// `[row, row + v.dim(0))` of the key storage it is given (as `ops::rms_norm_rope_into`
    /// does), so a chunk's keys are never stored apart and copied over. If it fails, the
    /// frames it was to hold are not held (an eviction it followed stays done).
    pub fn write_keys_with(
        &mut self,
        first_frame: u64,
        v: &Tensor,
        keys: impl FnOnce(&mut Tensor, usize) -> Result<()>,
    ) -> Result<()> {
        // Everything `write_rows` would refuse is checked here, before eviction moves any row.
        if v.rank() != 3 || v.shape()[1..] != self.v.shape()[1..] {
            return Err(shape_err(
                "KvCache::write",
                format!(
                    "k/v {:?} with {} tokens per frame",
                    v.shape(),
                    self.tokens_per_frame
                ),
            ));
        }
        if v.dtype() != self.v.dtype() {
            return Err(Error::DType {
                op: "KvCache::write",
                got: v.dtype(),
                msg: "k and v must have the cache's dtype",
            });
        }
        self.write_with(first_frame, v.dim(0), keys, |values, row| {
            ops::write_rows(values, row, v)
        })
    }

    /// [`write`](Self::write) of `tokens` rows (whole frames) with both keys and values made in
    /// place: `keys(storage, row)` and `values(storage, row)` must fill rows
    /// `[row, row + tokens)` of the storage they are given (as `ops::rms_norm_rope_into` and
    /// `ops::linear_into` do). If either fails, the frames it was to hold are not held (an
    /// eviction it followed stays done).
    pub fn write_with(
        &mut self,
        first_frame: u64,
        tokens: usize,
        keys: impl FnOnce(&mut Tensor, usize) -> Result<()>,
        values: impl FnOnce(&mut Tensor, usize) -> Result<()>,
    ) -> Result<()> {
        let keys = |k: &mut Tensor, row, _: Option<SumRows>| keys(k, row).map(|()| false);
        self.write_with_sums(first_frame, tokens, keys, values)
    }

    /// [`write_with`](Self::write_with) where the keys' maker may also make the keys' slab sums,
    /// where the cache keeps them ([`with_key_sums`](Self::with_key_sums)): `keys` is then
    /// handed the rows the chunk's sums take ([`SumRows`]) and returns whether it filled them
    /// (as `ops::rms_norm_rope_into_sums` does, in the launch that writes the keys); if not, the
    /// cache sums the written keys itself.
    pub fn write_with_sums(
        &mut self,
        first_frame: u64,
        tokens: usize,
        keys: impl FnOnce(&mut Tensor, usize, Option<SumRows>) -> Result<bool>,
        values: impl FnOnce(&mut Tensor, usize) -> Result<()>,
    ) -> Result<()> {
        let tpf = self.tokens_per_frame;
        if tokens == 0 || !tokens.is_multiple_of(tpf) {
            return Err(shape_err(
                "KvCache::write",
                format!("{tokens} tokens with {tpf} tokens per frame"),
            ));
        }
        let n = tokens / tpf;
        let (at, new) = self.slot(first_frame, n)?;
        let sums = self.key_sums.as_mut().map(|ks| SumRows {
            row: at / tpf * crate::vsa::slabs_per_frame(ks.hw),
            hw: ks.hw,
            sums: &mut ks.sums,
        });
        let written =
            keys(&mut self.k, at, sums).and_then(|summed| values(&mut self.v, at).map(|()| summed));
        let summed = match written {
            Ok(summed) => summed,
            Err(e) => {
                // Rewritten frames hold half-written rows now: drop them and what follows.
                self.frames.truncate(at / tpf);
                return Err(e);
            }
        };
        if new {
            self.frames.extend((0..n as u64).map(|i| first_frame + i));
        }
        self.requantize(at, tokens)?;
        if summed {
            return Ok(());
        }
        self.resum(at, tokens)
    }

    /// The first row of `n` frames from `first_frame`, and whether they are new: rows they
    /// already hold, or rows after the held ones once the eviction that makes room is done.
    fn slot(&mut self, first_frame: u64, n: usize) -> Result<(usize, bool)> {
        let tpf = self.tokens_per_frame;
        if let Some(pos) = self.frames.iter().position(|&f| f == first_frame) {
            let held = &self.frames[pos..];
            if held.len() < n || (0..n).any(|i| held[i] != first_frame + i as u64) {
                return Err(Error::Invalid {
                    op: "KvCache::write",
                    msg: format!(
                        "frames {first_frame}..+{n} only partly held ({:?})",
                        self.frames
                    ),
                });
            }
            return Ok((pos * tpf, false));
        }
        if let Some(&last) = self.frames.last() {
            if first_frame <= last {
                return Err(Error::Invalid {
                    op: "KvCache::write",
                    msg: format!("frame {first_frame} is older than the newest held frame {last}"),
                });
            }
        }
        let len = self.frames.len();
        let evict = (len + n).saturating_sub(self.window_frames);
        if evict > len.saturating_sub(self.sink_frames) {
            return Err(Error::Invalid {
                op: "KvCache::write",
                msg: format!(
                    "a chunk of {n} frames does not fit a window of {} with {} sink frames",
                    self.window_frames, self.sink_frames
                ),
            });
        }
        if evict > 0 {
            let (from, keep) = (self.sink_frames + evict, len - self.sink_frames - evict);
            ops::move_rows(&mut self.k, from * tpf, self.sink_frames * tpf, keep * tpf)?;
            ops::move_rows(&mut self.v, from * tpf, self.sink_frames * tpf, keep * tpf)?;
            if let Some(ks) = &mut self.key_sums {
                let slabs = crate::vsa::slabs_per_frame(ks.hw);
                let (from, to, keep) = (from * slabs, self.sink_frames * slabs, keep * slabs);
                ops::move_rows(&mut ks.sums, from, to, keep)?;
            }
            self.frames
                .drain(self.sink_frames..self.sink_frames + evict);
            self.requantize(self.sink_frames * tpf, keep * tpf)?;
        }
        Ok((self.frames.len() * tpf, true))
    }

    /// Absolute indices of the frames held, oldest first.
    pub fn frames(&self) -> &[u64] {
        &self.frames
    }

    /// Rows of `keys()`/`values()` that hold data.
    pub fn len_tokens(&self) -> usize {
        self.frames.len() * self.tokens_per_frame
    }

    /// Key storage `[window_frames · tokens_per_frame, heads, head_dim]`; only the first
    /// `len_tokens()` rows are valid.
    pub fn keys(&self) -> &Tensor {
        &self.k
    }

    pub fn values(&self) -> &Tensor {
        &self.v
    }

    pub fn clear(&mut self) {
        self.frames.clear();
    }
}
