//! The NCCL/RCCL communicator: the ranks are GPUs of one process (one thread each). One source
//! for both vendors: `lib.rs` compiles it once over CUDA devices and NCCL ([`crate::NcclComm`])
//! and once over ROCm devices and RCCL ([`crate::RcclComm`]), the parent module naming the
//! backend's types (`Backend`, `Marker`, `GpuStorage`) and library (`FLAVOR`). The ROCm one has
//! never run (no AMD GPU here). The
//! collectives run on a second stream of each rank's device, after the work its ops' stream has
//! queued; the ops' stream waits for a collective before anything reads what it delivered, at
//! once, or, for [`Communicator::all_to_all_start`], when the exchange is finished, so the ops
//! queued in between run while the links work.
//!
//! Waiting: NCCL only enqueues, so a dead or stuck peer shows up as a kernel that never ends.
//! Each collective records a marker on the side stream; before the next collective is enqueued
//! (and right away for broadcast and barrier, whose results the host usually reads next) the
//! rank polls that marker together with the group's failure flag, `ncclCommGetAsyncError`
//! and a deadline, so the host never runs more than one collective ahead of its GPU and never
//! waits for ever. The first failure of any rank aborts every rank's communicator
//! (`ncclCommAbort` kills the kernels still waiting for peers), and every pending and later
//! collective returns [`Error::Aborted`].

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kernels::{DType, Device, Tensor};
use rccl_sys::{Comm, DataType, Nccl, NcclResult, RedOp, UniqueId};

use super::{Backend, GpuStorage, Marker, FLAVOR};

use crate::comm::{tensor_bytes, CommStats, Communicator, Exchange, Kind, StatCounters};
use crate::Error;

/// The collectives library of this process for these devices, loaded on first use (NCCL for
/// CUDA, RCCL for ROCm).
pub fn nccl_library() -> Result<Arc<Nccl>, Error> {
    static LIB: OnceLock<Result<Arc<Nccl>, String>> = OnceLock::new();
    LIB.get_or_init(|| Nccl::load(FLAVOR).map(Arc::new).map_err(|e| e.to_string()))
        .clone()
        .map_err(Error::Library)
}

/// A raw communicator handle.
#[derive(Debug)]
struct RawComm(Comm);

// SAFETY: an ncclComm_t may be used from any thread, one call at a time; every use goes
// through the `Slot` mutex.
unsafe impl Send for RawComm {}

/// One rank's communicator handle, `None` once destroyed or aborted.
#[derive(Debug)]
struct Slot {
    dev: Arc<Backend>,
    comm: Mutex<Option<RawComm>>,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, Option<RawComm>> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `ncclCommAbort`: frees the communicator and kills its kernels still on the device.
    fn abort(&self, nccl: &Nccl) {
        let taken = self.lock().take();
        Self::abort_raw(&self.dev, nccl, taken);
    }

