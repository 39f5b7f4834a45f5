//! The parallel-equivalence suite of `common/equivalence.rs` (tensor parallel against tp = 1,
//! ZeRO against plain data parallel bitwise, dp x tp fp16 against one rank) on 4 MPI processes
//! under real `mpirun`: the same code `parallel_gpt.rs` runs on 4 thread ranks.
//!
//! `cargo test --release --features mpi --test mpi_equivalence`. Without `KILN_EQUIV_RANK` set
//! this binary is the driver: it launches itself under `mpirun -np 4` and checks that every rank
//! passed. Without mpirun it says so and passes, except under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use kiln_comm::{Communicator, Mpi, MpiCommConfig};
use kiln_testkit::{mpirun, mpirun_path, run_with_deadline};
use std::sync::Arc;
use std::time::Duration;

fn main() {
    if std::env::var_os("KILN_EQUIV_RANK").is_some() {
        rank();
    } else {
        driver();
    }
}

fn driver() {
    println!("parallel equivalence on 4 MPI processes");
    let Some(bin) = mpirun_path() else { return };
    let exe = std::env::current_exe().unwrap();
    let mut cmd = mpirun(&bin, 4, &exe);
    cmd.env("KILN_EQUIV_RANK", "1");
    let run = run_with_deadline(cmd, Duration::from_secs(900));
    print!("{}", run.stdout);
    assert!(run.success(), "mpirun -np 4: {}", run.output());
    for r in 0..4 {
        assert!(
            run.stdout.contains(&format!("rank {r}: suite ok")),
            "rank {r} did not pass: {}",
            run.output()
        );
    }
    println!("parallel equivalence on 4 MPI processes: every rank passed");
}

fn rank() {
    let mpi = Mpi::init().unwrap();
    let world = mpi.world(MpiCommConfig::default()).unwrap();
    let r = world.rank();
    match common::equivalence::suite_on(Arc::new(world)) {
        Ok(lines) => {
            for l in lines {
                println!("rank {r}: {l}");
            }
            println!("rank {r}: suite ok");
        }
        Err(e) => {
            println!("rank {r}: FAILED: {e:#}");
            std::process::exit(1);
        }
    }
}
