//! The NCCL communicator (CUDA) and the RCCL one (ROCm, the same source). Where the library or two
//! devices are missing (CI), only the error paths run and the GPU checks print why they were
//! skipped; on a machine with both, the exchanges are checked value by value and a dead or
//! aborting peer must fail the group within its timeout.

use std::time::{Duration, Instant};

use kernels::{DType, Device, Tensor};
use sp::{Communicator, Error, NcclComm};

type Group = Result<Vec<Box<dyn Communicator>>, Error>;

/// One vendor's communicator, as the two-GPU checks use it.
struct Vendor {
    /// The library, loaded (for the log), or why it is not there.
    library: fn() -> Result<String, Error>,
    device: fn(usize) -> Device,
    group: fn(&[usize], Duration) -> Group,
}

fn boxed<C: Communicator + 'static>(v: Vec<C>) -> Vec<Box<dyn Communicator>> {
    v.into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect()
}

const NCCL: Vendor = Vendor {
    library: nccl_loaded,
    device: Device::Cuda,
    group: nccl_group,
};

const RCCL: Vendor = Vendor {
    library: rccl_loaded,
    device: Device::Rocm,
    group: rccl_group,
};

fn nccl_loaded() -> Result<String, Error> {
    sp::nccl_library().map(|l| format!("{l:?}"))
}

fn rccl_loaded() -> Result<String, Error> {
    sp::rccl_library().map(|l| format!("{l:?}"))
}

fn nccl_group(gpus: &[usize], timeout: Duration) -> Group {
    NcclComm::group(gpus, timeout).map(boxed)
}

fn rccl_group(gpus: &[usize], timeout: Duration) -> Group {
    sp::RcclComm::group(gpus, timeout).map(boxed)
}

/// Why the two-GPU checks cannot run here, if they cannot.
fn two_gpus(v: &Vendor) -> Option<String> {
    if let Err(e) = (v.library)() {
        return Some(e.to_string());
    }
    for g in 0..2 {
        let dev = (v.device)(g);
        if let Err(e) = dev.ensure_available() {
            return Some(format!("{dev}: {e}"));
        }
    }
    None
}

#[test]
fn a_missing_library_is_an_error_naming_it() {
    match sp::nccl_library() {
        Ok(n) => println!("loaded {n:?}"),
        Err(e) => {
            let msg = e.to_string();
            println!("{msg}");
            assert!(msg.contains("libnccl.so.2"), "{msg}");
            // The group fails the same way, without panicking.
            let err = NcclComm::group(&[0, 1], Duration::from_secs(5)).expect_err("no NCCL");
            assert!(err.to_string().contains("libnccl"), "{err}");
        }
    }
}

#[test]
fn the_rccl_side_refuses_the_same_way() {
    // The ROCm instantiation of the same source: RCCL by its own name, ROCm devices.
    match sp::rccl_library() {
        Ok(n) => println!("loaded {n:?}"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("librccl.so.1"), "{msg}");
            let err = sp::RcclComm::group(&[0, 1], Duration::from_secs(5)).expect_err("no RCCL");
            assert!(err.to_string().contains("librccl"), "{err}");
        }
    }
    assert!(matches!(
        sp::RcclComm::group(&[], Duration::from_secs(1)),
        Err(Error::NoCards)
    ));
    let err = sp::RcclComm::group(&[2, 2], Duration::from_secs(1)).expect_err("duplicate");
    assert!(err.to_string().contains("GPU 2 is listed twice"), "{err}");
}

#[test]
fn bad_gpu_lists_are_refused_first() {
    assert!(matches!(
        NcclComm::group(&[], Duration::from_secs(1)),
        Err(Error::NoCards)
    ));
    let err = NcclComm::group(&[1, 1], Duration::from_secs(1)).expect_err("duplicate");
    assert!(err.to_string().contains("GPU 1 is listed twice"), "{err}");
}

fn values(rank: usize, j: usize, n: usize) -> Vec<f32> {
    // Small integers: exact in bf16.
    (0..n)
        .map(|i| (rank * 64 + j * 16 + i % 16) as f32)
        .collect()
}

#[test]
fn two_gpus_exchange_exactly() {
    exchange_exactly(&NCCL);
}

#[test]
fn two_rocm_gpus_exchange_exactly() {
    exchange_exactly(&RCCL);
}

