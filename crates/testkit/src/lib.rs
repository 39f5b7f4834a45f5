//! Test helpers shared by kiln's crates: run a closure on N ranks, compare float slices with a
//! tolerance and report the worst element, run Python as a reference with one rule for when a
//! test may skip ([`python`]).
//!
//! ```
//! use kiln_testkit::{assert_close, run_ranks};
//! use kiln_comm::{CommExt, Communicator, ReduceOp};
//!
//! let out = run_ranks(2, |comm| {
//!     let mut v = [comm.rank() as f32 + 0.5];
//!     comm.all_reduce(&mut v, ReduceOp::Sum)?;
//!     Ok(v[0])
//! });
//! assert_close(&out, &[2.0, 2.0], 0.0, 0.0);
//! ```
#![deny(missing_docs)]
#![allow(clippy::panic)] // assertion helpers report failures by panicking, like assert_eq!

pub mod python;

pub use python::{under_ci, Python};

use kiln_comm::{spawn_with, ThreadComm, ThreadCommConfig};
use std::time::Duration;

/// The timeout tests give communicators: long enough for a loaded 2-core machine, short enough
/// that a hang fails the test quickly.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f` on `world` thread ranks (timeout [`TEST_TIMEOUT`]) and returns the results in rank
/// order; panics with the failing rank's message if any rank fails.
pub fn run_ranks<R, F>(world: usize, f: F) -> Vec<R>
where
    F: Fn(ThreadComm) -> anyhow::Result<R> + Sync,
    R: Send,
{
    try_run_ranks(world, TEST_TIMEOUT, f).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `f` on `world` thread ranks with the given timeout; the first failure is returned.
pub fn try_run_ranks<R, F>(
    world: usize,
    timeout: Duration,
    f: F,
) -> Result<Vec<R>, kiln_comm::RankError<anyhow::Error>>
where
    F: Fn(ThreadComm) -> anyhow::Result<R> + Sync,
    R: Send,
{
    spawn_with(ThreadCommConfig::with_timeout(timeout), world, f)
}

/// Panics, naming both, when two slices compared element by element differ in length.
fn assert_same_len(actual: usize, expected: usize) {
    assert_eq!(
        actual, expected,
        "length differs: actual {actual} vs expected {expected}"
    );
}

/// The largest difference between two slices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorstDiff {
    /// Index of the worst element.
    pub index: usize,
    /// Value in the first slice.
    pub actual: f64,
    /// Value in the second slice.
    pub expected: f64,
    /// |actual - expected|.
    pub abs: f64,
    /// |actual - expected| / max(|expected|, tiny).
    pub rel: f64,
}

/// Finds the element where `actual` and `expected` differ most relative to the tolerance
/// `atol + rtol * |expected|`; `None` for empty slices. NaN anywhere counts as infinitely far
/// unless both sides are NaN. Panics when the lengths differ.
pub fn worst_diff(actual: &[f64], expected: &[f64], atol: f64, rtol: f64) -> Option<WorstDiff> {
    assert_same_len(actual.len(), expected.len());
    let mut worst: Option<(f64, WorstDiff)> = None;
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let abs = if a.is_nan() && e.is_nan() || a == e {
            0.0
        } else if a.is_nan() || e.is_nan() {
            f64::INFINITY
        } else {
            (a - e).abs()
        };
        let rel = abs / e.abs().max(f64::MIN_POSITIVE);
        let score = abs / (atol + rtol * e.abs()).max(f64::MIN_POSITIVE);
        let d = WorstDiff {
            index: i,
            actual: a,
            expected: e,
            abs,
            rel,
        };
        if worst.as_ref().is_none_or(|(s, _)| score > *s) {
            worst = Some((score, d));
        }
    }
    worst.map(|(_, d)| d)
}

/// Asserts `|actual - expected| <= atol + rtol * |expected|` element-wise (and equal lengths),
/// reporting the worst element. Works on any float slice convertible to f64.
pub fn assert_close<A: Copy + Into<f64>, B: Copy + Into<f64>>(
    actual: &[A],
    expected: &[B],
    atol: f64,
    rtol: f64,
) {
    assert_same_len(actual.len(), expected.len());
    let a: Vec<f64> = actual.iter().map(|&x| x.into()).collect();
    let e: Vec<f64> = expected.iter().map(|&x| x.into()).collect();
    if let Some(w) = worst_diff(&a, &e, atol, rtol) {
        let ok = w.abs <= atol + rtol * w.expected.abs();
        assert!(
            ok,
            "slices differ beyond atol {atol:e} rtol {rtol:e}: worst at index {} of {}: actual {} \
             expected {} (abs {:e}, rel {:e})",
            w.index,
            a.len(),
            w.actual,
            w.expected,
            w.abs,
            w.rel
        );
    }
}

/// Asserts two f32 slices are bitwise identical, reporting the first differing element.
pub fn assert_bitwise_eq(actual: &[f32], expected: &[f32]) {
    assert_same_len(actual.len(), expected.len());
    if let Some((i, (a, e))) = actual
        .iter()
        .zip(expected)
        .enumerate()
        .find(|(_, (a, e))| a.to_bits() != e.to_bits())
    {
        panic!(
            "not bitwise equal: first difference at index {i} of {}: {a:e} vs {e:e}",
            actual.len()
        );
    }
}

