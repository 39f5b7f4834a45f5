//! Fault behaviour: timeouts, exited ranks, mismatched calls and bad arguments are errors that
//! name the ranks involved, and never hangs.
#![allow(clippy::panic, clippy::expect_used)]

use kiln_comm::{
    spawn_with, CommError, CommExt, Communicator, OpKind, RankFailure, ReduceOp, ThreadComm,
    ThreadCommConfig,
};
use std::time::{Duration, Instant};

fn cfg(secs: f64) -> ThreadCommConfig {
    ThreadCommConfig::with_timeout(Duration::from_secs_f64(secs))
}

#[test]
fn a_late_rank_makes_the_others_time_out_naming_it() {
    let t0 = Instant::now();
    let res = spawn_with(cfg(1.5), 3, |comm| {
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(4000));
            return Ok(());
        }
        let mut v = [1.0f32];
        comm.all_reduce(&mut v, ReduceOp::Sum)
    });
    let err = res.expect_err("the collective must fail");
    match err.error() {
        Some(CommError::Timeout {
            op,
            rank,
            waited,
            missing,
        }) => {
            assert_eq!(*op, OpKind::AllReduce);
            assert!(*rank == 0 || *rank == 1);
            assert!(*waited >= Duration::from_millis(1500));
            // Rank 2 is always missing. On a loaded machine the other waiting rank's thread may
            // itself start later than the timeout; it is then truthfully reported missing too.
            let other = 1 - *rank;
            assert!(
                missing == &vec![2] || missing == &vec![other, 2],
                "{missing:?}"
            );
        }
        other => panic!("expected a timeout, got {other:?} ({err})"),
    }
    assert!(err.to_string().contains("2] never arrived"), "{err}");
    // the waiting ranks gave up at the timeout, not when rank 2 finally left
    assert!(t0.elapsed() < Duration::from_secs(60));
}

