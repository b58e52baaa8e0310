//! Ulysses attention's data movement: a rank holds a contiguous shard of the sequence with all
//! heads outside attention, and the whole sequence with its share of the heads inside it.

use kernels::ops::{self, Piece};
use kernels::Tensor;

use crate::comm::{Communicator, Exchange};
use crate::Error;

/// The rank's contiguous slice of a sequence of `tokens`, padded at the end so that every rank
/// holds `per_rank` rows. Padding rows are never attended: they are cut off after the exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenShard {
    pub tokens: usize,
    pub ranks: usize,
    pub rank: usize,
}

impl TokenShard {
    pub fn new(tokens: usize, ranks: usize, rank: usize) -> Result<Self, Error> {
        if ranks == 0 || rank >= ranks {
            return Err(Error::Invalid(format!("rank {rank} of {ranks}")));
        }
        Ok(TokenShard {
            tokens,
            ranks,
            rank,
        })
    }

    /// Rows every rank holds.
    pub fn per_rank(&self) -> usize {
        self.tokens.div_ceil(self.ranks)
    }

    /// The sequence length padded to a multiple of the rank count.
    pub fn padded(&self) -> usize {
        self.per_rank() * self.ranks
    }

    /// First token of this rank's shard.
    pub fn start(&self) -> usize {
        (self.rank * self.per_rank()).min(self.tokens)
    }

    /// Real (not padding) tokens of this rank's shard.
    pub fn real(&self) -> usize {
        self.per_rank().min(self.tokens - self.start())
    }

    /// This rank's rows of `t: [tokens, ..]`, zero-padded to `per_rank` rows.
    pub fn take(&self, t: &Tensor) -> Result<Tensor, Error> {
        if t.rank() == 0 || t.dim(0) != self.tokens {
            return Err(Error::Invalid(format!(
                "sharding {t:?} as a sequence of {} tokens",
                self.tokens
            )));
        }
        let mut shape = t.shape().to_vec();
        shape[0] = self.per_rank();
        let piece = Piece {
            rows: self.real(),
            src_row: self.start(),
            ..Piece::whole(t, 0, 0)
        };
        Ok(ops::assemble(&shape, t.dtype(), t.device(), &[piece])?)
    }
}

/// `t` with zero rows appended up to `rows` rows (the zeros are written on `t`'s device).
pub fn pad_rows(t: &Tensor, rows: usize) -> Result<Tensor, Error> {
    if t.dim(0) == rows {
        return Ok(t.clone());
    }
    if rows < t.dim(0) {
        return Err(Error::Invalid(format!("padding {t:?} down to {rows} rows")));
    }
    let mut shape = t.shape().to_vec();
    shape[0] = rows;
    Ok(ops::assemble(
        &shape,
        t.dtype(),
        t.device(),
        &[Piece::whole(t, 0, 0)],
    )?)
}

/// A [`Ulysses::scatter_heads_start`] under way.
pub struct Scatter {
    shard: TokenShard,
    /// This rank's own tensors (its own heads are taken from them, not from the links).
    own: Vec<Tensor>,
    hn: usize,
    exchange: Box<dyn Exchange>,
}

impl std::fmt::Debug for Scatter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scatter")
            .field("shard", &self.shard)
            .field("own", &self.own)
            .finish_non_exhaustive()
    }
}