/// The maximum relative difference `|a - e| / max(|e|, 1e-30)` over two slices (for reports).
/// Panics when the lengths differ.
pub fn max_rel_diff(actual: &[f32], expected: &[f32]) -> f64 {
    assert_same_len(actual.len(), expected.len());
    actual
        .iter()
        .zip(expected)
        .map(|(&a, &e)| ((a as f64 - e as f64).abs()) / (e as f64).abs().max(1e-30))
        .fold(0.0, f64::max)
}

/// What a process launched by [`run_with_deadline`] (or [`mpirun`]) did.
#[derive(Debug)]
pub struct ProcessRun {
    /// Exit status (`None`: killed at the deadline).
    pub status: Option<std::process::ExitStatus>,
    /// Everything it printed to stdout.
    pub stdout: String,
    /// Everything it printed to stderr.
    pub stderr: String,
    /// Wall time until it ended.
    pub elapsed: Duration,
}

impl ProcessRun {
    /// True when it exited with status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// Both streams, for failure messages.
    pub fn output(&self) -> String {
        format!(
            "status {:?} after {:.1?}\n--- stdout\n{}\n--- stderr\n{}",
            self.status, self.elapsed, self.stdout, self.stderr
        )
    }

    /// The ranks that printed a stdout line `rank R: <what>...`, sorted: how the ranks of a
    /// multi-process test report.
    pub fn ranks_saying(&self, what: &str) -> Vec<usize> {
        let mut ranks: Vec<usize> = self
            .stdout
            .lines()
            .filter_map(|l| {
                let rest = l.trim().strip_prefix("rank ")?;
                let (r, msg) = rest.split_once(": ")?;
                msg.starts_with(what).then(|| r.parse().ok()).flatten()
            })
            .collect();
        ranks.sort_unstable();
        ranks
    }
}

/// Runs `cmd` to completion or until `deadline`, when it is terminated (SIGTERM, then SIGKILL
/// after 5 s), collecting its output.
pub fn run_with_deadline(mut cmd: std::process::Command, deadline: Duration) -> ProcessRun {
    use std::io::Read;
    use std::process::Stdio;
    let start = std::time::Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = pipe(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = pipe(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let mut termed: Option<std::time::Instant> = None;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break termed.is_none().then_some(s),
            Ok(None) => {}
            Err(e) => panic!("waiting for {cmd:?}: {e}"),
        }
        match termed {
            None if start.elapsed() >= deadline => {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .status();
                termed = Some(std::time::Instant::now());
            }
            Some(t) if t.elapsed() >= Duration::from_secs(5) => {
                let _ = child.kill();
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    ProcessRun {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        elapsed: start.elapsed(),
    }
}

/// The `mpirun` to launch multi-process tests with, or `None` (with the reason printed) where
/// this machine has none. Under `CI=true` a missing `mpirun` fails the test: CI installs Open
/// MPI, so its absence there is a broken CI, never a silent pass.
pub fn mpirun_path() -> Option<std::path::PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("mpirun"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        if under_ci() {
            panic!("mpirun not found on PATH under CI=true: .ci/run must install openmpi-bin");
        }
        println!("skipped: mpirun not found on PATH (install Open MPI: apt-get install openmpi-bin libopenmpi-dev)");
    }
    found
}

/// An `mpirun` command line for `np` processes of `exe` on this machine, allowed to run as
/// root and oversubscribed (more ranks than cores), with the launcher's own chatter quiet.
pub fn mpirun(mpirun: &std::path::Path, np: usize, exe: &std::path::Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(mpirun);
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .args(["--mca", "btl", "self,vader,tcp"])
    .args(["-np", &np.to_string()])
    .arg(exe);
    cmd
}

/// Runs this test binary under `mpirun -np np` with `role` in `KILN_MPI_TEST` and `vars` set,
/// until `deadline`; prints how it went. The binary's `main` reads `KILN_MPI_TEST` to tell the
/// driver (unset) from a rank (set to its role).
pub fn mpirun_self(
    mpirun_bin: &std::path::Path,
    np: usize,
    role: &str,
    vars: &[(&str, &str)],
    deadline: Duration,
) -> ProcessRun {
    let exe = std::env::current_exe().unwrap_or_default();
    let mut cmd = mpirun(mpirun_bin, np, &exe);
    cmd.env("KILN_MPI_TEST", role).envs(vars.iter().copied());
    let t = std::time::Instant::now();
    let run = run_with_deadline(cmd, deadline);
    println!(
        "  mpirun -np {np} {role}: {:?} in {:.1?}",
        run.status,
        t.elapsed()
    );
    run
}

/// Every `.rs` file under `dir`, recursively, in the order the directory lists them (for tests
/// that check a rule over the source tree). An unreadable folder panics, naming it.
pub fn rust_sources(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
            .path();
        if path.is_dir() {
            out.extend(rust_sources(&path));
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_diff_finds_the_worst() {
        let w = worst_diff(&[1.0, 2.0, 3.5], &[1.0, 2.1, 3.0], 0.0, 1e-3).unwrap();
        assert_eq!(w.index, 2);
        assert!((w.abs - 0.5).abs() < 1e-12);
    }

    #[test]
    #[should_panic(expected = "worst at index 1")]
    fn assert_close_reports_index() {
        assert_close(&[1.0f32, 5.0], &[1.0f32, 4.0], 1e-6, 1e-6);
    }

    #[test]
    fn nan_is_far() {
        let w = worst_diff(&[f64::NAN], &[1.0], 1.0, 1.0).unwrap();
        assert!(w.abs.is_infinite());
    }
}
