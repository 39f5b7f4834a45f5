//! Elastic restarts, torchrun's `--max-restarts`: runs a training command and, when it dies
//! abnormally (killed by a signal, or a non-zero exit after it started training), relaunches
//! it with `--resume` so it continues from its last committed checkpoint, up to N times,
//! optionally at a smaller data-parallel degree (the checkpoint reshards on load). Prints each
//! start, exit, restart and the recovery time (crash to the first step the relaunched run
//! records in its `metrics.jsonl`), and writes them as JSON lines to the events file.
//!
//! ```text
//! cargo build --release --example supervise --example train_gpt
//! target/release/examples/supervise --max-restarts 3 --restart-dp 1 -- \
//!     target/release/examples/train_gpt --out runs/elastic --steps 200
//! ```
//!
//! Flags (before `--`):
//! - `--max-restarts N` (default 3): relaunches allowed; one more crash is an error;
//! - `--restart-dp D[,D...]`: the data-parallel degree of restart 1, 2, ... (the last one
//!   repeats), passed as `--dp D` after the command's own flags;
//! - `--restart-arg ARG` (repeatable): another argument for every relaunch, after those
//!   (`--restart-arg --accumulation --restart-arg 2` keeps the global batch at half the dp);
//! - `--progress FILE`: the run's progress file (default `<--out DIR>/metrics.jsonl` when the
//!   command has `--out DIR`);
//! - `--events FILE`: the events file (default `supervise.jsonl` beside the progress file).
//!
//! Exit status: the command's when it succeeds (or fails at start-up, or with a usage or
//! configuration status 2, 64 or 78: a restart would fail the same way); otherwise the
//! status of its last crash (128 + signal), once the restarts are spent.

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

use kiln_comm::launch::{SuperviseEnd, Supervisor, SupervisorConfig};
use std::ffi::OsString;
use std::path::PathBuf;

#[path = "common/command_line.rs"]
mod command_line;

const USAGE: &str = "usage: supervise [--max-restarts N] [--restart-dp D[,D...]] \
                     [--restart-arg ARG]... [--progress FILE] [--events FILE] -- PROGRAM [ARGS...]";

fn main() -> anyhow::Result<()> {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let (flags, program, program_args) = command_line::split_command(&args, USAGE)?;
    let mut cfg = SupervisorConfig::new(&program, &program_args);
    let mut extra: Vec<OsString> = Vec::new();
    let mut it = flags.iter();
    while let Some(flag) = it.next() {
        let flag = flag.to_string_lossy().into_owned();
        let value = it
            .next()
            .ok_or_else(|| anyhow::anyhow!("{flag} needs a value\n{USAGE}"))?;
        let text = value.to_string_lossy().into_owned();
        let bad = |e: &dyn std::fmt::Display| anyhow::anyhow!("{flag} {text}: {e}\n{USAGE}");
        match flag.as_str() {
            "--max-restarts" => cfg.max_restarts = text.parse().map_err(|e| bad(&e))?,
            "--restart-dp" => {
                cfg.restart_dp = text
                    .split(',')
                    .map(|d| match d.trim().parse::<usize>() {
                        Ok(0) => Err(bad(&"a degree is at least 1")),
                        Ok(d) => Ok(d),
                        Err(e) => Err(bad(&e)),
                    })
                    .collect::<anyhow::Result<_>>()?
            }
            "--restart-arg" => extra.push(value.clone()),
            "--progress" => cfg.progress = Some(PathBuf::from(value)),
            "--events" => cfg.events = Some(PathBuf::from(value)),
            other => anyhow::bail!("unknown flag {other}\n{USAGE}"),
        }
    }
    if cfg.progress.is_none() {
        cfg.progress = out_dir(&program_args).map(|d| d.join("metrics.jsonl"));
    }
    if cfg.events.is_none() {
        cfg.events = cfg
            .progress
            .as_ref()
            .map(|p| p.with_file_name("supervise.jsonl"));
    }
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
        SuperviseEnd::Succeeded => Ok(()),
        SuperviseEnd::Failed(why) | SuperviseEnd::Exhausted(why) => {
            eprintln!("supervise: error: {why}");
            std::process::exit(outcome.exit_code())
        }
        other => {
            eprintln!("supervise: error: {other:?}");
            std::process::exit(outcome.exit_code())
        }
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
