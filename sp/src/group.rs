//! A rank group: one thread per card, each owning its rank's worker (model replica, head-sharded
//! caches) and communicator. A job goes to every rank, all ranks run it in lockstep, and rank 0's
//! result is the group's. A rank that fails aborts the communicator, so the others leave their
//! collectives at once, and the group reports the rank that failed first.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::comm::Communicator;
use crate::Error;

/// Errors of a rank's worker, whatever crate they come from.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A rank's side of the group: runs one job, returning the group's result on rank 0.
pub trait RankWorker<J>: 'static {
    type Output: Send + 'static;
    fn run(&mut self, job: J) -> Result<Option<Self::Output>, BoxError>;
}

type Report<R> = (usize, Result<Option<R>, Error>);

/// One thread per rank, in lockstep.
#[derive(Debug)]
pub struct RankGroup<J, R> {
    jobs: Vec<mpsc::Sender<J>>,
    reports: mpsc::Receiver<Report<R>>,
    comms: Vec<Arc<dyn Communicator>>,
    threads: Vec<JoinHandle<()>>,
    /// How long the other ranks may take to report once one has failed.
    grace: Duration,
    /// Set once a job failed: the communicator is aborted and the group cannot run again.
    broken: Option<String>,
}

fn describe_panic(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

impl<J: Clone + Send + 'static, R: Send + 'static> RankGroup<J, R> {
    /// Starts one thread per communicator (rank order); `make(rank, comm)` builds that rank's
    /// worker on its own thread. Fails if any rank fails to start, naming it.
    pub fn spawn<W, F>(
        comms: Vec<Arc<dyn Communicator>>,
        grace: Duration,
        make: F,
    ) -> Result<Self, Error>
    where
        W: RankWorker<J, Output = R>,
        F: Fn(usize, Arc<dyn Communicator>) -> Result<W, BoxError> + Send + Sync + 'static,
    {
        let make = Arc::new(make);
        let (report_tx, reports) = mpsc::channel::<Report<R>>();
        let mut jobs = Vec::new();
        let mut threads = Vec::new();
        for (rank, comm) in comms.iter().enumerate() {
            if comm.rank() != rank {
                return Err(Error::Invalid(format!(
                    "communicator {rank} is rank {}",
                    comm.rank()
                )));
            }
            let (job_tx, job_rx) = mpsc::channel::<J>();
            jobs.push(job_tx);
            let (comm, make, report) = (comm.clone(), make.clone(), report_tx.clone());
            let thread = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || rank_main(rank, comm, job_rx, report, move |r, c| make(r, c)))
                .map_err(|e| Error::Invalid(format!("starting rank {rank}: {e}")))?;
            threads.push(thread);
        }
        let mut group = RankGroup {
            jobs,
            reports,
            comms,
            threads,
            grace,
            broken: None,
        };
        // Each rank reports once after building its worker, so a rank that cannot start fails
        // the group here rather than at the first job.
        group.collect()?;
        Ok(group)
    }

    pub fn world_size(&self) -> usize {
        self.comms.len()
    }

    /// Each rank's communicator (for its byte counts).
    pub fn communicators(&self) -> &[Arc<dyn Communicator>] {
        &self.comms
    }

    /// Runs `job` on every rank and returns rank 0's result.
    pub fn run(&mut self, job: J) -> Result<R, Error> {
        if let Some(why) = &self.broken {
            return Err(Error::GroupBroken(why.clone()));
        }
        for (rank, tx) in self.jobs.iter().enumerate() {
            if tx.send(job.clone()).is_err() {
                let reason = format!("rank {rank}'s thread is gone");
                self.comms[rank].abort(&reason);
                self.broken = Some(reason.clone());
                return Err(Error::RankFailed { rank, reason });
            }
        }
        self.collect()?
            .ok_or_else(|| Error::Invalid("rank 0 returned no result".into()))
    }

    /// Waits for one report per rank. On the first failure, waits at most `grace` for the
    /// others (they leave their collectives once the communicator is aborted).
    fn collect(&mut self) -> Result<Option<R>, Error> {
        let n = self.comms.len();
        let mut seen = vec![false; n];
        let mut first_error: Option<Error> = None;
        let mut out = None;
        while seen.iter().any(|s| !s) {
            let report = if first_error.is_some() {
                match self.reports.recv_timeout(self.grace) {
                    Ok(r) => r,
                    Err(_) => break,
                }
            } else {
                match self.reports.recv() {
                    Ok(r) => r,
                    Err(_) => {
                        first_error = Some(Error::GroupBroken("every rank thread is gone".into()));
                        break;
                    }
                }
            };
            let (rank, result) = report;
            seen[rank] = true;
            match result {
                Ok(r) if rank == 0 => out = r,
                Ok(_) => {}
                Err(e) => {
                    // An aborted collective is a consequence; the rank that failed is the cause.
                    let cause = matches!(e, Error::RankFailed { .. });
                    match &first_error {
                        Some(Error::RankFailed { .. }) => {}
                        Some(_) if !cause => {}
                        _ => first_error = Some(e),
                    }
                }
            }
        }
        let Some(e) = first_error else {
            return Ok(out);
        };
        let silent: Vec<usize> = (0..n).filter(|&r| !seen[r]).collect();
        let e = match e {
            Error::Aborted { rank, reason } => Error::RankFailed { rank, reason },
            e => e,
        };
        let mut why = e.to_string();
        if !silent.is_empty() {
            why.push_str(&format!(
                " (rank(s) {silent:?} did not stop within {:?})",
                self.grace
            ));
        }
        self.broken = Some(why);
        Err(e)
    }
}

