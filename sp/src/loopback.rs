//! The loopback communicator: the ranks are threads of one process and a collective is a
//! rendezvous on shared memory. Tensors are handed over by reference (their storage is shared),
//! but bytes are counted as a device link would carry them, so CPU runs measure the exchange.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kernels::Tensor;

use crate::comm::{tensor_bytes, CommStats, Communicator, Kind, StatCounters};
use crate::Error;

/// What one rank put into one collective.
#[derive(Debug)]
struct Deposit {
    kind: Kind,
    root: usize,
    parts: Vec<Tensor>,
}

/// One collective: a deposit per rank, removed once every rank has read it.
#[derive(Debug)]
struct Round {
    deposits: Vec<Option<Deposit>>,
    readers: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Keyed by the collective's sequence number, so a fast rank can deposit into the next
    /// collective before a slow one has read the last.
    rounds: HashMap<u64, Round>,
    /// The first abort: (rank, reason).
    failure: Option<(usize, String)>,
}

/// The shared side of a loopback group.
#[derive(Debug)]
pub struct LoopbackWorld {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    wake: Condvar,
}

impl LoopbackWorld {
    /// A group of `size` ranks; a collective that waits longer than `timeout` for the other
    /// ranks fails the group (a rank stuck outside any collective cannot be aborted otherwise).
    pub fn new(size: usize, timeout: Duration) -> Result<Arc<Self>, Error> {
        if size == 0 {
            return Err(Error::NoCards);
        }
        Ok(Arc::new(LoopbackWorld {
            size,
            timeout,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        }))
    }

    /// One handle per rank, in rank order.
    pub fn communicators(self: &Arc<Self>) -> Vec<LoopbackComm> {
        (0..self.size)
            .map(|rank| LoopbackComm {
                world: self.clone(),
                rank,
                seq: AtomicU64::new(0),
                stats: StatCounters::default(),
            })
            .collect()
    }

    /// The first failure of the group, if any: (rank, reason).
    pub fn failure(&self) -> Option<(usize, String)> {
        self.lock().failure.clone()
    }

    pub fn abort(&self, rank: usize, reason: &str) {
        let mut st = self.lock();
        if st.failure.is_none() {
            st.failure = Some((rank, reason.to_string()));
        }
        st.rounds.clear();
        drop(st);
        self.wake.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank never panics while holding the lock, and the state stays consistent if one
        // did: the failure field is the only thing that matters after a panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn aborted(failure: &(usize, String)) -> Error {
    Error::Aborted {
        rank: failure.0,
        reason: failure.1.clone(),
    }
}

/// One rank's handle on a [`LoopbackWorld`].
#[derive(Debug)]
pub struct LoopbackComm {
    world: Arc<LoopbackWorld>,
    rank: usize,
    seq: AtomicU64,
    stats: StatCounters,
}

impl LoopbackComm {
    /// Deposits `parts` and returns every rank's deposit for this rank: part `rank` of each
    /// for an all-to-all, the single part otherwise (the root's only, for a broadcast).
    fn collective(
        &self,
        kind: Kind,
        root: usize,
        parts: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, Error> {
        let n = self.world.size;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let deadline = started + self.world.timeout;
        let mut st = self.world.lock();
        if let Some(f) = &st.failure {
            return Err(aborted(f));
        }
        let round = st.rounds.entry(seq).or_insert_with(|| Round {
            deposits: (0..n).map(|_| None).collect(),
            readers: 0,
        });
        round.deposits[self.rank] = Some(Deposit { kind, root, parts });
        self.world.wake.notify_all();
        loop {
            if let Some(f) = &st.failure {
                return Err(aborted(f));
            }
            let missing: Vec<usize> = match st.rounds.get(&seq) {
                Some(r) => (0..n).filter(|&i| r.deposits[i].is_none()).collect(),
                None => Vec::new(),
            };
            if missing.is_empty() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                let reason = format!(
                    "rank {} waited {:?} in collective #{seq} for rank(s) {missing:?}",
                    self.rank, self.world.timeout
                );
                drop(st);
                self.world.abort(missing[0], &reason);
                return Err(Error::Timeout {
                    rank: missing[0],
                    reason,
                });
            }
            st = self
                .world
                .wake
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let round = st
            .rounds
            .get_mut(&seq)
            .ok_or_else(|| Error::Invalid(format!("collective #{seq} vanished")))?;
        let deposits: Vec<&Deposit> = round.deposits.iter().flatten().collect();
        let first = deposits[0];
        if let Some(d) = deposits
            .iter()
            .find(|d| d.kind != first.kind || d.root != first.root)
        {
            let reason = format!(
                "collective #{seq}: {:?} (root {}) against {:?} (root {})",
                first.kind, first.root, d.kind, d.root
            );
            drop(st);
            self.world.abort(self.rank, &reason);
            return Err(Error::Mismatch(reason));
        }
        let out: Result<Vec<Tensor>, Error> = match kind {
            Kind::AllToAll => deposits
                .iter()
                .map(|d| {
                    d.parts.get(self.rank).cloned().ok_or_else(|| {
                        Error::Invalid(format!("all_to_all: {} parts for {n} ranks", d.parts.len()))
                    })
                })
                .collect(),
            Kind::AllGather => Ok(deposits.iter().flat_map(|d| d.parts.clone()).collect()),
            Kind::Broadcast => Ok(deposits[root].parts.clone()),
            Kind::Barrier => Ok(Vec::new()),
        };
        round.readers += 1;
        if round.readers == n {
            st.rounds.remove(&seq);
        }
        self.stats.add_time(started.elapsed());
        out
    }
}

impl Communicator for LoopbackComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world.size
    }

