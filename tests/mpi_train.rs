//! The trainer one rank per process: `train_gpt --backend mpi` under real `mpirun`.
//!
//! - 30 steps of `tiny` as dp=2 x tp=2 with ZeRO-1 and fp16 on 4 MPI processes give bitwise
//!   the losses and the step-30 checkpoint files of the same run on 4 thread ranks.
//! - `kill -9` of one MPI rank after the step-10 checkpoint: mpirun ends the job; the relaunch
//!   with `--resume` continues from the last committed checkpoint and ends bitwise equal to the
//!   uninterrupted run (losses of the resumed steps and the step-30 checkpoint files).
//! - The step-10 checkpoint of the MPI run resumes on thread ranks, and the step-20 one of the
//!   thread run on MPI processes, bitwise too.
//! - A rank stopped with SIGSTOP (alive, silent): the others' hang watchdog prints its report
//!   and exits with `HANG_EXIT_CODE`, and mpirun ends the job.
//!
//! Needs the example built with the feature: `cargo build --release --features mpi --example
//! train_gpt`, then `cargo test --release --features mpi --test mpi_train`. Without mpirun it
//! says so and passes, except under `CI=true`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_testkit::{mpirun, mpirun_path, run_with_deadline, ProcessRun};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The tests share the data cache and the two cores: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `target/<profile>/examples/train_gpt`, next to this test's `deps/` folder.
fn train_gpt() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples/train_gpt");
    assert!(
        p.is_file(),
        "{} is missing: build it first with `cargo build --release --features mpi --example train_gpt`",
        p.display()
    );
    p
}

fn work_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kiln-mpi-train")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The run: `tiny`, context 32, dp=2 x tp=2, ZeRO-1, fp16, 30 steps, a checkpoint every 10.
fn args(out: &Path, backend: &str, steps: u64) -> Vec<String> {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kiln-mpi-train-cache");
    [
        "--preset",
        "tiny",
        "--ctx",
        "32",
        "--dp",
        "2",
        "--tp",
        "2",
        "--zero",
        "1",
        "--precision",
        "f16",
        "--corpora",
        "shakespeare",
        "--ckpt_every",
        "10",
        "--checkpoint.keep_last",
        "0",
        "--metrics.console",
        "false",
        "--metrics.tensorboard",
        "false",
        "--metrics.png",
        "false",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--steps".into(),
        steps.to_string(),
        "--backend".into(),
        backend.into(),
        "--out".into(),
        out.display().to_string(),
        "--cache_dir".into(),
        cache.display().to_string(),
    ])
    .collect()
}

fn threads(out: &Path, extra: &[&str]) -> ProcessRun {
    let mut cmd = Command::new(train_gpt());
    cmd.current_dir(repo())
        .args(args(out, "thread", 30))
        .args(extra);
    let run = run_with_deadline(cmd, Duration::from_secs(600));
    assert!(run.success(), "thread run: {}", run.output());
    run
}

fn mpi_cmd(mpirun_bin: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut cmd = mpirun(mpirun_bin, 4, &train_gpt());
    cmd.current_dir(repo())
        .args(args(out, "mpi", 30))
        .args(extra)
        .env("RUST_BACKTRACE", "0");
    cmd
}

/// step -> loss, from the JSONL metrics (the last record of a step wins).
fn losses(out: &Path) -> BTreeMap<u64, u64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((v["step"].as_u64()?, v["loss"].as_f64()?.to_bits()))
        })
        .collect()
}

/// Every file of a committed checkpoint, byte for byte.
fn assert_same_checkpoint(a: &Path, b: &Path, step: u64) {
    let dir = format!("checkpoints/step-{step:08}");
    let (da, db) = (a.join(&dir), b.join(&dir));
    let mut names: Vec<_> = std::fs::read_dir(&da)
        .unwrap_or_else(|e| panic!("{}: {e}", da.display()))
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert!(
        names.len() >= 5,
        "manifest and 4 rank files in {}",
        da.display()
    );
    for n in names {
        let (fa, fb) = (da.join(&n), db.join(&n));
        let (x, y) = (
            std::fs::read(&fa).unwrap(),
            std::fs::read(&fb).unwrap_or_default(),
        );
        assert!(x == y, "{} and {} differ", fa.display(), fb.display());
    }
}

/// The pid of MPI rank `rank` of the job writing to `out`.
fn rank_pid(out: &Path, rank: usize) -> Option<u32> {
    let want_out = out.display().to_string();
    let want_rank = format!("OMPI_COMM_WORLD_RANK={rank}");
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.starts_with(&*train_gpt().display().to_string()) || !cmdline.contains(&want_out)
        {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if environ
            .split(|&b| b == 0)
            .any(|v| v == want_rank.as_bytes())
        {
            return Some(pid);
        }
    }
    None
}

/// Starts `cmd` and, once `ready(out)` holds, sends `signal` to MPI rank 2; the run's result.
fn run_and_signal(
    cmd: Command,
    out: &Path,
    signal: &str,
    ready: impl Fn(&Path) -> bool + Sync,
) -> ProcessRun {
    std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(300) {
                if ready(out) {
                    if let Some(pid) = rank_pid(out, 2) {
                        let ok = Command::new("kill")
                            .args([signal, &pid.to_string()])
                            .status();
                        return ok.is_ok_and(|s| s.success());
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            false
        });
        let run = run_with_deadline(cmd, Duration::from_secs(600));
        assert!(
            watcher.join().unwrap(),
            "never signalled rank 2: {}",
            run.output()
        );
        run
    })
}