    /// [`abort`](Self::abort) unless the owner is inside an NCCL call on this communicator
    /// (it aborts it itself once the call returns and it sees the group's failure).
    fn try_abort(&self, nccl: &Nccl) {
        let taken = match self.comm.try_lock() {
            Ok(mut g) => g.take(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().take(),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        Self::abort_raw(&self.dev, nccl, taken);
    }

    fn abort_raw(dev: &Backend, nccl: &Nccl, taken: Option<RawComm>) {
        if let Some(c) = taken {
            // Best effort: NCCL binds the communicator's device itself as well.
            let _ = dev.bind_to_thread();
            // SAFETY: `c` is a live communicator, taken out of its slot so no other call can
            // use it afterwards.
            let _ = unsafe { (nccl.comm_abort)(c.0) };
        }
    }
}

/// What the ranks of one group share.
#[derive(Debug)]
struct Shared {
    nccl: Arc<Nccl>,
    timeout: Duration,
    failed: AtomicBool,
    failure: Mutex<Option<(usize, String)>>,
    /// Collectives each rank has enqueued, to name the laggard on a timeout.
    progress: Vec<AtomicU64>,
    slots: Mutex<Vec<Arc<Slot>>>,
}

impl Shared {
    fn failure(&self) -> Option<(usize, String)> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records the group's first failure, then aborts every rank's communicator so that no
    /// rank's stream waits on a peer that is gone.
    fn fail(&self, rank: usize, reason: &str) {
        {
            let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            if f.is_none() {
                *f = Some((rank, reason.to_string()));
            }
            self.failed.store(true, Ordering::Release);
        }
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for s in slots {
            s.try_abort(&self.nccl);
        }
    }
}

fn aborted(f: (usize, String)) -> Error {
    Error::Aborted {
        rank: f.0,
        reason: f.1,
    }
}

fn nccl_dtype(t: &Tensor) -> Result<DataType, Error> {
    match t.dtype() {
        DType::F32 => Ok(DataType::FLOAT32),
        DType::BF16 => Ok(DataType::BFLOAT16),
        d => Err(Error::Invalid(format!(
            "NCCL collectives move f32 or bf16 tensors, not {}",
            d.name()
        ))),
    }
}

/// One rank's handle on an NCCL/RCCL communicator over CUDA tensors of its GPU.
#[derive(Debug)]
pub struct NcclComm {
    shared: Arc<Shared>,
    rank: usize,
    size: usize,
    slot: Arc<Slot>,
    /// The marker after this rank's last collective, not yet seen complete.
    /// The last collective's start and end on the stream, until it is known to be done.
    pending: Mutex<Option<(Marker, Marker)>>,
    stats: StatCounters,
}

impl NcclComm {
    /// One communicator per GPU of `gpus` (rank `i` on `gpus[i]`), over this process's NCCL.
    /// Rank 0's unique id is shared in-process; each rank binds its device on its own thread
    /// and joins with `ncclCommInitRank` inside `ncclGroupStart/End`, then runs one of each
    /// collective so that connections are set up while every rank is known to be alive.
    /// Fails, naming the rank, if a rank cannot join within `timeout`.
    pub fn group(gpus: &[usize], timeout: Duration) -> Result<Vec<NcclComm>, Error> {
        if gpus.is_empty() {
            return Err(Error::NoCards);
        }
        for (i, g) in gpus.iter().enumerate() {
            if gpus[..i].contains(g) {
                return Err(Error::Invalid(format!(
                    "GPU {g} is listed twice: one rank per GPU"
                )));
            }
        }
        let nccl = nccl_library()?;
        let devs = gpus
            .iter()
            .map(|&g| super::open(g))
            .collect::<kernels::Result<Vec<_>>>()?;
        let id = nccl
            .unique_id()
            .map_err(|e| Error::Library(e.to_string()))?;
        let n = gpus.len();
        let shared = Arc::new(Shared {
            nccl,
            timeout,
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            progress: (0..n).map(|_| AtomicU64::new(0)).collect(),
            slots: Mutex::new(Vec::new()),
        });
        let (tx, rx) = mpsc::channel();
        for (rank, dev) in devs.into_iter().enumerate() {
            let (shared, tx) = (shared.clone(), tx.clone());
            std::thread::Builder::new()
                .name(format!("nccl-init-{rank}"))
                .spawn(move || {
                    let r = Self::join(shared, rank, n, dev, id);
                    let _ = tx.send((rank, r));
                })
                .map_err(|e| Error::Invalid(format!("starting NCCL rank {rank}: {e}")))?;
        }
        drop(tx);
        let deadline = Instant::now() + timeout;
        let mut comms: Vec<Option<NcclComm>> = (0..n).map(|_| None).collect();
        let mut first_error = None;
        for _ in 0..n {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((rank, Ok(c))) => comms[rank] = Some(c),
                Ok((rank, Err(e))) => {
                    let reason = format!("joining the NCCL group: {e}");
                    shared.fail(rank, &reason);
                    first_error.get_or_insert(Error::RankFailed { rank, reason });
                }
                Err(_) => {
                    let missing: Vec<usize> = (0..n).filter(|&r| comms[r].is_none()).collect();
                    let reason = format!(
                        "rank(s) {missing:?} did not join the NCCL group within {timeout:?}"
                    );
                    shared.fail(missing.first().copied().unwrap_or(0), &reason);
                    first_error.get_or_insert(Error::Timeout {
                        rank: missing.first().copied().unwrap_or(0),
                        reason,
                    });
                    break;
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        comms
            .into_iter()
            .enumerate()
            .map(|(r, c)| c.ok_or_else(|| Error::Invalid(format!("NCCL rank {r} vanished"))))
            .collect()
    }

    /// Rank `rank`'s side of [`group`](Self::group), on its own thread.
    fn join(
        shared: Arc<Shared>,
        rank: usize,
        n: usize,
        dev: Arc<Backend>,
        id: UniqueId,
    ) -> Result<NcclComm, Error> {
        let nccl = shared.nccl.clone();
        let bad = |what: &str, e: rccl_sys::Error| Error::Nccl {
            rank,
            msg: format!("{what}: {e}"),
        };
        dev.bind_to_thread()?;
        let (nranks, me) = (
            c_int::try_from(n).map_err(|_| Error::Invalid(format!("{n} ranks")))?,
            c_int::try_from(rank).map_err(|_| Error::Invalid(format!("rank {rank}")))?,
        );
        let mut raw: Comm = std::ptr::null_mut();
        // SAFETY: group start takes no arguments.
        let started = unsafe { (nccl.group_start)() };
        nccl.check("ncclGroupStart", started)
            .map_err(|e| bad("init", e))?;
        // SAFETY: `raw` is a valid out-pointer; `id` is the group's id by value; the device of
        // this rank is current on this thread.
        let init = unsafe { (nccl.comm_init_rank)(&mut raw, nranks, id, me) };
        // SAFETY: ends the group started above.
        let ended = unsafe { (nccl.group_end)() };
        let r = nccl
            .check("ncclCommInitRank", init)
            .and_then(|()| nccl.check("ncclGroupEnd", ended));
        if let Err(e) = r {
            if !raw.is_null() {
                // SAFETY: a communicator NCCL handed out, never used again.
                let _ = unsafe { (nccl.comm_abort)(raw) };
            }
            return Err(bad("ncclCommInitRank", e));
        }
        let slot = Arc::new(Slot {
            dev,
            comm: Mutex::new(Some(RawComm(raw))),
        });
        shared
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slot.clone());
        let mut comm = NcclComm {
            shared,
            rank,
            size: n,
            slot,
            pending: Mutex::new(None),
            stats: StatCounters::default(),
        };
        comm.warm_up()?;
        comm.stats = StatCounters::default();
        Ok(comm)
    }

    /// One of each collective on tiny tensors: NCCL connects peers lazily, and a connection
    /// set up later would block in `ncclGroupEnd` if the peer had died meanwhile.
    fn warm_up(&self) -> Result<(), Error> {
        let dev = self.device();
        let n = self.size;
        for dtype in [DType::F32, DType::BF16] {
            let t = Tensor::zeros(&[4], dtype)?.to_device(dev)?;
            self.all_to_all((0..n).map(|_| t.clone()).collect())?;
            self.all_gather(&t)?;
            self.broadcast(&t, 0)?;
        }
        self.barrier()
    }

    /// The GPU of this rank.
    pub fn device(&self) -> Device {
        super::device(self.slot.dev.ordinal)
    }

    /// The loaded library (name and version).
    pub fn library(&self) -> &Nccl {
        &self.shared.nccl
    }

    fn storage<'a>(&self, t: &'a Tensor) -> Result<&'a GpuStorage, Error> {
        match super::on_device(t, self.slot.dev.ordinal) {
            Some(s) => Ok(s),
            None => Err(Error::Invalid(format!(
                "{t:?} handed to the NCCL rank {} on {}",
                self.rank,
                self.device()
            ))),
        }
    }

    /// A fresh `shape` buffer on this rank's GPU and its address.
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<(GpuStorage, u64), Error> {
        let n = shape.iter().product();
        let mut st = GpuStorage::alloc(&self.slot.dev, dtype, n)?;
        let ptr = st.device_ptr_mut()?;
        Ok((st, ptr))
    }

    /// `ncclAllGather` of `t` (not empty) into a fresh buffer of `shape` (`size` times its
    /// elements). Only the ops' stream waits for it, not the host, which goes on enqueueing
    /// the work that follows (the head's GEMM, the next step's noise) as for the all-to-all.
    fn gather_into(&self, t: &Tensor, shape: &[usize]) -> Result<Tensor, Error> {
        let count = t.elem_count();
        let dt = nccl_dtype(t)?;
        let sptr = self.storage(t)?.device_ptr()?;
        let (buf, rptr) = self.alloc(t.dtype(), shape)?;
        let done = self.launch("all_gather", false, |nccl, comm, stream| {
            // SAFETY: `sptr` holds `count` elements, `rptr` `size * count`, both of `dt`, on
            // this rank's device; `comm` is live.
            let r = unsafe {
                (nccl.all_gather)(sptr as *const _, rptr as *mut _, count, dt, comm, stream)
            };
            nccl.check("ncclAllGather", r)
        })?;
        self.slot.dev.main_waits(&done)?;
        self.stats
            .add(Kind::AllGather, tensor_bytes(t) * (self.size as u64 - 1));
        Ok(buf.into_tensor(shape)?)
    }

    /// Fails this rank (and so the group) with `reason`, as the error to return.
    fn fail(&self, reason: String) -> Error {
        self.shared.fail(self.rank, &reason);
        Error::Nccl {
            rank: self.rank,
            msg: reason,
        }
    }

    /// [`Error::Aborted`] once the group has failed (aborting this rank's communicator if
    /// that was left to it).
    fn check_failed(&self) -> Result<(), Error> {
        match self.shared.failure() {
            Some(f) => {
                self.slot.abort(&self.shared.nccl);
                Err(aborted(f))
            }
            None => Ok(()),
        }
    }

    /// Waits for the last collective's marker: bounded by the group's timeout, cut short by
    /// any rank's failure or an NCCL asynchronous error.
    fn wait_pending(&self, what: &str) -> Result<(), Error> {
        let marker = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some((start, marker)) = marker else {
            return Ok(());
        };
        // Event queries need the device's context on this thread (a drop on another thread).
        self.slot.dev.bind_to_thread()?;
        let started = Instant::now();
        let mut polls = 0u64;
        loop {
            self.check_failed()?;
            match marker.is_done() {
                Ok(true) => {
                    // Timing is for reports: a failed query loses a number, not the run.
                    if let Ok(d) = marker.elapsed_since(&start) {
                        self.stats.add_time(d);
                    }
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) => return Err(self.fail(format!("{what}: device error: {e}"))),
            }
            polls += 1;
            // The async-error query takes the communicator's lock: not on every spin.
            if polls.is_multiple_of(64) {
                let state = {
                    let guard = self.slot.lock();
                    match guard.as_ref() {
                        // SAFETY: a live communicator, used under its lock.
                        Some(c) => unsafe { self.shared.nccl.async_error(c.0) },
                        None => Ok(NcclResult::SUCCESS),
                    }
                };
                match state {
                    Ok(NcclResult::SUCCESS) | Ok(NcclResult::IN_PROGRESS) => {}
                    Ok(r) => {
                        let msg = self.shared.nccl.error_string(r);
                        return Err(self.fail(format!("{what}: {} ({msg})", r.name())));
                    }
                    Err(e) => return Err(self.fail(format!("{what}: {e}"))),
                }
            }
            let waited = started.elapsed();
            if waited >= self.shared.timeout {
                let mine = self.shared.progress[self.rank].load(Ordering::Acquire);
                let behind: Vec<usize> = (0..self.size)
                    .filter(|&r| self.shared.progress[r].load(Ordering::Acquire) < mine)
                    .collect();
                let culprit = behind.first().copied().unwrap_or(self.rank);
                let reason = format!(
                    "rank {} waited {waited:?} for {what} #{mine} to finish on its GPU; rank(s) \
                     {behind:?} had not enqueued it",
                    self.rank
                );
                self.shared.fail(culprit, &reason);
                return Err(Error::Timeout {
                    rank: culprit,
                    reason,
                });
            }
            if waited < Duration::from_millis(5) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// Enqueues one group of NCCL calls on this rank's side stream, after the previous
    /// collective has finished (the host waits for it) and after the work queued so far on the
    /// ops' stream (the side stream waits for it). Returns the marker after the calls, for the
    /// ops' stream to wait on ([`Backend::main_waits`]) before reading what arrived; `wait`
    /// also waits for it on the host.
    fn launch<F>(&self, what: &'static str, wait: bool, calls: F) -> Result<Marker, Error>
    where
        F: FnOnce(&Nccl, Comm, rccl_sys::Stream) -> Result<(), rccl_sys::Error>,
    {
        self.check_failed()?;
        self.wait_pending(what)?;
        let dev = &self.slot.dev;
        dev.bind_to_thread()?;
        dev.side_waits_main()?;
        let stream = dev.side_cu_stream()?;
        let start = dev.side_timed_marker()?;
        let nccl = &self.shared.nccl;
        let enqueue = || -> Result<Result<(), rccl_sys::Error>, Error> {
            let guard = self.slot.lock();
            let Some(c) = guard.as_ref() else {
                return Err(self.shared.failure().map(aborted).unwrap_or_else(|| {
                    Error::GroupBroken(format!("rank {}'s communicator is gone", self.rank))
                }));
            };
            // SAFETY: group start takes no arguments.
            let started = unsafe { (nccl.group_start)() };
            Ok(match nccl.check("ncclGroupStart", started) {
                Err(e) => Err(e),
                Ok(()) => {
                    let r = calls(nccl, c.0, stream);
                    // SAFETY: ends the group started above (also after a failed call, so the
                    // library's group state is left clean).
                    let ended = unsafe { (nccl.group_end)() };
                    r.and_then(|()| nccl.check("ncclGroupEnd", ended))
                }
            })
        };
        if let Err(e) = enqueue()? {
            return Err(self.fail(format!("{what}: {e}")));
        }
        self.shared.progress[self.rank].fetch_add(1, Ordering::AcqRel);
        let marker = dev.side_timed_marker()?;
        let done = dev.side_timed_marker()?;
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some((start, marker));
        if dev.profiling() {
            // The profile's brackets are on the ops' stream: it waits here, inside one, so
            // the collective shows as such (a profiled chunk does not overlap its exchanges).
            dev.timed("collective", || dev.main_waits(&done))?;
        }
        if wait {
            self.wait_pending(what)?;
        }
        Ok(done)
    }
}

/// An all-to-all enqueued on the side stream: what arrives, and what is sent, kept until the
/// ops' stream has waited for it (on [`finish`](Exchange::finish), or when dropped).
struct NcclExchange {
    dev: Arc<Backend>,
    done: Option<Marker>,
    recv: Vec<Tensor>,
    _send: Vec<Tensor>,
}

impl Exchange for NcclExchange {
    fn finish(mut self: Box<Self>) -> Result<Vec<Tensor>, Error> {
        if let Some(done) = self.done.take() {
            self.dev.main_waits(&done)?;
        }
        Ok(std::mem::take(&mut self.recv))
    }
}

impl Drop for NcclExchange {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            // Unfinished (an error on the way): the buffers still wait for the exchange. If
            // even this fails the device is gone, and its memory with it.
            let _ = self.dev.main_waits(&done);
        }
    }
}

/// A rank as NCCL's C `int` peer index.
fn peer(r: usize) -> Result<c_int, rccl_sys::Error> {
    c_int::try_from(r).map_err(|_| rccl_sys::Error::Call {
        call: "peer",
        code: NcclResult::INVALID_ARGUMENT.0,
        name: NcclResult::INVALID_ARGUMENT.name(),
        message: format!("rank {r} out of range"),
    })
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    /// Grouped `ncclSend`/`ncclRecv`. The part received from rank `i` has the shape and dtype
    /// of the part this rank sends to `i` (true of Ulysses' exchanges, which are symmetric).
    fn all_to_all(&self, send: Vec<Tensor>) -> Result<Vec<Tensor>, Error> {
        self.all_to_all_start(send)?.finish()
    }

    /// [`all_to_all`](Self::all_to_all) on the side stream, which the ops' stream waits for
    /// only when the exchange is finished.
    fn all_to_all_start(&self, send: Vec<Tensor>) -> Result<Box<dyn Exchange>, Error> {
        let n = self.size;
        if send.len() != n {
            return Err(Error::Invalid(format!(
                "all_to_all: {} parts for {n} ranks",
                send.len()
            )));
        }
        let mut out: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
        let mut recv_bufs = Vec::new();
        // (peer, send address, receive address, elements, type)
        let mut plan = Vec::new();
        let mut bytes = 0;
        for (j, part) in send.iter().enumerate() {
            if j == self.rank || part.elem_count() == 0 {
                // Our own part stays; an empty one has nothing to move.
                out[j] = Some(part.clone());
                continue;
            }
            let dt = nccl_dtype(part)?;
            let sptr = self.storage(part)?.device_ptr()?;
            let (buf, rptr) = self.alloc(part.dtype(), part.shape())?;
            plan.push((j, sptr, rptr, part.elem_count(), dt));
            recv_bufs.push((j, buf, part.shape().to_vec()));
            bytes += tensor_bytes(part);
        }
        let done = self.launch("all_to_all", false, |nccl, comm, stream| {
            for &(j, sptr, rptr, count, dt) in &plan {
                let p = peer(j)?;
                // SAFETY: `sptr` addresses `count` elements of `dt` of a tensor alive until
                // after this call (later frees are ordered on the same stream); `comm` is live.
                let r = unsafe { (nccl.send)(sptr as *const _, count, dt, p, comm, stream) };
                nccl.check("ncclSend", r)?;
                // SAFETY: `rptr` addresses a fresh buffer of `count` elements of `dt`.
                let r = unsafe { (nccl.recv)(rptr as *mut _, count, dt, p, comm, stream) };
                nccl.check("ncclRecv", r)?;
            }
            Ok(())
        })?;
        // Held until the ops' stream has waited for the exchange: freed earlier, their memory
        // could be handed to an op while the links still read it.
        let mut exchange = NcclExchange {
            dev: self.slot.dev.clone(),
            done: Some(done),
            recv: Vec::new(),
            _send: send,
        };
        for (j, buf, shape) in recv_bufs {
            out[j] = Some(buf.into_tensor(&shape)?);
        }
        self.stats.add(Kind::AllToAll, bytes);
        exchange.recv = out
            .into_iter()
            .enumerate()
            .map(|(j, t)| t.ok_or_else(|| Error::Invalid(format!("all_to_all lost part {j}"))))
            .collect::<Result<_, Error>>()?;
        Ok(Box::new(exchange))
    }

    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>, Error> {
        let n = self.size;
        if t.elem_count() == 0 {
            return Ok((0..n).map(|_| t.clone()).collect());
        }
        let whole = self.gather_into(t, &[n, t.elem_count()])?;
        (0..n)
            .map(|i| {
                if i == self.rank {
                    return Ok(t.clone());
                }
                Ok(whole.narrow(0, i, 1)?.reshape(t.shape())?)
            })
            .collect()
    }

    /// The all-gather's buffer is already the rank-ordered concatenation: no copy.
    fn all_gather_cat(&self, t: &Tensor) -> Result<Tensor, Error> {
        if t.rank() == 0 || t.elem_count() == 0 {
            let parts = self.all_gather(t)?;
            return Ok(Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?);
        }
        let mut shape = t.shape().to_vec();
        shape[0] *= self.size;
        self.gather_into(t, &shape)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, Error> {
        let n = self.size;
        if root >= n {
            return Err(Error::Invalid(format!("broadcast from rank {root} of {n}")));
        }
        let count = t.elem_count();
        if count == 0 {
            return Ok(t.clone());
        }
        let dt = nccl_dtype(t)?;
        let root_c = peer(root).map_err(|e| Error::Invalid(e.to_string()))?;
        // In place: the root sends from (and "receives" into) its own tensor, which NCCL
        // leaves as it is; the others receive into a fresh buffer.
        let (out, ptr) = if self.rank == root {
            (None, self.storage(t)?.device_ptr()?)
        } else {
            self.storage(t)?;
            let (buf, ptr) = self.alloc(t.dtype(), t.shape())?;
            (Some(buf), ptr)
        };
        let done = self.launch("broadcast", true, |nccl, comm, stream| {
            // SAFETY: `ptr` addresses `count` elements of `dt` on this rank's device (in place:
            // send and receive buffers are the same); `comm` is live.
            let r = unsafe {
                (nccl.broadcast)(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    dt,
                    root_c,
                    comm,
                    stream,
                )
            };
            nccl.check("ncclBroadcast", r)
        })?;
        self.slot.dev.main_waits(&done)?;
        match out {
            None => {
                self.stats
                    .add(Kind::Broadcast, tensor_bytes(t) * (n as u64 - 1));
                Ok(t.clone())
            }
            Some(buf) => Ok(buf.into_tensor(t.shape())?),
        }
    }

    /// An all-reduce of one element, waited for.
    fn barrier(&self) -> Result<(), Error> {
        let (buf, ptr) = self.alloc(DType::F32, &[1])?;
        let done = self.launch("barrier", true, |nccl, comm, stream| {
            // SAFETY: `ptr` addresses one f32 on this rank's device, reduced in place.
            let r = unsafe {
                (nccl.all_reduce)(
                    ptr as *const _,
                    ptr as *mut _,
                    1,
                    DataType::FLOAT32,
                    RedOp::SUM,
                    comm,
                    stream,
                )
            };
            nccl.check("ncclAllReduce", r)
        })?;
        self.slot.dev.main_waits(&done)?;
        drop(buf);
        self.stats.add(Kind::Barrier, 0);
        Ok(())
    }

    fn abort(&self, reason: &str) {
        self.shared.fail(self.rank, reason);
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.fail(self.rank, "the rank's thread panicked");
            return;
        }
        if self.shared.failure().is_none() && self.wait_pending("shutdown").is_ok() {
            let taken = self.slot.lock().take();
            if let Some(c) = taken {
                let _ = self.slot.dev.bind_to_thread();
                // SAFETY: a live communicator with no work left in flight, never used again.
                let _ = unsafe { (self.shared.nccl.comm_destroy)(c.0) };
            }
        } else {
            self.slot.abort(&self.shared.nccl);
        }
    }
}
