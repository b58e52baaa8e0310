//! What a rank group needs from its links: the collectives of Ulysses attention and of the rank
//! group's bookkeeping, on [`Tensor`]s of whatever device the backend serves.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};

use kernels::Tensor;

use crate::Error;

/// One rank's handle on a communicator. Every rank of the group must call the same collectives
/// in the same order (lockstep); a backend may check this and fail with
/// [`Error::Mismatch`](crate::Error::Mismatch).
///
/// After [`abort`](Communicator::abort) (by any rank) every pending and later collective of every
/// rank returns [`Error::Aborted`](crate::Error::Aborted), so no rank waits on one that is gone.
pub trait Communicator: Debug + Send + Sync {
    fn rank(&self) -> usize;

    fn world_size(&self) -> usize;

    /// `send[j]` goes to rank `j` (the rank's own part included); returns what each rank `i`
    /// sent here, in rank order. Parts may differ in shape between pairs of ranks.
    fn all_to_all(&self, send: Vec<Tensor>) -> Result<Vec<Tensor>, Error>;

    /// [`all_to_all`](Self::all_to_all) whose result is taken later, with
    /// [`Exchange::finish`]: a device backend lets the links work while the device runs what
    /// is queued in between (work that must not read what arrives). Every rank starts its
    /// exchanges in the same order. Here: the exchange runs at once.
    fn all_to_all_start(&self, send: Vec<Tensor>) -> Result<Box<dyn Exchange>, Error> {
        Ok(Box::new(Arrived(self.all_to_all(send)?)))
    }

    /// Every rank's `t`, in rank order.
    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>, Error>;

    /// Every rank's `t` joined along dim 0 in rank order: [`Tensor::cat`] of
    /// [`all_gather`](Self::all_gather), which a device backend receives straight into.
    fn all_gather_cat(&self, t: &Tensor) -> Result<Tensor, Error> {
        let parts = self.all_gather(t)?;
        Ok(Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?)
    }

    /// `root`'s `t` on every rank. Other ranks pass a tensor of the same shape and dtype (the
    /// receive buffer a device backend fills).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Error>;

    fn barrier(&self) -> Result<(), Error>;

    /// Fails the whole group: `reason` is reported, attributed to this rank, by every rank's
    /// pending and later collectives. The first abort of a group is the one reported.
    fn abort(&self, reason: &str);

    /// Bytes this rank has sent to other ranks so far (its own parts are not counted), and the
    /// time its collectives took.
    fn stats(&self) -> CommStats;
}

/// An all-to-all under way (see [`Communicator::all_to_all_start`]).
pub trait Exchange {
    /// What each rank sent here, in rank order, ready for the device work queued from now on.
    fn finish(self: Box<Self>) -> Result<Vec<Tensor>, Error>;
}

/// An exchange that was complete when it started.
struct Arrived(Vec<Tensor>);

impl Exchange for Arrived {
    fn finish(self: Box<Self>) -> Result<Vec<Tensor>, Error> {
        Ok(self.0)
    }
}

/// Bytes one rank sent to other ranks, per collective kind, and the time in collectives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    pub all_to_all_bytes: u64,
    pub all_to_all_calls: u64,
    pub all_gather_bytes: u64,
    pub broadcast_bytes: u64,
    /// Nanoseconds from a collective's start to its end, summed: on a device, the stream's
    /// time in it (waiting for the slowest rank included); on the loopback, wall time.
    pub collective_ns: u64,
}

impl CommStats {
    pub fn total_bytes(&self) -> u64 {
        self.all_to_all_bytes + self.all_gather_bytes + self.broadcast_bytes
    }
}

impl std::ops::Add for CommStats {
    type Output = CommStats;
    fn add(self, o: CommStats) -> CommStats {
        CommStats {
            all_to_all_bytes: self.all_to_all_bytes + o.all_to_all_bytes,
            all_to_all_calls: self.all_to_all_calls + o.all_to_all_calls,
            all_gather_bytes: self.all_gather_bytes + o.all_gather_bytes,
            broadcast_bytes: self.broadcast_bytes + o.broadcast_bytes,
            collective_ns: self.collective_ns + o.collective_ns,
        }
    }
}

impl std::ops::Sub for CommStats {
    type Output = CommStats;
    fn sub(self, o: CommStats) -> CommStats {
        CommStats {
            all_to_all_bytes: self.all_to_all_bytes - o.all_to_all_bytes,
            all_to_all_calls: self.all_to_all_calls - o.all_to_all_calls,
            all_gather_bytes: self.all_gather_bytes - o.all_gather_bytes,
            broadcast_bytes: self.broadcast_bytes - o.broadcast_bytes,
            collective_ns: self.collective_ns - o.collective_ns,
        }
    }
}

/// Lock-free counters behind [`CommStats`], for backends to share.
#[derive(Debug, Default)]
pub struct StatCounters {
    all_to_all_bytes: AtomicU64,
    all_to_all_calls: AtomicU64,
    all_gather_bytes: AtomicU64,
    broadcast_bytes: AtomicU64,
    collective_ns: AtomicU64,
}

/// Which counter a collective adds to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    AllToAll,
    AllGather,
    Broadcast,
    Barrier,
}

impl StatCounters {
    pub fn add(&self, kind: Kind, bytes: u64) {
        let c = match kind {
            Kind::AllToAll => {
                self.all_to_all_calls.fetch_add(1, Ordering::Relaxed);
                &self.all_to_all_bytes
            }
            Kind::AllGather => &self.all_gather_bytes,
            Kind::Broadcast => &self.broadcast_bytes,
            Kind::Barrier => return,
        };
        c.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Adds the duration of one collective.
    pub fn add_time(&self, d: std::time::Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.collective_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> CommStats {
        CommStats {
            all_to_all_bytes: self.all_to_all_bytes.load(Ordering::Relaxed),
            all_to_all_calls: self.all_to_all_calls.load(Ordering::Relaxed),
            all_gather_bytes: self.all_gather_bytes.load(Ordering::Relaxed),
            broadcast_bytes: self.broadcast_bytes.load(Ordering::Relaxed),
            collective_ns: self.collective_ns.load(Ordering::Relaxed),
        }
    }
}

/// Bytes of a tensor's elements as a link carries them.
pub fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}
