//! The hang watchdog on a thread group where one rank stalls.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_comm::{CommExt, Communicator, OpKind, ReduceOp, ThreadComm, ThreadCommConfig};
use kiln_monitor::{MonitorError, Watchdog};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

#[test]
fn a_stalled_rank_is_reported_with_every_ranks_last_collective() {
    let world = 3;
    let comms: Vec<Arc<ThreadComm>> = ThreadComm::group(
        world,
        ThreadCommConfig::with_timeout(Duration::from_secs(120)),
    )
    .unwrap()
    .into_iter()
    .map(Arc::new)
    .collect();
    let seen = Arc::new(Mutex::new(Vec::new()));
    // started once the stall is in place, so what it reports does not depend on timing
    let dog: OnceLock<Watchdog> = OnceLock::new();

    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = Mutex::new(release_rx);
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (rank, comm) in comms.iter().enumerate() {
            let dog = &dog;
            let release_rx = &release_rx;
            handles.push(s.spawn(move || {
                for step in 0..3u64 {
                    if rank == 2 && step == 2 {
                        // rank 2 stalls before its third collective until released
                        release_rx.lock().unwrap().recv().unwrap();
                    }
                    let mut v = [rank as f32 + step as f32];
                    comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    assert_eq!(v[0], 3.0 + 3.0 * step as f32);
                    if let (0, Some(dog)) = (rank, dog.get()) {
                        dog.heartbeat(step);
                    }
                }
            }));
        }
        // wait (bounded) until ranks 0 and 1 are inside the third all-reduce, rank 2 stalled
        let seq = |r: usize| comms[r].last_collective().map(|d| d.seq);
        for _ in 0..6000 {
            if (seq(0), seq(1), seq(2)) == (Some(2), Some(2), Some(1)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let seen_cb = seen.clone();
        let started = Watchdog::start_with(
            Duration::from_millis(200),
            comms
                .iter()
                .map(|c| c.clone() as Arc<dyn Communicator>)
                .collect(),
            move |r| seen_cb.lock().unwrap().push(r.clone()),
        )
        .unwrap();
        // the loop's heartbeat for step 1 (rank 0 completed it before the watchdog existed)
        started.heartbeat(1);
        assert!(dog.set(started).is_ok());
        let dog = dog.get().unwrap();
        // wait (bounded) for the watchdog to fire while rank 2 is stalled
        let mut report = None;
        for _ in 0..3000 {
            if let Some(r) = dog.report() {
                report = Some(r);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let report = report.expect("the watchdog never fired");
        let err = dog.check().unwrap_err();
        assert!(matches!(err, MonitorError::Hang(_)));
        release_tx.send(()).unwrap();
        for h in handles {
            h.join().unwrap();
        }

        // ranks 0 and 1 entered the third all-reduce (seq 2); rank 2 is still after seq 1
        assert_eq!(report.last_step, Some(1));
        assert!(report.waited >= Duration::from_millis(200));
        let last: Vec<(usize, u64, OpKind)> = report
            .ranks
            .iter()
            .map(|r| {
                let d = r.last.unwrap();
                (r.rank, d.seq, d.op)
            })
            .collect();
        assert_eq!(
            last,
            [
                (0, 2, OpKind::AllReduce),
                (1, 2, OpKind::AllReduce),
                (2, 1, OpKind::AllReduce)
            ]
        );
        assert_eq!(report.laggards(), [2]);
        let text = report.to_string();
        assert!(text.starts_with("hang: no step completed in"), "{text}");
        assert!(
            text.contains("rank 2/3 (thread): last collective all_reduce(seq 1, f32, len 1, sum)"),
            "{text}"
        );
        assert!(text.ends_with("ranks [2] are behind the others"), "{text}");
    });
    // the callback got the same report
    let dog = dog.into_inner().unwrap();
    assert_eq!(seen.lock().unwrap()[0], dog.report().unwrap());
    dog.stop();
}

#[test]
fn steady_heartbeats_keep_it_quiet() {
    let dog = Watchdog::start(Duration::from_secs(120), Vec::new()).unwrap();
    for s in 0..1000 {
        dog.heartbeat(s);
    }
    assert!(dog.check().is_ok());
    assert!(dog.report().is_none());
    assert!(Watchdog::start(Duration::ZERO, Vec::new()).is_err());
}