impl Scatter {
    /// The tensors as [`Ulysses::scatter_heads`] returns them.
    pub fn finish(self) -> Result<Vec<Tensor>, Error> {
        let Scatter {
            shard: s,
            own,
            hn,
            exchange,
        } = self;
        let recv = exchange.finish()?;
        let rows = s.per_rank();
        // Rank r's rows of tensor i, padding cut off: from the other ranks' parts, or this
        // rank's own heads of its own projections.
        own.iter()
            .enumerate()
            .map(|(i, t)| {
                let (d, dtype, dev) = (t.dim(2), t.dtype(), t.device());
                let pieces: Vec<Piece> = (0..s.ranks)
                    .filter_map(|r| {
                        let real = rows.min(s.tokens.saturating_sub(r * rows));
                        (real > 0).then(|| {
                            if r == s.rank {
                                Piece {
                                    src_col: r * hn * d,
                                    rows: real,
                                    cols: hn * d,
                                    dst_row: r * rows,
                                    ..Piece::whole(t, 0, 0)
                                }
                            } else {
                                Piece {
                                    src_row: i * rows,
                                    rows: real,
                                    dst_row: r * rows,
                                    ..Piece::whole(&recv[r], 0, 0)
                                }
                            }
                        })
                    })
                    .collect();
                Ok(ops::assemble(&[s.tokens, hn, d], dtype, dev, &pieces)?)
            })
            .collect()
    }
}

/// Ulysses for one forward: the communicator and the shard of this forward's tokens.
#[derive(Clone, Copy, Debug)]
pub struct Ulysses<'a> {
    pub comm: &'a dyn Communicator,
    pub shard: TokenShard,
    /// Measurement only: see [`resend_like_stock`](Self::resend_like_stock).
    pub resend_window: bool,
}

impl<'a> Ulysses<'a> {
    pub fn new(comm: &'a dyn Communicator, tokens: usize) -> Result<Self, Error> {
        let shard = TokenShard::new(tokens, comm.world_size(), comm.rank())?;
        Ok(Ulysses {
            comm,
            shard,
            resend_window: false,
        })
    }

    fn heads_per_rank(&self, t: &Tensor) -> Result<usize, Error> {
        let heads = t.dim(1);
        crate::heads_per_card(heads, self.shard.ranks)
    }

    /// Scatters heads and gathers tokens, for several `[per_rank, heads, d]` tensors in one
    /// all-to-all: each comes back as `[tokens, heads / ranks, d]`, the whole sequence in
    /// order with this rank's heads, padding cut off.
    pub fn scatter_heads(&self, ts: &[&Tensor]) -> Result<Vec<Tensor>, Error> {
        self.scatter_heads_start(ts)?.finish()
    }

