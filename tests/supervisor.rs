//! The elastic restart supervisor (`kiln supervise`, `kiln_launch::Supervisor`)
//! on the real `train_gpt`: the test SIGKILLs the supervised process (its pid taken from the
//! supervisor's events file) and checks what the supervisor did.
//!
//! - Two kills at different steps, relaunched at the same layout (dp=2 x tp=2, fp16, ZeRO-1):
//!   two recoveries, each timed from the crash to the first resumed step record and under
//!   60 s, and the run ends bitwise equal to an uninterrupted one (every committed
//!   checkpoint's files byte for byte, every step record's loss bit for bit).
//! - One kill with `--restart-dp 1` (plus `--accumulation 2`, so the global batch stays 8):
//!   the relaunch loads the dp=2 checkpoint into dp=1 x tp=2 (resharded on load), says so,
//!   and finishes; its losses after the resume are finite and within 1e-3 (relative) of the
//!   uninterrupted dp=2 run's: the same samples and arithmetic, reduced in another order.
//! - Restarts exhausted: a supervisor allowed one restart, whose child is killed twice, exits
//!   with 137 (128 + SIGKILL) and says the restarts are spent; a child that fails at start-up
//!   (a bad flag) is not restarted at all.
//!
//! Needs the `train_gpt` example and the `kiln` command (`cargo test --workspace --release`
//! builds both); `KILN_TRAIN_GPT` and `KILN_BIN` name others.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::process::{
    self, assert_checkpoint_bytes_equal, checkpoint_dir, command, kiln, loss_bits, losses,
    train_gpt, TrainJob,
};
use kiln_testkit::{run_with_deadline, ProcessRun};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The tests share the two cores and the data cache: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const STEPS: u64 = 20;
const EVERY: u64 = 4;

/// The job: `tiny` as dp=2 x tp=2, ZeRO-1, fp16 with a moving loss scale, a checkpoint every
/// `EVERY` steps (all kept), synchronous saves and no console.
const JOB: TrainJob = TrainJob {
    steps: STEPS,
    ckpt_every: EVERY,
    warmup: 4,
    console: false,
};

fn work_dir(name: &str) -> PathBuf {
    process::work_dir(Path::new("kiln-supervisor").join(name))
}

/// The uninterrupted run, once for the tests that compare with it.
fn reference() -> &'static Path {
    static REFERENCE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    REFERENCE.get_or_init(|| {
        let out = work_dir("reference").join("run");
        let mut cmd = command(&train_gpt());
        cmd.args(JOB.args(&out, false));
        let run = run_with_deadline(cmd, Duration::from_secs(300));
        assert!(run.success(), "reference run: {}", run.output());
        println!("reference: {STEPS} steps in {:.1?}", run.elapsed);
        out
    })
}

/// `kiln supervise <flags> -- train_gpt <train args> <extra>`, with its events in `events`.
fn supervise(flags: &[&str], out: &Path, extra: &[&str]) -> Command {
    let mut cmd = command(&kiln());
    cmd.arg("supervise")
        .args(flags)
        .arg("--")
        .arg(train_gpt())
        .args(JOB.args(out, false))
        .args(extra);
    cmd
}

/// The supervisor's events (`<out>/supervise.jsonl`, beside the progress file).
fn events(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("supervise.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn named<'a>(ev: &'a [Value], name: &str) -> Vec<&'a Value> {
    ev.iter().filter(|e| e["event"] == name).collect()
}

/// Runs `cmd` while a watcher kills the supervised child of attempt `k` (its pid from the
/// `start` event) once `when[k](out)` holds; the supervisor's run.
fn run_killing(
    cmd: Command,
    out: &Path,
    when: &[&(dyn Fn(&Path) -> bool + Sync)],
) -> (ProcessRun, Vec<f64>) {
    std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let mut killed_at = Vec::new();
            let t = Instant::now();
            for (k, ready) in when.iter().enumerate() {
                let pid = loop {
                    assert!(t.elapsed() < Duration::from_secs(300), "no start {k}");
                    let ev = events(out);
                    let starts = named(&ev, "start");
                    if let Some(p) = starts.get(k).and_then(|e| e["pid"].as_u64()) {
                        if ready(out) {
                            break p;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(2));
                };
                let ok = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status()
                    .is_ok_and(|s| s.success());
                assert!(ok, "could not kill pid {pid}");
                killed_at.push(t.elapsed().as_secs_f64());
            }
            killed_at
        });
        let run = run_with_deadline(cmd, Duration::from_secs(300));
        (run, watcher.join().unwrap())
    })
}

