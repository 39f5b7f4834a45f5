//! `init_from_env` under real `mpirun`: the launcher's variables and MPI agree, and the world
//! communicator works; a stale torchrun export that contradicts Open MPI's variables is an error
//! naming both.
//!
//! Run with `cargo test -p kiln-launch --features mpi --release --test mpi`. Without
//! `KILN_MPI_TEST` set this binary is the driver: it launches itself under `mpirun` once per
//! scenario and checks what every rank printed. Where `mpirun` is missing it says so and
//! passes, except under `CI=true`, where that is a failure.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use kiln_comm::{CommExt, Communicator, ReduceOp};
use kiln_launch::{init_from_env, Backend, LaunchEnv, Launcher};
use kiln_testkit::{mpirun_path, mpirun_self, ProcessRun};
use std::time::Duration;

fn main() {
    match std::env::var("KILN_MPI_TEST") {
        Ok(role) => worker(&role),
        Err(_) => driver(),
    }
}

fn launch(np: usize, role: &str, vars: &[(&str, &str)]) -> ProcessRun {
    let mpirun_bin = mpirun_path().expect("checked by the driver");
    mpirun_self(&mpirun_bin, np, role, vars, Duration::from_secs(120))
}

fn driver() {
    println!("kiln-launch MPI tests");
    if mpirun_path().is_none() {
        return;
    }
    let run = launch(2, "launch", &[]);
    assert!(run.success(), "launch: {}", run.output());
    assert_eq!(
        run.ranks_saying("launch ok"),
        vec![0, 1],
        "{}",
        run.output()
    );
    let run = launch(
        2,
        "launch-stale",
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
    );
    assert_eq!(run.ranks_saying("accepted"), vec![0], "{}", run.output());
    assert_eq!(run.ranks_saying("refused launch environment: OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2 against RANK=0, WORLD_SIZE=2"), vec![1], "{}", run.output());
    println!("kiln-launch MPI tests: all passed");
}

/// One MPI rank.
fn worker(role: &str) {
    if role == "launch-stale" {
        match LaunchEnv::from_env() {
            Err(e) => {
                let rank = std::env::var("OMPI_COMM_WORLD_RANK").unwrap_or_default();
                println!("rank {rank}: refused {e}");
            }
            Ok(env) => println!("rank {}: accepted", env.rank),
        }
        return;
    }
    let launched = init_from_env(Backend::Mpi).expect("init_from_env");
    let env = &launched.env;
    assert_eq!(env.launcher, Launcher::OpenMpi);
    assert_eq!(launched.backend, Backend::Mpi);
    assert_eq!(launched.comm.rank(), env.rank);
    assert_eq!(launched.comm.world_size(), env.world_size);
    assert_eq!(
        env.local_rank, env.rank,
        "one host: local ranks are the ranks"
    );
    let mut v = [1u32];
    launched
        .comm
        .all_reduce(&mut v, ReduceOp::Sum)
        .expect("all_reduce");
    assert_eq!(v[0] as usize, env.world_size);
    println!("rank {}: launch ok", env.rank);
}