#[test]
fn a_rank_that_returns_early_is_noticed_before_the_timeout() {
    let t0 = Instant::now();
    let res = spawn_with(cfg(120.0), 4, |comm| {
        if comm.rank() == 3 {
            return Ok(());
        }
        comm.barrier()?;
        comm.barrier()
    });
    let err = res.expect_err("must fail");
    // rank 3 succeeded; the first failure is one of the waiting ranks, naming rank 3
    match err.error() {
        Some(CommError::RankGone { gone, op, .. }) => {
            assert_eq!(*gone, 3);
            assert_eq!(*op, OpKind::Barrier);
        }
        other => panic!("expected RankGone, got {other:?}"),
    }
    assert_eq!(err.also_failed.len(), 2);
    // noticed through liveness, long before the 120 s timeout
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_panicking_rank_is_reported_first_and_frees_the_others() {
    let res = spawn_with(cfg(120.0), 3, |comm| -> Result<(), CommError> {
        if comm.rank() == 1 {
            panic!("injected fault on rank 1");
        }
        let mut x = [0u32; 16];
        comm.all_reduce(&mut x, ReduceOp::Max)
    });
    let err = res.expect_err("must fail");
    assert_eq!(err.rank, 1);
    match &err.failure {
        RankFailure::Panicked(m) => assert!(m.contains("injected fault"), "{m}"),
        RankFailure::Error(e) => panic!("expected a panic, got {e}"),
    }
    let mut others = err.also_failed.clone();
    others.sort_unstable();
    assert_eq!(others, vec![0, 2]);
}

#[test]
fn sub_group_members_notice_an_exited_rank() {
    let res = spawn_with(cfg(120.0), 4, |comm| {
        let r = comm.rank();
        let tp = comm.split((r / 2) as u32, 0)?;
        if r == 1 {
            return Ok(());
        }
        let mut v = [1.0f64];
        tp.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok(())
    });
    let err = res.expect_err("rank 0 waits for rank 1 in its tp group");
    assert_eq!(err.rank, 0);
    match err.error() {
        Some(CommError::RankGone { gone, rank, .. }) => {
            assert_eq!(*gone, 1);
            assert_eq!(*rank, 0);
        }
        other => panic!("expected RankGone, got {other:?}"),
    }
}

fn mismatch_on_every_rank<F>(world: usize, f: F) -> Vec<CommError>
where
    F: Fn(&ThreadComm) -> Result<(), CommError> + Sync,
{
    // every rank must see the error and carry on: the communicator stays usable afterwards
    kiln_comm::spawn_with(cfg(30.0), world, |comm| {
        let err = f(&comm).expect_err("mismatch expected");
        let v = comm.all_reduce_scalar(1u32, ReduceOp::Sum)?;
        assert_eq!(v as usize, world);
        Ok::<_, CommError>(err)
    })
    .expect("ranks")
}

#[test]
fn different_collectives_are_a_mismatch_naming_both_ranks() {
    let errs = mismatch_on_every_rank(3, |comm| {
        let mut v = [0.0f32; 4];
        if comm.rank() == 2 {
            comm.broadcast(&mut v, 0)
        } else {
            comm.all_reduce(&mut v, ReduceOp::Sum)
        }
    });
    for (r, e) in errs.iter().enumerate() {
        match e {
            CommError::Mismatch {
                rank,
                first_rank,
                first,
                second_rank,
                second,
            } => {
                assert_eq!(*rank, r);
                assert_eq!((*first_rank, *second_rank), (0, 2));
                assert_eq!(first.op, OpKind::AllReduce);
                assert_eq!(second.op, OpKind::Broadcast);
            }
            other => panic!("rank {r}: expected mismatch, got {other:?}"),
        }
        let msg = e.to_string();
        assert!(
            msg.contains("rank 0 called all_reduce(seq 0, f32, len 4, sum)"),
            "{msg}"
        );
        assert!(
            msg.contains("rank 2 called broadcast(seq 0, f32, len 4, root 0)"),
            "{msg}"
        );
    }
}

#[test]
fn different_lengths_dtypes_and_ops_are_mismatches() {
    let errs = mismatch_on_every_rank(2, |comm| {
        let mut v = vec![0.0f32; 5 + comm.rank()];
        comm.all_reduce(&mut v, ReduceOp::Sum)
    });
    assert!(
        errs.iter().all(|e| e.to_string().contains("len 6")),
        "{errs:?}"
    );
    let errs = mismatch_on_every_rank(2, |comm| {
        if comm.rank() == 0 {
            comm.all_reduce(&mut [0.0f32; 3], ReduceOp::Sum)
        } else {
            comm.all_reduce(&mut [0.0f64; 3], ReduceOp::Sum)
        }
    });
    assert!(
        errs.iter().all(|e| e.to_string().contains("f64")),
        "{errs:?}"
    );
    let errs = mismatch_on_every_rank(2, |comm| {
        let op = if comm.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        comm.all_reduce(&mut [0.0f32; 3], op)
    });
    assert!(
        errs.iter().all(|e| e.to_string().contains("max")),
        "{errs:?}"
    );
    let errs = mismatch_on_every_rank(2, |comm| comm.broadcast(&mut [0u32; 3], comm.rank()));
    assert!(errs.iter().all(|e| matches!(e, CommError::Mismatch { .. })));
}

#[test]
fn wrong_chunk_lengths_name_the_rank_and_the_rule() {
    let errs = mismatch_on_every_rank(3, |comm| {
        let input = vec![1.0f32; 7];
        // rank 1 should hold 2 elements of 7 (chunks 3, 2, 2) but passes 3
        let n = if comm.rank() == 1 {
            3
        } else {
            comm.my_chunk(7).len()
        };
        let mut out = vec![0.0f32; n];
        comm.reduce_scatter(&input, &mut out, ReduceOp::Sum)
    });
    for e in &errs {
        match e {
            CommError::BadLength {
                op,
                rank,
                expected,
                got,
                what,
            } => {
                assert_eq!(*op, OpKind::ReduceScatter);
                assert_eq!((*rank, *expected, *got, *what), (1, 2, 3, "output"));
            }
            other => panic!("expected BadLength, got {other:?}"),
        }
    }
    let errs = mismatch_on_every_rank(2, |comm| {
        let mut out = vec![0.0f32; 4];
        comm.all_gather(&[1.0f32; 3], &mut out)
    });
    assert!(
        matches!(
            errs[0],
            CommError::BadLength {
                rank: 0,
                expected: 2,
                got: 3,
                ..
            }
        ),
        "{:?}",
        errs[0]
    );
}

#[test]
fn bad_root_and_bad_world_are_errors() {
    let errs = mismatch_on_every_rank(2, |comm| comm.broadcast(&mut [0.0f32; 2], 5));
    assert!(
        matches!(
            errs[1],
            CommError::BadRoot {
                root: 5,
                world: 2,
                ..
            }
        ),
        "{:?}",
        errs[1]
    );
    let e = ThreadComm::group(0, ThreadCommConfig::default()).expect_err("world 0");
    assert!(
        e.to_string().contains("world size must be at least 1"),
        "{e}"
    );
}

#[test]
fn dtype_mismatch_between_input_and_output_is_reported_to_all() {
    let errs = mismatch_on_every_rank(2, |comm| {
        let mut out = [0.0f64; 2];
        let input = [1.0f32; 2];
        comm.all_gather_buf((&input[..1]).into(), (&mut out[..]).into())
    });
    for e in errs {
        assert!(matches!(e, CommError::DtypeMismatch { .. }), "{e:?}");
    }
}

// ------------------------------------------------------------------ point-to-point

/// Runs `f` on 2 ranks with a `secs` timeout; every rank's result (errors as values).
fn p2p_pair<F>(secs: f64, f: F) -> Vec<Result<(), CommError>>
where
    F: Fn(&ThreadComm) -> Result<(), CommError> + Sync,
{
    spawn_with(cfg(secs), 2, |comm| Ok::<_, CommError>(f(&comm))).expect("ranks")
}

#[test]
fn a_mismatched_tag_names_both_ranks_and_both_messages() {
    let t0 = Instant::now();
    let out = p2p_pair(30.0, |comm| {
        if comm.rank() == 0 {
            comm.send(&[1.5f32; 64], 1, 8)?;
            comm.send(&[2.5f32; 3], 1, 9)
        } else {
            let mut v = [0.0f32; 64];
            let err = comm.recv(&mut v, 0, 7).expect_err("the tags differ");
            assert_eq!(
                err.to_string(),
                "rank 1 expected recv(tag 7, f32, len 64) from rank 0, rank 0 sent send(tag 8, \
                 f32, len 64)"
            );
            match err {
                CommError::Mismatch {
                    rank: 1,
                    first_rank: 1,
                    first,
                    second_rank: 0,
                    second,
                } => {
                    assert_eq!(
                        (first.op, first.tag, first.peer),
                        (OpKind::Recv, Some(7), Some(0))
                    );
                    assert_eq!(
                        (second.op, second.tag, second.peer),
                        (OpKind::Send, Some(8), Some(1))
                    );
                }
                other => panic!("expected a mismatch, got {other:?}"),
            }
            assert_eq!(v, [0.0; 64], "a mismatched message is never copied");
            // the mismatched message was consumed: the next one arrives intact
            let mut w = [0.0f32; 3];
            comm.recv(&mut w, 0, 9)?;
            assert_eq!(w, [2.5; 3]);
            Ok(())
        }
    });
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn a_wrong_length_or_dtype_is_a_mismatch() {
    let out = p2p_pair(30.0, |comm| {
        if comm.rank() == 0 {
            comm.send(&[1.0f32; 64], 1, 7)?;
            comm.send(&[1.0f32; 64], 1, 7)
        } else {
            let e = comm.recv(&mut [0.0f32; 63], 0, 7).expect_err("length");
            assert_eq!(
                e.to_string(),
                "rank 1 expected recv(tag 7, f32, len 63) from rank 0, rank 0 sent send(tag 7, \
                 f32, len 64)"
            );
            let e = comm
                .recv(&mut [half::bf16::ZERO; 64], 0, 7)
                .expect_err("dtype");
            assert_eq!(
                e.to_string(),
                "rank 1 expected recv(tag 7, bf16, len 64) from rank 0, rank 0 sent send(tag 7, \
                 f32, len 64)"
            );
            Ok(())
        }
    });
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

#[test]
fn a_receive_nobody_sends_times_out_naming_the_peer() {
    let t0 = Instant::now();
    let out = p2p_pair(0.5, |comm| {
        if comm.rank() == 0 {
            // stay alive past the peer's timeout, so that it is a timeout and not RankGone
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        let mut v = [0u32; 4];
        comm.recv(&mut v, 0, 1)
    });
    match &out[1] {
        Err(
            e @ CommError::Timeout {
                op: OpKind::Recv,
                rank: 1,
                waited,
                missing,
            },
        ) => {
            assert_eq!(missing, &vec![0]);
            assert!(*waited >= Duration::from_millis(500));
            assert!(e.to_string().ends_with("no message from rank 0"), "{e}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_peer_that_exits_is_rank_gone_after_its_messages_are_taken() {
    let t0 = Instant::now();
    let out = spawn_with(cfg(120.0), 3, |comm| {
        match comm.rank() {
            // sends one message, then exits (its handle drops) while rank 1 waits for another
            2 => comm.send(&[7i64; 5], 1, 0).map(|_| None),
            1 => {
                let mut v = [0i64; 5];
                comm.recv(&mut v, 2, 0)?;
                assert_eq!(v, [7; 5]);
                Ok(Some(comm.recv(&mut v, 2, 1)))
            }
            // rank 0 takes no part
            _ => Ok(None),
        }
    })
    .expect("ranks");
    match &out[1] {
        Some(Err(
            e @ CommError::RankGone {
                op: OpKind::Recv,
                rank: 1,
                gone: 2,
                ..
            },
        )) => assert!(e.to_string().contains("rank 2 has exited"), "{e}"),
        other => panic!("expected RankGone, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // a panicking peer too, and a send to an exited peer fails at once
    let res = spawn_with(cfg(120.0), 2, |comm| -> Result<(), CommError> {
        if comm.rank() == 0 {
            panic!("injected fault on rank 0");
        }
        let e = comm
            .recv(&mut [0.0f32; 2], 0, 0)
            .expect_err("rank 0 panicked");
        assert!(matches!(e, CommError::RankGone { gone: 0, .. }), "{e:?}");
        let e = comm.send(&[0.0f32; 2], 0, 0).expect_err("rank 0 is gone");
        assert!(
            matches!(
                e,
                CommError::RankGone {
                    op: OpKind::Send,
                    gone: 0,
                    ..
                }
            ),
            "{e:?}"
        );
        Ok(())
    });
    assert_eq!(
        res.expect_err("rank 0 panicked").also_failed,
        Vec::<usize>::new()
    );
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[test]
fn sends_to_self_or_outside_the_group_are_refused() {
    let out = spawn_with(cfg(30.0), 3, |comm| {
        let me = comm.rank();
        let a = comm.send(&[1.0f32], me, 0).expect_err("self");
        let b = comm.recv(&mut [1.0f32], 3, 0).expect_err("outside");
        let c = comm
            .p2p_batch(&mut [
                kiln_comm::P2pOp::send(&[1.0f32], (me + 1) % 3, 0),
                kiln_comm::P2pOp::send(&[1.0f32], 9, 0),
            ])
            .expect_err("one bad peer refuses the whole batch");
        Ok::<_, CommError>((a, b, c))
    })
    .expect("ranks");
    for (r, (a, b, c)) in out.iter().enumerate() {
        assert!(
            matches!(a, CommError::BadPeer { op: OpKind::Send, peer, world: 3, .. } if *peer == r)
        );
        assert_eq!(
            a.to_string(),
            format!(
                "send on rank {r}: peer {r} is this rank itself (a group of 3); a rank cannot \
                 send to or receive from itself"
            )
        );
        assert_eq!(
            b.to_string(),
            format!("recv on rank {r}: peer 3 is not a rank of a group of 3 (ranks 0..3)")
        );
        assert!(matches!(c, CommError::BadPeer { peer: 9, .. }), "{c:?}");
    }
}