    /// [`scatter_heads`](Self::scatter_heads) whose result is taken with [`Scatter::finish`]:
    /// on a device the exchange runs while the work queued in between does.
    pub fn scatter_heads_start(&self, ts: &[&Tensor]) -> Result<Scatter, Error> {
        let s = self.shard;
        let n = s.ranks;
        let first = ts
            .first()
            .ok_or_else(|| Error::Invalid("scatter_heads of nothing".into()))?;
        for t in ts {
            if t.rank() != 3 || t.dim(0) != s.per_rank() || t.shape() != first.shape() {
                return Err(Error::Invalid(format!(
                    "scatter_heads: {t:?} for shards of {} tokens",
                    s.per_rank()
                )));
            }
        }
        let hn = self.heads_per_rank(first)?;
        let (rows, d) = (s.per_rank(), first.dim(2));
        let (dtype, dev) = (first.dtype(), first.device());
        // One part per other rank: its heads of every tensor, stacked along the rows, each
        // copied once straight from the projections. This rank's own heads never go through a
        // send buffer.
        let part = |j: usize| -> Result<Tensor, Error> {
            let pieces: Vec<Piece> = ts
                .iter()
                .enumerate()
                .map(|(i, t)| Piece {
                    src_col: j * hn * d,
                    cols: hn * d,
                    dst_row: i * rows,
                    ..Piece::whole(t, 0, 0)
                })
                .collect();
            Ok(ops::assemble(
                &[ts.len() * rows, hn, d],
                dtype,
                dev,
                &pieces,
            )?)
        };
        let send = (0..n)
            .map(|j| {
                if j == s.rank {
                    // A rank's own part is never sent: any tensor keeps the rank order.
                    Ok((*first).clone())
                } else {
                    part(j)
                }
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(Scatter {
            shard: s,
            own: ts.iter().map(|t| (*t).clone()).collect(),
            hn,
            exchange: self.comm.all_to_all_start(send)?,
        })
    }

    /// The reverse exchange: `[tokens, heads / ranks, d]` (this rank's heads over the whole
    /// sequence) → `[per_rank, heads, d]` (all heads of this rank's shard).
    pub fn gather_heads(&self, t: &Tensor) -> Result<Tensor, Error> {
        let s = self.shard;
        if t.rank() != 3 || t.dim(0) != s.tokens {
            return Err(Error::Invalid(format!(
                "gather_heads: {t:?} for a sequence of {} tokens",
                s.tokens
            )));
        }
        let (rows, hn, d) = (s.per_rank(), t.dim(1), t.dim(2));
        let (dtype, dev) = (t.dtype(), t.device());
        // Rank j's rows of the sequence (zero-padded to `rows`), for the other ranks only.
        let real = |j: usize| rows.min(s.tokens.saturating_sub(j * rows));
        let send = (0..s.ranks)
            .map(|j| {
                if j == s.rank {
                    // A rank's own part is never sent: any tensor keeps the rank order.
                    return Ok(t.clone());
                }
                let piece = Piece {
                    src_row: j * rows,
                    rows: real(j),
                    ..Piece::whole(t, 0, 0)
                };
                let pieces = if real(j) == 0 {
                    Vec::new()
                } else {
                    vec![piece]
                };
                Ok(ops::assemble(&[rows, hn, d], dtype, dev, &pieces)?)
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let recv = self.comm.all_to_all(send)?;
        // Every rank's heads of this rank's rows, side by side; this rank's own heads come
        // straight from `t`.
        let pieces: Vec<Piece> = (0..s.ranks)
            .map(|r| {
                if r == s.rank {
                    Piece {
                        src_row: r * rows,
                        rows: real(r),
                        dst_col: r * hn * d,
                        ..Piece::whole(t, 0, 0)
                    }
                } else {
                    Piece::whole(&recv[r], 0, r * hn * d)
                }
            })
            .filter(|p| p.rows > 0)
            .collect();
        Ok(ops::assemble(
            &[rows, s.ranks * hn, d],
            dtype,
            dev,
            &pieces,
        )?)
    }

    /// What the stock Ulysses exchange moves on top of ours: with the cache token-sharded,
    /// every attention call sends the `cached` tokens' K/V of the other ranks' heads through
    /// the all-to-all. This sends rows of `keys`/`values` (`[tokens, heads / ranks, d]`, this
    /// rank's heads) in parts of exactly that size and drops what arrives, so the bytes and
    /// the time in collectives of the stock approach can be measured on the same run.
    pub fn resend_like_stock(
        &self,
        keys: &Tensor,
        values: &Tensor,
        cached: usize,
    ) -> Result<(), Error> {
        let n = self.shard.ranks;
        let per = cached.div_ceil(n);
        if per == 0 || n == 1 {
            return Ok(());
        }
        if keys.rank() != 3 || keys.shape() != values.shape() {
            return Err(Error::Invalid(format!(
                "resend_like_stock: keys {keys:?} and values {values:?}"
            )));
        }
        // The rows are only payload: pad a short cache rather than send less.
        let rows = (per * n).max(keys.dim(0));
        let (keys, values) = (pad_rows(keys, rows)?, pad_rows(values, rows)?);
        let send = (0..n)
            .map(|j| {
                let k = keys.narrow(0, j * per, per)?;
                let v = values.narrow(0, j * per, per)?;
                Ok(Tensor::cat(&[&k, &v], 0)?)
            })
            .collect::<Result<Vec<_>, Error>>()?;
        self.comm.all_to_all(send)?;
        Ok(())
    }

    /// Every rank's `[per_rank, ..]` rows, joined in token order with the padding cut off.
    pub fn gather_tokens(&self, t: &Tensor) -> Result<Tensor, Error> {
        let whole = self.comm.all_gather_cat(t)?;
        if whole.dim(0) == self.shard.tokens {
            return Ok(whole);
        }
        Ok(whole.narrow(0, 0, self.shard.tokens)?)
    }
}
