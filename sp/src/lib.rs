//! Sequence parallelism across cards (DESIGN.md §5): the [`Communicator`] collectives with a
//! loopback backend (ranks as threads of one process, for CPU runs and CI), the [`RankGroup`]
//! that runs one thread per rank in lockstep, and the data movement of [`Ulysses`] attention.
//! The NCCL backend ([`NcclComm`], CUDA) and the RCCL backend ([`RcclComm`], ROCm; never run:
//! no AMD GPU here) implement the same trait on GPU tensors, from one source (`nccl.rs`).

mod comm;
mod cuda;
mod group;
mod loopback;
mod rocm;
mod ulysses;

pub use comm::{tensor_bytes, CommStats, Communicator, Exchange, Kind, StatCounters};
pub use cuda::nccl::{nccl_library, NcclComm};
pub use group::{BoxError, RankGroup, RankWorker};
pub use loopback::{LoopbackComm, LoopbackWorld};
pub use rccl_sys;
pub use rocm::nccl::{nccl_library as rccl_library, NcclComm as RcclComm};
pub use ulysses::{pad_rows, Scatter, TokenShard, Ulysses};

/// Errors of the communicators and the rank group.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "{heads} attention heads do not split over {cards} cards (valid card counts: {valid})"
    )]
    HeadsIndivisible {
        heads: usize,
        cards: usize,
        valid: String,
    },

    #[error("--cards must be at least 1")]
    NoCards,

    #[error("rank {rank} failed: {reason}")]
    RankFailed { rank: usize, reason: String },

    /// This rank's collective was cut short because the group was aborted.
    #[error("collective aborted: rank {rank} failed: {reason}")]
    Aborted { rank: usize, reason: String },

    #[error("collective timed out waiting for rank {rank}: {reason}")]
    Timeout { rank: usize, reason: String },

    #[error("ranks called different collectives: {0}")]
    Mismatch(String),

    #[error("the rank group failed earlier and must be restarted: {0}")]
    GroupBroken(String),

    #[error("sequence parallel: {0}")]
    Invalid(String),

    /// The collectives library could not be loaded (the message names what was tried).
    #[error("{0}")]
    Library(String),

    #[error("NCCL on rank {rank}: {msg}")]
    Nccl { rank: usize, msg: String },

    #[error(transparent)]
    Kernel(#[from] kernels::Error),
}

/// Heads each card holds under Ulysses, which shards attention by head: the head count must
/// divide by the card count.
pub fn heads_per_card(heads: usize, cards: usize) -> Result<usize, Error> {
    if cards == 0 {
        return Err(Error::NoCards);
    }
    if !heads.is_multiple_of(cards) {
        let valid: Vec<String> = (1..=heads)
            .filter(|c| heads.is_multiple_of(*c))
            .map(|c| c.to_string())
            .collect();
        return Err(Error::HeadsIndivisible {
            heads,
            cards,
            valid: valid.join(", "),
        });
    }
    Ok(heads / cards)
}

#[cfg(test)]
mod tests;
