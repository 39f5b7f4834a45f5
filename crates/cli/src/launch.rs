//! `kiln launch` (kiln-launch's [`LocalLaunch`], torchrun's `--nproc-per-node`) and
//! `kiln supervise` (kiln-launch's [`Supervisor`], torchrun's `--max-restarts`): each takes its
//! own flags, `--`, then the program and its arguments.

use kiln_launch::{LocalLaunch, StoreToken, SuperviseEnd, Supervisor, SupervisorConfig};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// `kiln launch`: starts a program once per local rank with the variables kiln (and PyTorch)
/// read (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
/// and the rendezvous token `KILN_STORE_TOKEN`), waits, and when one process fails stops the
/// others and exits with an error naming the rank.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Example, one process per GPU under NCCL:\n  kiln launch \
--nproc-per-node 8 -- kiln train --backend nccl --device cuda --dp 8 --tp 1\n\nAcross nodes, \
run it on each node with --nnodes N --node-rank K --master-addr HOST and the same \
--store-token (under Slurm, srun sets the variables itself: no launcher needed)."
)]
pub struct LaunchArgs {
    /// Processes on this node (one per GPU under NCCL)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub nproc_per_node: u64,
    /// Nodes in the job
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub nnodes: u64,
    /// This node's index, 0..nnodes
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub node_rank: usize,
    /// Host of rank 0, where the rendezvous store listens
    #[arg(long, value_name = "HOST", default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous store
    #[arg(long, value_name = "PORT", default_value_t = 29500)]
    pub master_port: u16,
    /// The job's rendezvous token (default: KILN_STORE_TOKEN, else a random one on one node)
    #[arg(long, value_name = "TOKEN")]
    pub store_token: Option<String>,
    /// Seconds the others get to exit after one failed, before they are killed
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub grace: f64,
    /// The program and its arguments
    #[arg(
        value_name = "PROGRAM [ARGS]",
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub command: Vec<OsString>,
}

impl LaunchArgs {
    /// The launcher these flags describe.
    pub fn launcher(&self) -> anyhow::Result<LocalLaunch> {
        if !(self.grace.is_finite() && self.grace >= 0.0) {
            anyhow::bail!("--grace {}: must be a number of seconds >= 0", self.grace);
        }
        Ok(LocalLaunch {
            nproc_per_node: self.nproc_per_node as usize,
            nnodes: self.nnodes as usize,
            node_rank: self.node_rank,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
            grace: Duration::from_secs_f64(self.grace),
            store_token: self
                .store_token
                .as_ref()
                .map(|t| StoreToken::new(t.clone(), "--store-token")),
        })
    }

    /// Launches and waits; exit code 1 when a process failed.
    pub fn run(&self) -> anyhow::Result<ExitCode> {
        let (program, args) = split(&self.command)?;
        let outcome = self.launcher()?.run(program, args)?;
        match outcome.first_failure {
            None => {
                eprintln!("launch: {} processes exited with 0", outcome.codes.len());
                Ok(ExitCode::SUCCESS)
            }
            Some((rank, how)) => {
                eprintln!(
                    "launch: rank {rank} failed ({how}); the others were stopped: exit codes {:?}",
                    outcome.codes
                );
                Ok(ExitCode::FAILURE)
            }
        }
    }
}

/// The program and its arguments.
fn split(command: &[OsString]) -> anyhow::Result<(&OsString, &[OsString])> {
    command
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("no program given after the flags"))
}

/// `kiln supervise`: runs a training command and, when it dies abnormally (killed by a signal,
/// or a non-zero exit after it started training), relaunches it with `--resume` so it
/// continues from its last committed checkpoint, up to N times, optionally at a smaller
/// data-parallel degree (the checkpoint reshards on load). Prints each start, exit, restart and
/// the recovery time (crash to the first step the relaunched run records in its progress
/// file), and writes them as JSON lines to the events file.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Example:\n  kiln supervise --max-restarts 3 --restart-dp 1 -- kiln \
train --out runs/elastic --steps 200\n\nExit status: the command's when it succeeds (or fails \
at start-up, or with a usage or configuration status 2, 64 or 78: a restart would fail the \
same way); otherwise the status of its last crash (128 + signal), once the restarts are spent."
)]
pub struct SuperviseArgs {
    /// Relaunches allowed; one more crash is an error
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub max_restarts: usize,
    /// The data-parallel degree of restart 1, 2, ... (the last one repeats), passed as --dp D
    /// after the command's own flags
    #[arg(long, value_name = "D[,D...]", value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..))]
    pub restart_dp: Vec<u64>,
    /// Another argument for every relaunch, after those (repeatable: --restart-arg
    /// --accumulation --restart-arg 2)
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    pub restart_arg: Vec<OsString>,
    /// The run's progress file (default: metrics.jsonl in the command's --out DIR, when it has
    /// one)
    #[arg(long, value_name = "FILE")]
    pub progress: Option<PathBuf>,
    /// The events file (default: supervise.jsonl beside the progress file)
    #[arg(long, value_name = "FILE")]
    pub events: Option<PathBuf>,
    /// The training command and its arguments
    #[arg(
        value_name = "PROGRAM [ARGS]",
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub command: Vec<OsString>,
}

