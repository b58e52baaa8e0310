use std::sync::Arc;
use std::time::Duration;

use kernels::Tensor;

use super::*;

const LONG: Duration = Duration::from_secs(600);

fn comms(n: usize, timeout: Duration) -> Vec<Arc<dyn Communicator>> {
    LoopbackWorld::new(n, timeout)
        .expect("world")
        .communicators()
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect()
}

/// Runs `f(comm)` on one thread per rank and returns the results in rank order.
fn on_ranks<T: Send + 'static>(
    comms: &[Arc<dyn Communicator>],
    f: impl Fn(&dyn Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let threads: Vec<_> = comms
        .iter()
        .map(|c| {
            let (c, f) = (c.clone(), f.clone());
            std::thread::spawn(move || f(c.as_ref()))
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread"))
        .collect()
}

fn filled(v: f32, shape: &[usize]) -> Tensor {
    Tensor::from_vec(vec![v; shape.iter().product()], shape).expect("tensor")
}

#[test]
fn card_counts_follow_the_head_count() {
    assert_eq!(heads_per_card(40, 8).expect("40/8"), 5);
    assert_eq!(heads_per_card(12, 3).expect("12/3"), 4);
    let e = heads_per_card(40, 3).expect_err("40/3").to_string();
    assert!(e.contains("1, 2, 4, 5, 8, 10, 20, 40"), "{e}");
    assert!(heads_per_card(12, 0).is_err());
}

#[test]
fn loopback_collectives_deliver_and_count_bytes() {
    let n = 3;
    let cs = comms(n, LONG);
    let out = on_ranks(&cs, move |c| {
        let r = c.rank();
        // Part j carries 10·r + j, with 1 + j rows, so every pair is told apart.
        let send = (0..n)
            .map(|j| filled((10 * r + j) as f32, &[1 + j, 2]))
            .collect();
        let got: Vec<f32> = c
            .all_to_all(send)
            .expect("a2a")
            .iter()
            .map(|t| {
                assert_eq!(t.shape(), [1 + r, 2]);
                t.to_vec_f32()[0]
            })
            .collect();
        let gathered: Vec<f32> = c
            .all_gather(&filled(r as f32, &[2]))
            .expect("gather")
            .iter()
            .map(|t| t.to_vec_f32()[1])
            .collect();
        let b = c
            .broadcast(&filled(r as f32 + 0.5, &[4]), 1)
            .expect("bcast")
            .to_vec_f32();
        c.barrier().expect("barrier");
        (got, gathered, b, c.stats())
    });
    for (r, (got, gathered, b, stats)) in out.into_iter().enumerate() {
        let want: Vec<f32> = (0..n).map(|i| (10 * i + r) as f32).collect();
        assert_eq!(got, want, "rank {r} all_to_all");
        assert_eq!(gathered, vec![0.0, 1.0, 2.0]);
        assert_eq!(b, vec![1.5; 4]);
        // f32: parts to the other ranks (1 + j rows of 2), the gather to 2 ranks, the
        // broadcast from rank 1 only.
        let a2a: u64 = (0..n).filter(|&j| j != r).map(|j| (1 + j as u64) * 8).sum();
        assert_eq!(stats.all_to_all_bytes, a2a, "rank {r}");
        assert_eq!(stats.all_to_all_calls, 1);
        assert_eq!(stats.all_gather_bytes, 2 * 8);
        assert_eq!(stats.broadcast_bytes, if r == 1 { 2 * 16 } else { 0 });
    }
}

#[test]
fn an_abort_releases_every_waiting_rank() {
    let cs = comms(3, LONG);
    let out = on_ranks(&cs, |c| {
        if c.rank() == 2 {
            c.abort("injected");
            return None;
        }
        // Ranks 0 and 1 wait for rank 2, which never comes: the abort must wake them.
        Some(c.barrier().expect_err("aborted").to_string())
    });
    for e in out.into_iter().flatten() {
        assert!(e.contains("rank 2") && e.contains("injected"), "{e}");
    }
}

#[test]
fn a_missing_rank_times_out_with_its_name() {
    let cs = comms(2, Duration::from_millis(50));
    let e = cs[0].barrier().expect_err("rank 1 never joins").to_string();
    assert!(e.contains("rank 1"), "{e}");
    // The group stays failed for everyone.
    assert!(cs[1].barrier().is_err());
}

#[test]
fn mismatched_collectives_are_refused() {
    let cs = comms(2, LONG);
    let out = on_ranks(&cs, |c| {
        if c.rank() == 0 {
            c.barrier().map(|_| ())
        } else {
            c.all_gather(&filled(1.0, &[1])).map(|_| ())
        }
    });
    assert!(out.iter().all(|r| r.is_err()), "{out:?}");
}

#[test]
fn ulysses_exchange_round_trips_with_padding() {
    // 5 tokens over 4 ranks: shards of 2, the last rank all padding.
    let (tokens, heads, d, n) = (5, 4, 3, 4);
    let whole: Vec<f32> = (0..tokens * heads * d).map(|i| i as f32).collect();
    let whole = Tensor::from_vec(whole, &[tokens, heads, d]).expect("whole");
    let cs = comms(n, LONG);
    let w = whole.clone();
    let out = on_ranks(&cs, move |c| {
        let u = Ulysses::new(c, tokens).expect("ulysses");
        let mine = u.shard.take(&w).expect("shard");
        let doubled = kernels::ops::add(&mine, &mine).expect("add");
        let [q, k] = &u.scatter_heads(&[&mine, &doubled]).expect("scatter")[..] else {
            panic!("two tensors back");
        };
        let back = u.gather_heads(q).expect("gather");
        (u.shard, mine, q.clone(), k.clone(), back)
    });
    for (r, (shard, mine, q, k, back)) in out.into_iter().enumerate() {
        assert_eq!(shard.per_rank(), 2);
        let hn = heads / n;
        let want = whole.narrow(1, r * hn, hn).expect("heads");
        assert_eq!(
            q.to_vec_f32(),
            want.to_vec_f32(),
            "rank {r}: its heads, all tokens"
        );
        let twice: Vec<f32> = want.to_vec_f32().iter().map(|x| 2.0 * x).collect();
        assert_eq!(k.to_vec_f32(), twice);
        assert_eq!(back.to_vec_f32(), mine.to_vec_f32(), "rank {r}: round trip");
    }
}

#[derive(Debug)]
struct Echo {
    comm: Arc<dyn Communicator>,
    fail_on: Option<(usize, u32)>,
    jobs: u32,
}

impl RankWorker<u32> for Echo {
    type Output = Vec<f32>;
    fn run(&mut self, job: u32) -> Result<Option<Vec<f32>>, BoxError> {
        self.jobs += 1;
        let r = self.comm.rank();
        let parts = self
            .comm
            .all_gather(&filled((job as usize + r) as f32, &[1]))?;
        if self.fail_on == Some((r, self.jobs)) {
            if job == 99 {
                panic!("injected panic");
            }
            return Err("injected failure".into());
        }
        // Everyone meets once more: the failed rank never comes.
        self.comm.barrier()?;
        Ok((r == 0).then(|| parts.iter().map(|t| t.to_vec_f32()[0]).collect()))
    }
}

fn echo_group(n: usize, fail_on: Option<(usize, u32)>) -> RankGroup<u32, Vec<f32>> {
    RankGroup::spawn(comms(n, LONG), LONG, move |_, comm| {
        Ok(Echo {
            comm,
            fail_on,
            jobs: 0,
        })
    })
    .expect("group")
}

#[test]
fn rank_group_runs_jobs_in_lockstep() {
    let mut g = echo_group(3, None);
    assert_eq!(g.run(10).expect("job"), vec![10.0, 11.0, 12.0]);
    assert_eq!(g.run(20).expect("job"), vec![20.0, 21.0, 22.0]);
}

#[test]
fn a_failing_rank_fails_the_job_with_its_name() {
    let mut g = echo_group(4, Some((2, 2)));
    g.run(1).expect("first job");
    let e = g.run(2).expect_err("rank 2 fails").to_string();
    assert!(
        e.contains("rank 2 failed") && e.contains("injected failure"),
        "{e}"
    );
    let again = g.run(3).expect_err("broken").to_string();
    assert!(again.contains("restarted"), "{again}");
    // A new group starts clean.
    assert_eq!(
        echo_group(4, None).run(5).expect("new group"),
        vec![5.0, 6.0, 7.0, 8.0]
    );
}

#[test]
fn a_panicking_rank_fails_the_job_with_its_name() {
    let mut g = echo_group(2, Some((1, 1)));
    let e = g.run(99).expect_err("rank 1 panics").to_string();
    assert!(e.contains("rank 1") && e.contains("injected panic"), "{e}");
}