fn committed(out: &Path, step: u64) -> bool {
    checkpoint_dir(out, step).is_dir()
}

/// Every committed checkpoint of `run` equals the reference's, file for file.
fn assert_same_checkpoints(reference: &Path, run: &Path) -> usize {
    (EVERY..=STEPS)
        .step_by(EVERY as usize)
        .map(|step| assert_checkpoint_bytes_equal(reference, run, step, "supervised run"))
        .sum()
}

/// The recovery times the supervisor recorded, with the first resumed step of each.
fn recoveries(ev: &[Value]) -> Vec<(u64, f64)> {
    named(ev, "recovered")
        .iter()
        .map(|e| {
            (
                e["step"].as_u64().unwrap(),
                e["recovery_s"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn two_kills_two_recoveries_and_the_run_ends_bitwise() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ref_out = reference();
    let out = work_dir("same-dp").join("run");

    // kill 1 inside step 9 (40 ms after the step-8 commit), kill 2 right after the step-16
    // commit of the relaunched run
    let after_8 = |o: &Path| {
        if committed(o, 8) {
            std::thread::sleep(Duration::from_millis(40));
            true
        } else {
            false
        }
    };
    let after_16 = |o: &Path| committed(o, 16);
    let t0 = Instant::now();
    let (run, killed_at) = run_killing(
        supervise(&["--max-restarts", "3"], &out, &[]),
        &out,
        &[&after_8, &after_16],
    );
    assert!(run.success(), "supervised run: {}", run.output());
    let ev = events(&out);
    assert_eq!(named(&ev, "start").len(), 3, "{ev:?}");
    let exits = named(&ev, "exit");
    assert_eq!(
        exits
            .iter()
            .map(|e| e["signal"].as_i64())
            .collect::<Vec<_>>(),
        [Some(9), Some(9), None]
    );
    assert_eq!(exits[2]["code"], 0);
    let rec = recoveries(&ev);
    assert_eq!(rec.len(), 2, "two recoveries: {ev:?}");
    for (step, secs) in &rec {
        assert!(*secs < 60.0, "recovery to step {step} took {secs} s");
    }
    assert_eq!(named(&ev, "done").len(), 1);
    assert!(
        run.stderr.contains("supervise: recovered")
            && run
                .stderr
                .contains("recovery times (crash to first resumed step)"),
        "{}",
        run.output()
    );
    // each relaunch resumed from the newest checkpoint committed at its kill
    assert!(run.stdout.contains("resumed from the step-16 checkpoint"));
    assert_eq!(rec[0].0, 9, "the first relaunch trains step 9 first");
    assert_eq!(rec[1].0, 17, "the second relaunch trains step 17 first");
    let ups: Vec<f64> = named(&ev, "up")
        .iter()
        .map(|e| e["since_crash_s"].as_f64().unwrap())
        .collect();

    // bitwise the uninterrupted run
    let files = assert_same_checkpoints(ref_out, &out);
    let want: BTreeMap<u64, u64> = loss_bits(ref_out).into_iter().collect();
    let got = losses(&out);
    for (s, l) in &got {
        assert_eq!(Some(&l.to_bits()), want.get(s), "loss of step {s}");
    }
    // a kill between a commit and the log's flush loses the records of the steps that
    // checkpoint covers (the log is flushed at each checkpoint's event): every step after the
    // last resume point must be there, and every record there must be the reference's
    let recorded: std::collections::BTreeSet<u64> = got.iter().map(|r| r.0).collect();
    assert!((17..=STEPS).all(|s| recorded.contains(&s)), "{recorded:?}");
    let lost: Vec<u64> = (1..=STEPS).filter(|s| !recorded.contains(s)).collect();
    println!(
        "killed the child at {:.1} s and {:.1} s; recovered at steps {} and {}: up (checkpoint \
         loaded, header written) {:.2} s and {:.2} s, first resumed step {:.2} s and {:.2} s \
         after the crash; {} losses and {files} checkpoint files bitwise equal to the \
         uninterrupted run (steps {lost:?} not in metrics.jsonl: logged by a killed process \
         but not flushed); supervised run {:.1} s",
        killed_at[0],
        killed_at[1],
        rec[0].0,
        rec[1].0,
        ups[0],
        ups[1],
        rec[0].1,
        rec[1].1,
        recorded.len(),
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn a_restart_at_a_smaller_dp_reshards_and_finishes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ref_out = reference();
    let out = work_dir("smaller-dp").join("run");
    let after_8 = |o: &Path| committed(o, 8);
    let flags = [
        "--max-restarts",
        "1",
        "--restart-dp",
        "1",
        "--restart-arg",
        "--accumulation",
        "--restart-arg",
        "2",
    ];
    let (run, _) = run_killing(supervise(&flags, &out, &[]), &out, &[&after_8]);
    assert!(run.success(), "supervised run: {}", run.output());
    let ev = events(&out);
    let restart = named(&ev, "restart");
    assert_eq!(restart.len(), 1);
    assert_eq!(restart[0]["dp"], 1);
    let start = named(&ev, "start");
    let cmd = start[1]["command"].as_array().unwrap();
    let tail: Vec<&str> = cmd[cmd.len() - 5..]
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(tail, ["--resume", "--dp", "1", "--accumulation", "2"]);
    assert!(
        run.stdout.contains("2 thread ranks as dp=1 x tp=2")
            && run.stdout.contains("resumed from the step-8 checkpoint"),
        "{}",
        run.output()
    );
    // the trainer reports the reshard: the dp=2 checkpoint loaded into dp=1
    let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let resumed = log
        .lines()
        .find(|l| l.contains("resumed from the checkpoint of step 8"))
        .unwrap();
    assert!(
        resumed.contains("saved as dp=2 tp=2") && !resumed.contains("differs"),
        "the same run configuration, another layout: {resumed}"
    );
    let rec = recoveries(&ev);
    assert_eq!(rec.len(), 1);
    assert!(rec[0].1 < 60.0, "recovery took {} s", rec[0].1);

    let want: BTreeMap<u64, f64> = losses(ref_out).into_iter().collect();
    let got: BTreeMap<u64, f64> = losses(&out).into_iter().collect();
    assert!((9..=STEPS).all(|s| got.contains_key(&s)), "{got:?}");
    let mut worst = 0.0f64;
    let mut bitwise = 0;
    for s in 9..=STEPS {
        let (g, w) = (got[&s], want[&s]);
        assert!(g.is_finite(), "step {s}: loss {g}");
        let rel = (g - w).abs() / w.abs();
        assert!(rel < 1e-3, "step {s}: loss {g} at dp=1 vs {w} at dp=2");
        worst = worst.max(rel);
        bitwise += usize::from(g.to_bits() == w.to_bits());
    }
    println!(
        "restart at dp=1 (from a dp=2 checkpoint of step 8): recovered at step {} {:.2} s after \
         the crash; losses of steps 9-{STEPS} within {worst:.2e} (relative) of the dp=2 run, \
         {bitwise} of {} bitwise; final loss {} vs {}",
        rec[0].0,
        rec[0].1,
        STEPS - 8,
        got[&STEPS],
        want[&STEPS]
    );
}

#[test]
fn restarts_run_out_and_start_up_errors_are_not_restarted() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let out = work_dir("exhausted").join("run");
    // kill each child as soon as it has written its header: the restart is spent on the
    // second
    let up = |o: &Path| o.join("metrics.jsonl").is_file();
    // (the relaunch finds no checkpoint and starts the log afresh: the supervisor's `up`)
    let up_again = |o: &Path| !named(&events(o), "up").is_empty();
    let (run, _) = run_killing(
        supervise(&["--max-restarts", "1"], &out, &[]),
        &out,
        &[&up, &up_again],
    );
    assert_eq!(
        run.status.and_then(|s| s.code()),
        Some(137),
        "{}",
        run.output()
    );
    assert!(
        run.stderr.contains(
            "supervise: error: the run ended with signal 9 (SIGKILL) and all 1 restart(s) are \
             spent (--max-restarts 1): giving up"
        ),
        "{}",
        run.output()
    );
    let ev = events(&out);
    assert_eq!(named(&ev, "start").len(), 2);
    assert_eq!(named(&ev, "gave_up").len(), 1);

    // a bad flag: train_gpt exits 1 before writing anything, which a restart would repeat
    let out = work_dir("bad-flag").join("run");
    let run = run_with_deadline(
        supervise(&["--max-restarts", "3"], &out, &["--stepz", "3"]),
        Duration::from_secs(60),
    );
    assert_eq!(
        run.status.and_then(|s| s.code()),
        Some(1),
        "{}",
        run.output()
    );
    assert!(
        run.stderr.contains("RunConfig.stepz") && run.stderr.contains("before writing anything"),
        "{}",
        run.output()
    );
    assert_eq!(named(&events(&out), "start").len(), 1, "not restarted");
    println!("exhausted restarts: exit status 137 and the message; a bad flag: not restarted");
}
