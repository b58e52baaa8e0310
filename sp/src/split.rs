//! Ulysses attention with the queries split by destination: a rank attends first for the rows
//! the other ranks need back, sends them, and attends for its own rows while they cross the
//! links. The reverse exchange then hides behind attention instead of following it, and neither
//! the gathered queries nor the outgoing rows are copied into one buffer on the way.
//!
//! The others' rows run cyclically from the next rank's first token (wrapping past the end of the
//! sequence), so they are one contiguous run for RoPE (`ops::rope_3d_rows`) and for attention,
//! and each rank's part is one block of rows of it. It needs shards without padding rows.

use kernels::ops::{self, Piece};
use kernels::Tensor;

use crate::comm::Exchange;
use crate::ulysses::{Scatter, Ulysses};
use crate::Error;

impl Ulysses<'_> {
    /// Whether [`Scatter::finish_split`] and [`gather_heads_split_start`] apply: two ranks or
    /// more, every shard whole tokens (no padding).
    ///
    /// [`gather_heads_split_start`]: Ulysses::gather_heads_split_start
    pub fn splits_evenly(&self) -> bool {
        self.shard.ranks >= 2 && self.shard.padded() == self.shard.tokens
    }

    /// This rank's first token: where its own rows' run starts.
    pub fn own_first_token(&self) -> usize {
        self.shard.start()
    }

    /// Where the other ranks' run starts: the next rank's first token (0 after the last rank).
    pub fn others_first_token(&self) -> usize {
        let s = self.shard;
        ((s.rank + 1) % s.ranks) * s.per_rank()
    }

    /// Starts the reverse exchange from the others' attention output `others`:
    /// `[(ranks − 1)·per_rank, heads / ranks, d]`, the other ranks' rows in the order
    /// [`Scatter::finish_split`] gave their queries. [`Gather::finish`] adds this rank's own.
    pub fn gather_heads_split_start(&self, others: &Tensor) -> Result<Gather, Error> {
        let s = self.shard;
        let (n, rows) = (s.ranks, s.per_rank());
        if !self.splits_evenly() || others.rank() != 3 || others.dim(0) != (n - 1) * rows {
            return Err(Error::Invalid(format!(
                "gather_heads_split: {others:?} for {} ranks of {rows} rows",
                n
            )));
        }
        let send = (0..n)
            .map(|j| {
                if j == s.rank || n == 2 {
                    // Two ranks: the others' rows are the one part sent. A rank's own part is
                    // never sent: any tensor keeps the rank order.
                    return Ok(others.clone());
                }
                let at = (j + n - s.rank - 1) % n;
                Ok(others.narrow(0, at * rows, rows)?)
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(Gather {
            rank: s.rank,
            rows,
            exchange: self.comm.all_to_all_start(send)?,
        })
    }
}

impl Scatter {
    /// The queries of a one-tensor scatter, split for [`Ulysses::gather_heads_split_start`]:
    /// `(own, others)`, this rank's heads over its own rows `[per_rank, hn, d]` and over the
    /// other ranks' rows `[(ranks − 1)·per_rank, hn, d]`, from the next rank round to the one
    /// before. Needs shards without padding ([`Ulysses::splits_evenly`]).
    pub fn finish_split(self) -> Result<(Tensor, Tensor), Error> {
        let Scatter {
            shard: s,
            own,
            hn,
            exchange,
        } = self;
        let [t] = own.as_slice() else {
            return Err(Error::Invalid(format!(
                "finish_split of {} tensors (one is split)",
                own.len()
            )));
        };
        if s.ranks < 2 || s.padded() != s.tokens {
            return Err(Error::Invalid(format!(
                "finish_split: {} tokens over {} ranks (two or more, evenly)",
                s.tokens, s.ranks
            )));
        }
        let recv = exchange.finish()?;
        let (n, rows, d) = (s.ranks, s.per_rank(), t.dim(2));
        let (dtype, dev) = (t.dtype(), t.device());
        let mine = Piece {
            src_col: s.rank * hn * d,
            cols: hn * d,
            ..Piece::whole(t, 0, 0)
        };
        let own = ops::assemble(&[rows, hn, d], dtype, dev, &[mine])?;
        let others = if n == 2 {
            recv[1 - s.rank].clone()
        } else {
            let pieces: Vec<Piece> = (1..n)
                .map(|i| Piece::whole(&recv[(s.rank + i) % n], (i - 1) * rows, 0))
                .collect();
            ops::assemble(&[(n - 1) * rows, hn, d], dtype, dev, &pieces)?
        };
        Ok((own, others))
    }
}

/// A [`Ulysses::gather_heads_split_start`] under way.
pub struct Gather {
    rank: usize,
    rows: usize,
    exchange: Box<dyn Exchange>,
}

impl std::fmt::Debug for Gather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gather")
            .field("rank", &self.rank)
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

impl Gather {
    /// This rank's rows with every rank's heads, `[per_rank, heads, d]`, from its own heads'
    /// output `own: [per_rank, heads / ranks, d]` and what the other ranks sent.
    pub fn finish(self, own: &Tensor) -> Result<Tensor, Error> {
        let recv = self.exchange.finish()?;
        let (rows, hn, d) = (self.rows, own.dim(1), own.dim(2));
        if own.rank() != 3 || own.dim(0) != rows {
            return Err(Error::Invalid(format!(
                "gather finish: own rows {own:?}, expected {rows}"
            )));
        }
        let pieces: Vec<Piece> = (0..recv.len())
            .map(|r| {
                let src = if r == self.rank { own } else { &recv[r] };
                Piece::whole(src, 0, r * hn * d)
            })
            .collect();
        Ok(ops::assemble(
            &[rows, recv.len() * hn, d],
            own.dtype(),
            own.device(),
            &pieces,
        )?)
    }
}