    fn all_to_all(&self, send: Vec<Tensor>) -> Result<Vec<Tensor>, Error> {
        if send.len() != self.world.size {
            return Err(Error::Invalid(format!(
                "all_to_all: {} parts for {} ranks",
                send.len(),
                self.world.size
            )));
        }
        let bytes = send
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != self.rank)
            .map(|(_, t)| tensor_bytes(t))
            .sum();
        let out = self.collective(Kind::AllToAll, 0, send)?;
        self.stats.add(Kind::AllToAll, bytes);
        Ok(out)
    }

    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>, Error> {
        let out = self.collective(Kind::AllGather, 0, vec![t.clone()])?;
        let others = (self.world.size - 1) as u64;
        self.stats.add(Kind::AllGather, tensor_bytes(t) * others);
        Ok(out)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Error> {
        if root >= self.world.size {
            return Err(Error::Invalid(format!(
                "broadcast from rank {root} of {}",
                self.world.size
            )));
        }
        let mut out = self.collective(Kind::Broadcast, root, vec![t.clone()])?;
        let got = out
            .pop()
            .ok_or_else(|| Error::Invalid("broadcast: the root sent nothing".into()))?;
        if got.shape() != t.shape() || got.dtype() != t.dtype() {
            return Err(Error::Invalid(format!(
                "broadcast: {got:?} from rank {root} into a buffer {t:?}"
            )));
        }
        if self.rank == root {
            let others = (self.world.size - 1) as u64;
            self.stats.add(Kind::Broadcast, tensor_bytes(t) * others);
        }
        Ok(got)
    }

    fn barrier(&self) -> Result<(), Error> {
        self.collective(Kind::Barrier, 0, Vec::new()).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        self.world.abort(self.rank, reason);
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }
}

impl Drop for LoopbackComm {
    fn drop(&mut self) {
        // A rank thread unwinding past its communicator would leave the others waiting for it
        // until the timeout; failing the group at once names it instead.
        if std::thread::panicking() {
            self.world.abort(self.rank, "the rank's thread panicked");
        }
    }
}
