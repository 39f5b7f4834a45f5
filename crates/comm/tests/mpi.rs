//! The MPI backend under real `mpirun`: the collective and point-to-point suite of the thread
//! backend (bitwise against the same sequential references) on 1, 2, 3 and 4 processes, and the
//! fault paths (a rank that exits or is SIGKILLed mid-collective or while a peer waits for its
//! message, a rank that stalls past the timeout, mismatched calls and messages, a receive
//! nobody sends).
//!
//! Run with `cargo test -p kiln-comm --features mpi --release --test mpi`. Without
//! `KILN_MPI_TEST` set this binary is the driver: it launches itself under `mpirun` once per
//! scenario and checks what every rank printed. Where `mpirun` is missing it says so and
//! passes, except under `CI=true`, where that is a failure.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::suite::{self, RankFn, Ranks};
use kiln_comm::{CommError, CommExt, Communicator, Mpi, MpiComm, MpiCommConfig, OpKind, ReduceOp};
use kiln_testkit::{mpirun_path, mpirun_self, ProcessRun};
use std::time::{Duration, Instant};

fn main() {
    match std::env::var("KILN_MPI_TEST") {
        Ok(role) => worker(&role),
        Err(_) => driver(),
    }
}

// ---------------------------------------------------------------- driver (no mpirun around)

fn launch(np: usize, role: &str, deadline: Duration) -> ProcessRun {
    launch_env(np, role, deadline, &[])
}

fn launch_env(np: usize, role: &str, deadline: Duration, vars: &[(&str, &str)]) -> ProcessRun {
    let mpirun_bin = mpirun_path().expect("checked by the driver");
    mpirun_self(&mpirun_bin, np, role, vars, deadline)
}

/// Lines `rank R: <what>` printed by the ranks.
fn said(run: &ProcessRun, what: &str) -> Vec<usize> {
    run.ranks_saying(what)
}

fn driver() {
    println!("kiln-comm MPI tests");
    if mpirun_path().is_none() {
        return;
    }
    let suite = |np: usize, vars: &[(&str, &str)]| {
        let run = launch_env(np, "suite", Duration::from_secs(600), vars);
        assert!(
            run.success(),
            "suite on {np} processes {vars:?}: {}",
            run.output()
        );
        assert_eq!(
            said(&run, "suite ok"),
            (0..np).collect::<Vec<_>>(),
            "{}",
            run.output()
        );
    };
    for np in 1..=4 {
        suite(np, &[]);
    }
    // rounds of 4 KiB: many rounds, uneven sub-chunks
    for np in [2, 3] {
        suite(np, &[("KILN_TEST_STAGE_BYTES", "4096")]);
    }

    let run = launch(3, "mismatch", Duration::from_secs(120));
    assert!(run.success(), "mismatch scenario: {}", run.output());
    assert_eq!(said(&run, "mismatch ok"), vec![0, 1, 2], "{}", run.output());

    // A rank that exits, or is SIGKILLed, mid-collective: the others fail with RankGone
    // naming it, long before their 60 s timeout, and mpirun ends the job with a failure status.
    for role in ["exit", "kill"] {
        let run = launch(3, role, Duration::from_secs(120));
        assert_eq!(
            said(&run, "rank_gone gone=2"),
            vec![0, 1],
            "{role}: {}",
            run.output()
        );
        assert!(
            !run.success(),
            "{role}: the job must fail: {}",
            run.output()
        );
        assert!(
            run.elapsed < Duration::from_secs(30),
            "{role}: {}",
            run.output()
        );
    }

    // A rank that stalls: the others time out at 2 s naming it as the one missing.
    let run = launch(3, "stall", Duration::from_secs(120));
    assert_eq!(
        said(&run, "timeout missing=[2]"),
        vec![0, 1],
        "{}",
        run.output()
    );
    assert!(!run.success(), "stall: the job must fail: {}", run.output());

    // Point-to-point: mismatched tag, length and dtype are mismatches naming both ranks, and a
    // receive nobody sends times out at 2 s naming the peer.
    let t = Instant::now();
    let run = launch(2, "p2p_mismatch", Duration::from_secs(120));
    assert_eq!(said(&run, "p2p_mismatch ok"), vec![1], "{}", run.output());
    assert_eq!(
        said(&run, "p2p_timeout missing=[0]"),
        vec![1],
        "{}",
        run.output()
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{}", run.output());
    for line in run.output().lines().filter(|l| l.contains("rank 1: text:")) {
        println!("  {line}");
    }
    // A peer that exits, or is SIGKILLed, while two ranks wait for its next message.
    for role in ["p2p_exit", "p2p_kill"] {
        let run = launch(3, role, Duration::from_secs(120));
        assert_eq!(
            said(&run, "p2p_gone gone=2"),
            vec![0, 1],
            "{role}: {}",
            run.output()
        );
        assert!(
            !run.success(),
            "{role}: the job must fail: {}",
            run.output()
        );
        assert!(
            run.elapsed < Duration::from_secs(30),
            "{role}: {}",
            run.output()
        );
        for line in run
            .output()
            .lines()
            .filter(|l| l.contains("p2p_gone") || l.contains("text:"))
        {
            println!("  {role}: {line}");
        }
    }
    println!("kiln-comm MPI tests: all passed");
}

// ---------------------------------------------------------------- worker (one MPI rank)

struct MpiRanks<'a>(&'a MpiComm);