#[test]
fn mpi_processes_train_bitwise_like_threads_and_resume_after_kill_9() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mpirun_bin) = mpirun_path() else {
        return;
    };
    let dir = work_dir("equal");
    let (thread_out, mpi_out, killed_out) =
        (dir.join("threads"), dir.join("mpi"), dir.join("killed"));

    // the same run on 4 thread ranks and on 4 MPI processes
    let t0 = Instant::now();
    threads(&thread_out, &[]);
    let t_threads = t0.elapsed();
    let t0 = Instant::now();
    let run = run_with_deadline(
        mpi_cmd(&mpirun_bin, &mpi_out, &[]),
        Duration::from_secs(600),
    );
    assert!(run.success(), "mpi run: {}", run.output());
    println!(
        "30 steps: threads {t_threads:.1?}, 4 MPI processes {:.1?}",
        t0.elapsed()
    );
    assert!(
        run.stdout.contains("4 MPI processes as dp=2 x tp=2"),
        "{}",
        run.output()
    );
    assert_eq!(
        run.stdout.matches("done: 30 steps").count(),
        1,
        "rank 0 alone prints"
    );
    let want = losses(&thread_out);
    assert_eq!(want.len(), 30);
    assert_eq!(losses(&mpi_out), want, "losses of the MPI run");
    for step in [10, 20, 30] {
        assert_same_checkpoint(&thread_out, &mpi_out, step);
    }

    // kill -9 one rank after the step-10 checkpoint is committed, then resume
    let committed = |out: &Path| {
        out.join("checkpoints/step-00000010/manifest.json")
            .is_file()
    };
    let t0 = Instant::now();
    let run = run_and_signal(
        mpi_cmd(&mpirun_bin, &killed_out, &[]),
        &killed_out,
        "-KILL",
        committed,
    );
    assert!(!run.success(), "the killed job must fail: {}", run.output());
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "the job must end, not hang: {}",
        run.output()
    );
    assert!(
        !killed_out.join("checkpoints/step-00000030").exists(),
        "the run ended before the kill: {}",
        run.output()
    );
    let run = run_with_deadline(
        mpi_cmd(&mpirun_bin, &killed_out, &["--resume"]),
        Duration::from_secs(600),
    );
    assert!(run.success(), "resumed run: {}", run.output());
    let from: u64 = run
        .stdout
        .split("resumed from the step-")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no resume line: {}", run.output()));
    assert!((10..30).contains(&from), "resumed from {from}");
    println!("killed rank 2 with SIGKILL; resumed from step {from}");
    let got = losses(&killed_out);
    for step in from + 1..=30 {
        assert_eq!(
            got.get(&step),
            want.get(&step),
            "loss at step {step} after the resume"
        );
    }
    assert_same_checkpoint(&thread_out, &killed_out, 30);

    // a checkpoint written by the MPI processes resumes on thread ranks, and the other way
    let from_mpi = dir.join("from-mpi");
    copy_checkpoint(&mpi_out, &from_mpi, 10);
    let run = threads(&from_mpi, &["--resume"]);
    assert!(
        run.stdout.contains("resumed from the step-10 checkpoint"),
        "{}",
        run.output()
    );
    assert_same_checkpoint(&thread_out, &from_mpi, 30);
    let from_threads = dir.join("from-threads");
    copy_checkpoint(&thread_out, &from_threads, 20);
    let run = run_with_deadline(
        mpi_cmd(&mpirun_bin, &from_threads, &["--resume"]),
        Duration::from_secs(600),
    );
    assert!(run.success(), "{}", run.output());
    assert!(
        run.stdout.contains("resumed from the step-20 checkpoint"),
        "{}",
        run.output()
    );
    assert_same_checkpoint(&thread_out, &from_threads, 30);
}

/// Copies the committed step-`step` checkpoint of run `from` into a fresh run folder `to`.
fn copy_checkpoint(from: &Path, to: &Path, step: u64) {
    let dir = format!("checkpoints/step-{step:08}");
    std::fs::create_dir_all(to.join(&dir)).unwrap();
    for e in std::fs::read_dir(from.join(&dir)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(&dir).join(e.file_name())).unwrap();
    }
}

#[test]
fn a_stopped_rank_makes_the_watchdog_end_the_job() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mpirun_bin) = mpirun_path() else {
        return;
    };
    let out = work_dir("watchdog");
    let cmd = mpi_cmd(
        &mpirun_bin,
        &out,
        &["--monitor.watchdog_s", "3", "--ckpt_every", "0"],
    );
    // SIGSTOP rank 2 once training has begun: alive but silent, so only the watchdog can tell
    let started = |out: &Path| out.join("metrics.jsonl").is_file();
    let t0 = Instant::now();
    let run = run_and_signal(cmd, &out, "-STOP", started);
    assert!(!run.success(), "{}", run.output());
    assert!(t0.elapsed() < Duration::from_secs(120), "{}", run.output());
    let code = kiln_train::HANG_EXIT_CODE;
    assert!(
        run.stderr.contains("watchdog")
            && run.stderr.contains(&format!("exiting with status {code}")),
        "{}",
        run.output()
    );
    assert!(
        run.stderr.contains("last collective"),
        "the dump names collectives: {}",
        run.output()
    );
}