/// The aborted or timed-out collective behind a worker error, if that is what it is: then
/// another rank is the cause and this one only reports it.
fn consequence(e: &(dyn std::error::Error + 'static)) -> Option<Error> {
    let mut cur = Some(e);
    while let Some(e) = cur {
        match e.downcast_ref::<Error>() {
            Some(Error::Aborted { rank, reason }) => {
                return Some(Error::Aborted {
                    rank: *rank,
                    reason: reason.clone(),
                })
            }
            Some(Error::Timeout { rank, reason }) => {
                return Some(Error::Timeout {
                    rank: *rank,
                    reason: reason.clone(),
                })
            }
            _ => cur = e.source(),
        }
    }
    None
}

fn rank_main<J, W: RankWorker<J>>(
    rank: usize,
    comm: Arc<dyn Communicator>,
    jobs: mpsc::Receiver<J>,
    report: mpsc::Sender<Report<W::Output>>,
    make: impl FnOnce(usize, Arc<dyn Communicator>) -> Result<W, BoxError>,
) {
    let fail = |reason: String| {
        comm.abort(&reason);
        Err(Error::RankFailed { rank, reason })
    };
    let built = catch_unwind(AssertUnwindSafe(|| make(rank, comm.clone())));
    let mut worker = match built {
        Ok(Ok(w)) => {
            let _ = report.send((rank, Ok(None)));
            w
        }
        Ok(Err(e)) => {
            let _ = report.send((rank, fail(format!("starting: {}", error_chain(e.as_ref())))));
            return;
        }
        Err(p) => {
            let _ = report.send((
                rank,
                fail(format!("panicked starting: {}", describe_panic(p.as_ref()))),
            ));
            return;
        }
    };
    while let Ok(job) = jobs.recv() {
        let result = match catch_unwind(AssertUnwindSafe(|| worker.run(job))) {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => match consequence(e.as_ref()) {
                Some(e) => Err(e),
                None => fail(error_chain(e.as_ref())),
            },
            Err(p) => fail(format!("panicked: {}", describe_panic(p.as_ref()))),
        };
        let stop = result.is_err();
        if report.send((rank, result)).is_err() || stop {
            return;
        }
    }
}

impl<J, R> Drop for RankGroup<J, R> {
    fn drop(&mut self) {
        // Closing the job channels ends the rank loops; a group that failed may hold a rank
        // stuck outside any collective, so only a healthy group is joined.
        self.jobs.clear();
        if self.broken.is_none() {
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}