impl Ranks for MpiRanks<'_> {
    fn worlds(&self) -> Vec<usize> {
        vec![self.0.world_size()]
    }
    fn run<R: Send>(&self, world: usize, f: RankFn<'_, R>) -> Vec<(usize, R)> {
        assert_eq!(world, self.0.world_size());
        let r = f(self.0).unwrap_or_else(|e| panic!("rank {}: {e}", self.0.rank()));
        vec![(self.0.rank(), r)]
    }
}

fn worker(role: &str) {
    let mpi = Mpi::init().expect("MPI_Init_thread");
    let timeout = if role == "stall" || role == "p2p_mismatch" {
        2.0
    } else {
        60.0
    };
    let mut config = MpiCommConfig::with_timeout(Duration::from_secs_f64(timeout));
    if let Ok(b) = std::env::var("KILN_TEST_STAGE_BYTES") {
        config.stage_bytes = b.parse().expect("KILN_TEST_STAGE_BYTES");
    }
    let world = mpi.world(config).expect("world communicator");
    let me = world.rank();
    match role {
        "suite" => {
            let ranks = MpiRanks(&world);
            suite::check_every_dtype(&ranks);
            suite::check_nan_max(&ranks);
            suite::check_split(&ranks);
            suite::check_many_small(&ranks);
            suite::check_p2p(&ranks);
            println!("rank {me}: suite ok");
        }
        "mismatch" => mismatch(&world),
        "p2p_mismatch" => p2p_mismatch(&world),
        "p2p_exit" | "p2p_kill" => p2p_gone(&world, role == "p2p_kill"),
        "exit" | "kill" => {
            if me == 2 {
                std::thread::sleep(Duration::from_millis(300));
                if role == "kill" {
                    let _ = std::process::Command::new("kill")
                        .args(["-KILL", &std::process::id().to_string()])
                        .status();
                }
                std::process::exit(3);
            }
            let t = Instant::now();
            let mut v = vec![1.0f32; 1 << 20];
            match world.all_reduce(&mut v, ReduceOp::Sum) {
                Err(CommError::RankGone { gone, op, .. }) => {
                    assert_eq!(op, OpKind::AllReduce);
                    println!("rank {me}: rank_gone gone={gone} after {:?}", t.elapsed());
                }
                other => panic!("rank {me}: expected RankGone, got {other:?}"),
            }
            // the communicator is unusable now, and says why
            let again = world
                .barrier()
                .expect_err("a broken communicator must refuse");
            assert!(again.to_string().contains("earlier failure"), "{again}");
            // stay a moment, so that the other survivor sees rank 2 gone and not this one
            std::thread::sleep(Duration::from_millis(500));
            drop(world);
            drop(mpi);
            std::process::exit(1);
        }
        "stall" => {
            if me == 2 {
                std::thread::sleep(Duration::from_secs(6));
                std::process::exit(0);
            }
            let mut v = [1.0f64; 3];
            match world.all_reduce(&mut v, ReduceOp::Max) {
                Err(CommError::Timeout {
                    missing, waited, ..
                }) => {
                    assert!(waited >= Duration::from_secs(2));
                    println!("rank {me}: timeout missing={missing:?} after {waited:?}");
                }
                other => panic!("rank {me}: expected a timeout, got {other:?}"),
            }
            std::process::exit(1);
        }
        other => panic!("unknown role {other}"),
    }
    drop(world);
    drop(mpi);
}

fn expect_mismatch(me: usize, res: Result<(), CommError>, second: usize, what: &str) {
    match res {
        Err(CommError::Mismatch {
            rank,
            first_rank,
            second_rank,
            ..
        }) => {
            assert_eq!(rank, me, "{what}");
            assert_eq!(first_rank, 0, "{what}");
            assert_eq!(second_rank, second, "{what}");
        }
        other => panic!("rank {me}: {what}: expected a mismatch, got {other:?}"),
    }
}