fn exchange_exactly(v: &Vendor) {
    if let Some(why) = two_gpus(v) {
        println!("skipping the two-GPU exchange: {why}");
        return;
    }
    let comms = (v.group)(&[0, 1], Duration::from_secs(60)).expect("group");
    println!("{}", (v.library)().unwrap_or_default());
    let device = v.device;
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let (r, dev) = (c.rank(), device(c.rank()));
                for dtype in [DType::F32, DType::BF16] {
                    let part = |j: usize| {
                        Tensor::from_f32(values(r, j, 6 * 5), &[6, 5], dtype)
                            .and_then(|t| t.to_device(dev))
                            .expect("part")
                    };
                    let before = c.stats();
                    let got = c.all_to_all(vec![part(0), part(1)]).expect("all_to_all");
                    for (i, t) in got.iter().enumerate() {
                        assert_eq!(t.shape(), &[6, 5]);
                        assert_eq!(t.device(), dev);
                        assert_eq!(t.to_vec_f32(), values(i, r, 30), "part from rank {i}");
                    }
                    let bytes = (c.stats() - before).all_to_all_bytes;
                    assert_eq!(bytes, 30 * dtype.size_in_bytes() as u64);

                    let mine = part(9);
                    let all = c.all_gather(&mine).expect("all_gather");
                    for (i, t) in all.iter().enumerate() {
                        assert_eq!(t.to_vec_f32(), values(i, 9, 30), "gathered from rank {i}");
                    }
                    let b = c.broadcast(&part(3), 1).expect("broadcast");
                    assert_eq!(b.to_vec_f32(), values(1, 3, 30));
                    c.barrier().expect("barrier");
                }
            });
        }
    });
    println!("rank 0 sent {:?}", comms[0].stats());
}

#[test]
fn a_dead_peer_fails_the_group_within_the_timeout() {
    dead_peer(&NCCL);
}

#[test]
fn a_dead_rocm_peer_fails_the_group_within_the_timeout() {
    dead_peer(&RCCL);
}

fn dead_peer(v: &Vendor) {
    if let Some(why) = two_gpus(v) {
        println!("skipping the dead-peer check: {why}");
        return;
    }
    let timeout = Duration::from_secs(3);
    let comms = (v.group)(&[0, 1], timeout).expect("group");
    let dev0 = (v.device)(0);
    let started = Instant::now();
    std::thread::scope(|s| {
        let (c0, c1) = (&comms[0], &comms[1]);
        let waiter = s.spawn(move || {
            let t = Tensor::zeros(&[1024], DType::F32)
                .and_then(|t| t.to_device(dev0))
                .expect("t");
            // Rank 1 never joins: the exchange hangs on the GPU, the barrier's wait must not.
            let _ = c0.all_to_all(vec![t.clone(), t]);
            c0.barrier()
        });
        let err = waiter.join().expect("rank 0 thread").expect_err("no peer");
        let took = started.elapsed();
        println!("rank 0 after {took:?}: {err}");
        assert!(took < timeout * 3, "{took:?}");
        assert!(matches!(err, Error::Timeout { rank: 1, .. }), "{err}");
        // Rank 1 now finds the group failed instead of hanging.
        let late = c1.barrier().expect_err("group failed");
        assert!(matches!(late, Error::Aborted { .. }), "{late}");
    });
}

#[test]
fn an_abort_reaches_the_waiting_rank() {
    abort_reaches(&NCCL);
}

#[test]
fn an_abort_reaches_the_waiting_rocm_rank() {
    abort_reaches(&RCCL);
}

fn abort_reaches(v: &Vendor) {
    if let Some(why) = two_gpus(v) {
        println!("skipping the abort check: {why}");
        return;
    }
    let comms = (v.group)(&[0, 1], Duration::from_secs(120)).expect("group");
    let started = Instant::now();
    std::thread::scope(|s| {
        let (c0, c1) = (&comms[0], &comms[1]);
        let waiter = s.spawn(move || c0.barrier());
        std::thread::sleep(Duration::from_millis(300));
        c1.abort("rank 1 gave up");
        let err = waiter.join().expect("rank 0 thread").expect_err("aborted");
        println!("rank 0 after {:?}: {err}", started.elapsed());
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(
            matches!(&err, Error::Aborted { rank: 1, reason } if reason.contains("gave up")),
            "{err}"
        );
    });
}
