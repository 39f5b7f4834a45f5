//! kiln's launcher, torchrun-style: starts a program once per local rank with the variables
//! kiln (and PyTorch) read (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`), waits, and when one process fails stops the others and exits
//! with an error naming the rank. One process per GPU under NCCL:
//!
//! ```text
//! cargo build --release --features cuda,nccl --example train_gpt --example launch
//! target/release/examples/launch --nproc-per-node 8 -- \
//!     target/release/examples/train_gpt --backend nccl --device cuda --dp 8 --tp 1
//! ```
//!
//! Across nodes, run it on each node with `--nnodes N --node-rank K --master-addr HOST`
//! (under Slurm, `srun` sets the variables itself: no launcher needed).

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

use kiln_comm::launch::LocalLaunch;
use std::ffi::OsString;

#[path = "common/command_line.rs"]
mod command_line;

const USAGE: &str = "usage: launch --nproc-per-node N [--nnodes N --node-rank K] \
                     [--master-addr HOST] [--master-port PORT] -- PROGRAM [ARGS...]";

fn main() -> anyhow::Result<()> {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let (flags, program, program_args) = command_line::split_command(&args, USAGE)?;
    let mut l = LocalLaunch::default();
    let mut it = flags.iter().map(|f| f.to_string_lossy().into_owned());
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| anyhow::anyhow!("{flag} needs a value\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| anyhow::anyhow!("{flag} {value}: {e}\n{USAGE}");
        match flag.as_str() {
            "--nproc-per-node" => l.nproc_per_node = value.parse().map_err(|e| bad(&e))?,
            "--nnodes" => l.nnodes = value.parse().map_err(|e| bad(&e))?,
            "--node-rank" => l.node_rank = value.parse().map_err(|e| bad(&e))?,
            "--master-addr" => l.master_addr = value.clone(),
            "--master-port" => l.master_port = value.parse().map_err(|e| bad(&e))?,
            other => anyhow::bail!("unknown flag {other}\n{USAGE}"),
        }
    }
    let outcome = l.run(&program, &program_args)?;
    match outcome.first_failure {
        None => {
            eprintln!("launch: {} processes exited with 0", outcome.codes.len());
            Ok(())
        }
        Some((rank, how)) => {
            eprintln!(
                "launch: rank {rank} failed ({how}); the others were stopped: exit codes {:?}",
                outcome.codes
            );
            std::process::exit(1)
        }
    }
}