fn mismatch(world: &MpiComm) {
    let me = world.rank();
    // a different length on rank 1
    let mut v = vec![1.0f32; if me == 1 { 8 } else { 7 }];
    let res = world.all_reduce(&mut v, ReduceOp::Sum);
    if let Err(e) = &res {
        if me == 0 {
            println!("  {e}");
        }
    }
    expect_mismatch(me, res, 1, "length");
    // a different collective on rank 2
    let res = if me == 2 {
        let mut out = vec![0.0f32; 6];
        world.all_gather(&[1.0f32, 2.0], &mut out)
    } else {
        world.all_reduce(&mut [1.0f32; 6], ReduceOp::Sum)
    };
    expect_mismatch(me, res, 2, "collective");
    // a different dtype on rank 1
    let res = if me == 1 {
        world.all_reduce(&mut [1.0f64; 4], ReduceOp::Sum)
    } else {
        world.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
    };
    expect_mismatch(me, res, 1, "dtype");
    // a wrong chunk length is named with the rank that passed it
    let mut out = vec![0.0f32; if me == 2 { 5 } else { [3, 2][me] }];
    match world.reduce_scatter(&[1.0f32; 7], &mut out, ReduceOp::Sum) {
        Err(CommError::BadLength {
            rank: 2,
            expected: 2,
            got: 5,
            ..
        }) => {}
        other => panic!("rank {me}: expected BadLength on rank 2, got {other:?}"),
    }
    // and the communicator still works
    let mut v = [me as f32; 5];
    world
        .all_reduce(&mut v, ReduceOp::Sum)
        .expect("usable after mismatches");
    assert_eq!(v, [3.0; 5]);
    println!("rank {me}: mismatch ok");
}

/// Rank 0 sends four messages; rank 1 receives them with a wrong tag, length and dtype, then
/// right, and then waits for a fifth that never comes.
fn p2p_mismatch(world: &MpiComm) {
    let me = world.rank();
    let data: Vec<f32> = (0..64).map(|i| i as f32 * 0.25 - 3.0).collect();
    if me == 0 {
        world.send(&data, 1, 8).unwrap();
        world.send(&data, 1, 7).unwrap();
        world.send(&data, 1, 7).unwrap();
        world.send(&data, 1, 9).unwrap();
        // alive past rank 1's timeout, so that it times out rather than seeing this rank exit
        std::thread::sleep(Duration::from_secs(5));
        std::process::exit(0);
    }
    let t = Instant::now();
    let want = [
        "rank 1 expected recv(tag 7, f32, len 64) from rank 0, rank 0 sent send(tag 8, f32, len 64)",
        "rank 1 expected recv(tag 7, f32, len 63) from rank 0, rank 0 sent send(tag 7, f32, len 64)",
        "rank 1 expected recv(tag 7, bf16, len 64) from rank 0, rank 0 sent send(tag 7, f32, len 64)",
    ];
    let mut v = vec![0.0f32; 64];
    let errs = [
        world.recv(&mut v, 0, 7),
        world.recv(&mut v[..63], 0, 7),
        world.recv(&mut [half::bf16::ZERO; 64], 0, 7),
    ];
    for (e, want) in errs.into_iter().zip(want) {
        match e {
            Err(e @ CommError::Mismatch { .. }) => {
                println!("rank 1: text: {e}");
                assert_eq!(e.to_string(), want);
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
    assert_eq!(v, vec![0.0; 64], "a mismatched message is never copied");
    world
        .recv(&mut v, 0, 9)
        .expect("the message after the mismatches");
    assert_eq!(v, data);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    println!("rank 1: p2p_mismatch ok");
    let e = world.recv(&mut v, 0, 5).expect_err("nobody sends");
    match &e {
        CommError::Timeout {
            op: OpKind::Recv,
            missing,
            waited,
            ..
        } => {
            assert!(*waited >= Duration::from_secs(2));
            println!("rank 1: text: {e}");
            println!("rank 1: p2p_timeout missing={missing:?} after {waited:?}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    std::process::exit(1);
}

/// Rank 2 sends a message to ranks 0 and 1 and dies (exits, or is SIGKILLed) while they wait
/// for its next one.
fn p2p_gone(world: &MpiComm, kill: bool) {
    let me = world.rank();
    if me == 2 {
        world.send(&[2.5f64; 1000], 0, 0).unwrap();
        world.send(&[2.5f64; 1000], 1, 0).unwrap();
        world.barrier().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        if kill {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &std::process::id().to_string()])
                .status();
        }
        std::process::exit(3);
    }
    let mut v = vec![0.0f64; 1000];
    world.recv(&mut v, 2, 0).unwrap();
    assert_eq!(v, vec![2.5; 1000]);
    world.barrier().unwrap();
    let t = Instant::now();
    let e = world.recv(&mut v, 2, 1).expect_err("rank 2 is gone");
    match &e {
        CommError::RankGone {
            op: OpKind::Recv,
            gone,
            ..
        } => {
            println!("rank {me}: text: {e}");
            println!("rank {me}: p2p_gone gone={gone} after {:?}", t.elapsed());
        }
        other => panic!("rank {me}: expected RankGone, got {other:?}"),
    }
    // stay a moment, so that the other survivor sees rank 2 gone and not this one
    std::thread::sleep(Duration::from_millis(500));
    std::process::exit(1);
}