impl SuperviseArgs {
    /// The supervisor's configuration these flags describe.
    pub fn config(&self) -> anyhow::Result<SupervisorConfig> {
        let (program, program_args) = split(&self.command)?;
        let mut cfg = SupervisorConfig::new(program, program_args);
        cfg.max_restarts = self.max_restarts;
        cfg.restart_dp = self.restart_dp.iter().map(|&d| d as usize).collect();
        cfg.progress = self
            .progress
            .clone()
            .or_else(|| out_dir(program_args).map(|d| d.join("metrics.jsonl")));
        cfg.events = self.events.clone().or_else(|| {
            cfg.progress
                .as_ref()
                .map(|p| p.with_file_name("supervise.jsonl"))
        });
        Ok(cfg)
    }

    /// Supervises; the exit code of the command, or of its last crash.
    pub fn run(&self) -> anyhow::Result<ExitCode> {
        let cfg = self.config()?;
        if let Some(dir) = cfg.events.as_ref().and_then(|e| e.parent()) {
            if !dir.as_os_str().is_empty() {
                std::fs::create_dir_all(dir)?;
            }
        }
        match (&cfg.progress, &cfg.events) {
            (Some(p), Some(e)) => eprintln!(
                "supervise: up to {} restart(s); progress {}, events {}",
                cfg.max_restarts,
                p.display(),
                e.display()
            ),
            _ => eprintln!(
                "supervise: up to {} restart(s); no progress file (recovery times are not measured)",
                cfg.max_restarts
            ),
        }
        let extra = self.restart_arg.clone();
        let outcome = Supervisor::new(cfg)
            .on_event(|e| eprintln!("supervise: {e}"))
            .restart_args_with(move |_, _| extra.clone())
            .run()?;
        let times: Vec<String> = outcome
            .attempts
            .iter()
            .skip(1)
            .map(|a| {
                a.recovery_s
                    .map_or("not seen".into(), |s| format!("{s:.2} s"))
            })
            .collect();
        if !times.is_empty() {
            eprintln!(
                "supervise: {} restart(s), recovery times (crash to first resumed step): {}",
                outcome.restarts(),
                times.join(", ")
            );
        }
        match &outcome.end {
            SuperviseEnd::Succeeded => return Ok(ExitCode::SUCCESS),
            SuperviseEnd::Failed(why) | SuperviseEnd::Exhausted(why) => {
                eprintln!("supervise: error: {why}")
            }
            other => eprintln!("supervise: error: {other:?}"),
        }
        Ok(ExitCode::from(
            u8::try_from(outcome.exit_code()).unwrap_or(1),
        ))
    }
}

/// The value of `--out DIR` (or `--output`, `--output_dir`, `--out=DIR`) in the command's
/// arguments: the last one wins, as in kiln's trainer.
fn out_dir(args: &[OsString]) -> Option<PathBuf> {
    let names = ["--out", "--output", "--output_dir", "--output-dir"];
    let mut found = None;
    let mut it = args.iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(a) = it.next() {
        if let Some((k, v)) = a.split_once('=') {
            if names.contains(&k) {
                found = Some(PathBuf::from(v));
            }
        } else if names.contains(&a.as_str()) {
            found = it.next().map(PathBuf::from);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_out_folder_is_the_last_one_given() {
        let args: Vec<OsString> = ["--steps", "3", "--out", "a", "--output=b", "--dp", "2"]
            .map(OsString::from)
            .to_vec();
        assert_eq!(out_dir(&args), Some(PathBuf::from("b")));
        assert_eq!(out_dir(&args[..4]), Some(PathBuf::from("a")));
        assert_eq!(out_dir(&args[..2]), None);
    }
}
