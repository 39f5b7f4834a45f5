//! `kill -9` of the real `train_gpt` process, then `--resume` in the same output folder: the
//! run ends bitwise as the uninterrupted one, wherever the kill lands.
//!
//! The job: the `tiny` model as dp=2 x tp=2 thread ranks with ZeRO-1 and fp16 compute (so the
//! dynamic loss scaler's state, skipped steps included, must survive), a checkpoint every
//! `EVERY` steps, all kept. One uninterrupted run is the reference; then for each kill point
//! the job is started, SIGKILLed when an outside observer (polling files every millisecond,
//! no hook in the trainer) sees the point, and relaunched with `--resume`:
//! - (a) inside a step between checkpoints: the console line of step `m` on stderr;
//! - (b) inside a synchronous checkpoint write: as soon as `step-XXXXXXXX.tmp` appears;
//! - (c) inside an asynchronous save (`--checkpoint.async_save true`): as soon as a checkpoint
//!   step's `.tmp` folder is there while the console already shows that step;
//! - (d) right after a commit: as soon as the committed `step-XXXXXXXX` folder appears.
//!
//! After each kill the test reads where it really landed from what the dead process left (the
//! committed and `.tmp` checkpoint folders, the last console step line; the trainer prints a
//! step's line after that step's checkpoint call returns) and asserts it is the point's:
//! - (a): no `.tmp` folder, no checkpoint of a step after the last step line, which is at least
//!   `m` and before the end: the process was inside the next step;
//! - (b): the step's `.tmp` folder there, the step not committed, and the last step line the
//!   step before it: the loop was blocked inside the write;
//! - (c): the step's `.tmp` folder there and the step not committed while the console already
//!   shows that step or a later one: the loop had moved on while the save was being written,
//!   which only an asynchronous save does;
//! - (d): the step committed, no `.tmp` folder and no later checkpoint, and the last step line
//!   before the next checkpoint step.
//!
//! A kill can land late when the machine is busy: (b) makes `SYNC_TRIES` tries (two more while
//! fewer than `SYNC_MUST_LAND` landed) and needs `SYNC_MUST_LAND` inside; (c) tries again after
//! a miss, at most `ASYNC_TRIES` times, and needs one inside. After each kill the test then
//! checks that the relaunch resumed from the newest committed checkpoint at the moment of the
//! kill (never from the `.tmp`), that every committed checkpoint of the run equals the
//! reference's file for file, byte for byte, and that every step record in `metrics.jsonl` has
//! the reference's loss bit for bit.
//!
//! Needs `cargo build --release --example train_gpt` (`cargo test --workspace --release`
//! builds it); `KILN_TRAIN_GPT` names another binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::process::{
    assert_checkpoint_bytes_equal, checkpoint_dir, checkpoint_files, command, loss_bits, train_gpt,
    work_dir, TrainJob,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Steps of every run.
const STEPS: u64 = 12;
/// A checkpoint every this many steps.
const EVERY: u64 = 3;
/// Tries of the synchronous-write kill, and how many must land inside the write.
const SYNC_TRIES: usize = 3;
const SYNC_MUST_LAND: usize = 2;
/// At most this many tries of the asynchronous-save kill (one must land inside the save).
const ASYNC_TRIES: usize = 3;
/// A run that takes longer than this has hung.
const RUN_DEADLINE: Duration = Duration::from_secs(180);

/// The job: `tiny` as dp=2 x tp=2, ZeRO-1, fp16 with a moving loss scale, a checkpoint every
/// `EVERY` steps (all kept) and a console line per step on stderr.
const JOB: TrainJob = TrainJob {
    steps: STEPS,
    ckpt_every: EVERY,
    warmup: 3,
    console: true,
};

/// Starts the job with stdout and stderr in `<out>.<tag>.stdout` / `.stderr`.
fn start(out: &Path, async_save: bool, extra: &[&str], tag: &str) -> (Child, PathBuf, PathBuf) {
    let so = out.with_extension(format!("{tag}.stdout"));
    let se = out.with_extension(format!("{tag}.stderr"));
    let child = command(&train_gpt())
        .args(JOB.args(out, async_save))
        .args(extra)
        .stdout(Stdio::from(std::fs::File::create(&so).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&se).unwrap()))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", train_gpt().display()));
    (child, so, se)
}

fn logs(so: &Path, se: &Path) -> String {
    format!(
        "--- stdout\n{}\n--- stderr\n{}",
        std::fs::read_to_string(so).unwrap_or_default(),
        std::fs::read_to_string(se).unwrap_or_default()
    )
}

/// Runs the job to its end; its stdout.
fn run_to_end(out: &Path, async_save: bool, extra: &[&str], tag: &str) -> String {
    let (mut child, so, se) = start(out, async_save, extra, tag);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > RUN_DEADLINE {
            let _ = child.kill();
            panic!("{tag} run hung: {}", logs(&so, &se));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{tag} run: {status}\n{}", logs(&so, &se));
    std::fs::read_to_string(&so).unwrap()
}

fn tmp_dir(out: &Path, step: u64) -> PathBuf {
    out.join(format!("checkpoints/step-{step:08}.tmp"))
}

/// Committed and temporary checkpoint steps in the run's checkpoint folder.
fn checkpoint_steps(out: &Path) -> (Vec<u64>, Vec<u64>) {
    let (mut committed, mut tmp) = (Vec::new(), Vec::new());
    for e in std::fs::read_dir(out.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("step-") else {
            continue;
        };
        match rest.strip_suffix(".tmp") {
            Some(n) => tmp.extend(n.parse::<u64>().ok()),
            None => committed.extend(rest.parse::<u64>().ok()),
        }
    }
    committed.sort();
    tmp.sort();
    (committed, tmp)
}

/// The last `step N |` console line on stderr.
fn last_step_line(stderr: &Path) -> Option<u64> {
    std::fs::read_to_string(stderr)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("step ")?.split(' ').next()?.parse().ok())
        .max()
}

/// Every file of every committed checkpoint of `run` equals the reference's, byte for byte.
fn assert_checkpoints_equal(reference: &Path, run: &Path, what: &str) -> usize {
    let (committed, _) = checkpoint_steps(run);
    assert!(committed.contains(&STEPS), "{what}: no final checkpoint");
    let mut files = 0;
    for step in committed {
        let names = checkpoint_files(reference, step);
        assert_eq!(
            names,
            checkpoint_files(run, step),
            "{what}: the files of checkpoint {step}"
        );
        assert!(names.len() >= 5, "manifest and 4 rank files");
        files += assert_checkpoint_bytes_equal(reference, run, step, what);
    }
    files
}

/// Where a kill landed, seen from the files after the process was gone.
#[derive(Debug)]
struct Landing {
    /// Committed checkpoints.
    committed: Vec<u64>,
    /// `.tmp` folders left behind.
    tmp: Vec<u64>,
    /// The last step the console reported.
    last_step: Option<u64>,
    /// Milliseconds from seeing the point to the process's death.
    kill_ms: f64,
}

/// Starts the job, polls `point(out, stderr)` every millisecond, SIGKILLs the process when it
/// holds and reports where the kill landed; `None` if the run ended first.
fn kill_at(
    out: &Path,
    async_save: bool,
    layout: &[&str],
    tag: &str,
    point: &dyn Fn(&Path, &Path) -> bool,
) -> Option<Landing> {
    let (mut child, so, se) = start(out, async_save, layout, tag);
    let t = Instant::now();
    loop {
        if point(out, &se) {
            let seen = Instant::now();
            child.kill().unwrap();
            child.wait().unwrap();
            let (committed, tmp) = checkpoint_steps(out);
            return Some(Landing {
                committed,
                tmp,
                last_step: last_step_line(&se),
                kill_ms: seen.elapsed().as_secs_f64() * 1e3,
            });
        }
        if let Some(s) = child.try_wait().unwrap() {
            println!("{tag}: the run ended ({s}) before the kill point");
            return None;
        }
        assert!(
            t.elapsed() < RUN_DEADLINE,
            "{tag}: never reached its kill point: {}",
            logs(&so, &se)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Relaunches with `--resume` and checks the end against the reference; the resume point.
fn resume_and_check(
    reference: &Path,
    out: &Path,
    async_save: bool,
    layout: &[&str],
    landing: &Landing,
    tag: &str,
) {
    let args: Vec<&str> = layout.iter().copied().chain(["--resume"]).collect();
    let stdout = run_to_end(out, async_save, &args, &format!("{tag}.resume"));
    // no committed checkpoint yet: the relaunch starts from step 0 (and prints no resume line)
    let from: u64 = match stdout.split("resumed from the step-").nth(1) {
        Some(r) => r
            .split(' ')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{tag}: bad resume line in\n{stdout}")),
        None => 0,
    };
    assert_eq!(
        from,
        landing.committed.last().copied().unwrap_or(0),
        "{tag}: resumes from the newest committed checkpoint at the kill ({landing:?})"
    );
    let files = assert_checkpoints_equal(reference, out, tag);
    let want: BTreeMap<u64, u64> = loss_bits(reference).into_iter().collect();
    let got = loss_bits(out);
    for &(step, bits) in &got {
        assert_eq!(
            Some(&bits),
            want.get(&step),
            "{tag}: loss of step {step} ({} vs {:?})",
            f64::from_bits(bits),
            want.get(&step).map(|b| f64::from_bits(*b))
        );
    }
    // the relaunch appends one record per step after the resume point; records of those
    // steps before them were logged by the killed run (an async save's "staged" event flushes
    // the log before the commit) and have the same losses, checked above
    let steps: Vec<u64> = got.iter().map(|r| r.0).collect();
    let n = (STEPS - from) as usize;
    assert!(steps.len() >= n, "{tag}: records {steps:?}");
    assert_eq!(
        steps[steps.len() - n..],
        (from + 1..=STEPS).collect::<Vec<_>>(),
        "{tag}: the resumed run records every step after the resume point once"
    );
    let relogged: Vec<u64> = steps[..steps.len() - n]
        .iter()
        .copied()
        .filter(|&s| s > from)
        .collect();
    println!(
        "{tag}: resumed from step {from}; {n} losses after it and {files} checkpoint files \
         (steps {:?}) bitwise equal to the uninterrupted run{}",
        checkpoint_steps(out).0,
        if relogged.is_empty() {
            String::new()
        } else {
            format!(" (the killed run had logged steps {relogged:?} already, with the same losses)")
        }
    );
}

#[test]
fn kill_9_anywhere_then_resume_ends_bitwise_equal() {
    let t0 = Instant::now();
    let dir = work_dir("kiln-kill9-train-gpt");
    let reference = dir.join("reference");
    let stdout = run_to_end(&reference, false, &[], "reference");
    assert!(stdout.contains("dp=2 x tp=2"), "{stdout}");
    let records = loss_bits(&reference);
    assert_eq!(records.len() as u64, STEPS, "one record per step");
    let skipped = stdout
        .split("skipped steps: ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or("?")
        .to_string();
    println!(
        "reference: {STEPS} steps in {:.1?}, checkpoints {:?}, {skipped} steps skipped by the \
         fp16 loss scaler",
        t0.elapsed(),
        checkpoint_steps(&reference).0
    );

    let mut runs = 1;
    let mut points = 0;

    // (a) inside a step, between checkpoints: after the console shows step m
    let m = EVERY + EVERY / 2;
    let out = dir.join("a-step");
    let at_step = move |_: &Path, se: &Path| last_step_line(se).is_some_and(|s| s >= m);
    let l = kill_at(&out, false, &[], "(a) step", &at_step).expect("the kill point was reached");
    let inside = l.last_step.is_some_and(|s| {
        (m..STEPS).contains(&s) && l.tmp.is_empty() && l.committed.iter().all(|&c| c <= s)
    });
    report("(a) after step line", &l, inside);
    assert!(
        inside,
        "(a): the kill did not land inside a step after step {m} between checkpoints: {l:?}"
    );
    resume_and_check(&reference, &out, false, &[], &l, "(a) step");
    runs += 2;
    points += 1;

    // (b) inside a synchronous checkpoint write: the .tmp folder appeared
    let mut landed = 0;
    let mut tries = 0;
    for k in 0..SYNC_TRIES + 2 {
        if tries >= SYNC_TRIES && landed >= SYNC_MUST_LAND {
            break;
        }
        let step = EVERY * (1 + (k as u64 % (STEPS / EVERY - 1)));
        let out = dir.join(format!("b-sync-{k}"));
        let tag = format!("(b) sync write of step {step}, try {}", k + 1);
        let point = move |o: &Path, _: &Path| tmp_dir(o, step).exists();
        let l = kill_at(&out, false, &[], &tag, &point).expect("the kill point was reached");
        // a synchronous save runs before the step's console line: the loop waits in it
        let inside =
            l.tmp.contains(&step) && !l.committed.contains(&step) && l.last_step == Some(step - 1);
        landed += usize::from(inside);
        tries += 1;
        report(&tag, &l, inside);
        resume_and_check(&reference, &out, false, &[], &l, &tag);
        runs += 2;
    }
    points += 1;
    println!("(b): {landed} of {tries} tries landed inside the synchronous write");
    assert!(
        landed >= SYNC_MUST_LAND,
        "only {landed} of {tries} kills landed inside the synchronous checkpoint write"
    );

    // (c) inside an asynchronous save: the background writer's .tmp folder of a checkpoint
    // step is there while the console already shows that step (the loop went on)
    let mut async_landed = None;
    let mut async_tries = 0;
    while async_landed.is_none() && async_tries < ASYNC_TRIES {
        async_tries += 1;
        let out = dir.join(format!("c-async-{async_tries}"));
        let tag = format!("(c) async, try {async_tries}");
        let point = |o: &Path, se: &Path| {
            let (_, tmp) = checkpoint_steps(o);
            let shown = last_step_line(se).unwrap_or(0);
            tmp.iter().any(|&k| k <= shown)
        };
        let Some(l) = kill_at(&out, true, &[], &tag, &point) else {
            continue;
        };
        let inside = l.tmp.iter().any(|&k| {
            !l.committed.contains(&k) && k % EVERY == 0 && l.last_step.is_some_and(|s| s >= k)
        });
        report(&tag, &l, inside);
        resume_and_check(&reference, &out, true, &[], &l, &tag);
        runs += 2;
        if inside {
            async_landed = Some(l);
        }
    }
    assert!(
        async_landed.is_some(),
        "(c): none of {async_tries} kills landed inside an asynchronous save while the loop \
         went on"
    );
    points += 1;

    // (d) right after a commit: the committed folder appeared
    let step = 2 * EVERY;
    let out = dir.join("d-commit");
    let point = move |o: &Path, _: &Path| checkpoint_dir(o, step).exists();
    let l = kill_at(&out, false, &[], "(d) commit", &point).expect("the kill point was reached");
    let inside = l.committed.last() == Some(&step)
        && l.tmp.is_empty()
        && l.last_step.is_some_and(|s| s < step + EVERY);
    report(&format!("(d) after the commit of step {step}"), &l, inside);
    assert!(
        inside,
        "(d): the kill did not land right after the commit of step {step} (before the next \
         checkpoint's write): {l:?}"
    );
    resume_and_check(&reference, &out, false, &[], &l, "(d) commit");
    runs += 2;
    points += 1;

    println!(
        "summary: {points} kill points, each landed where it says, {runs} runs of train_gpt \
         (sync write tried {tries} times, {landed} inside; async save tried {async_tries} \
         times), all bitwise equal to the uninterrupted run, in {:.1?}",
        t0.elapsed()
    );
}

/// Prints where a kill landed against its point.
fn report(tag: &str, landing: &Landing, inside: bool) {
    println!(
        "{tag}: killed {:.1} ms after the point; committed {:?}, .tmp left {:?}, last step line \
         {:?}: {}",
        landing.kill_ms,
        landing.committed,
        landing.tmp,
        landing.last_step,
        if inside {
            "landed at the point"
        } else {
            "missed the point"
        }
    );
}

/// The same job as a pipeline: `tiny` as tp=2 x pp=2 (1F1B over 2 micro-batches per step),
/// ZeRO-1, fp16 with the moving loss scale, asynchronous saves. SIGKILLed inside a step between
/// checkpoints and inside an asynchronous save, then resumed: the losses and every checkpoint
/// file equal the uninterrupted pipeline run's, byte for byte.
#[test]
fn kill_9_of_a_pipeline_run_then_resume_ends_bitwise_equal() {
    let t0 = Instant::now();
    let layout = ["--dp", "1", "--tp", "2", "--pp", "2", "--accumulation", "2"];
    let dir = work_dir("kiln-kill9-train-gpt-pp2");
    let reference = dir.join("reference");
    let stdout = run_to_end(&reference, true, &layout, "pp2 reference");
    assert!(stdout.contains("x pp=2 (1f1b)"), "{stdout}");
    assert_eq!(
        loss_bits(&reference).len() as u64,
        STEPS,
        "one record per step"
    );

    // inside a step, between checkpoints, once a checkpoint is committed (the resume then
    // starts from it, not from step 0)
    let m = EVERY + EVERY / 2;
    let out = dir.join("a-step");
    let at_step = move |o: &Path, se: &Path| {
        last_step_line(se).is_some_and(|s| s >= m) && !checkpoint_steps(o).0.is_empty()
    };
    let l =
        kill_at(&out, true, &layout, "pp2 (a) step", &at_step).expect("the kill point was reached");
    let inside = l.last_step.is_some_and(|s| {
        (m..STEPS).contains(&s)
            && l.tmp.is_empty()
            && !l.committed.is_empty()
            && l.committed.iter().all(|&c| c <= s)
    });
    report("pp2 (a) after step line", &l, inside);
    assert!(
        inside,
        "pp2 (a): the kill did not land inside a step: {l:?}"
    );
    resume_and_check(&reference, &out, true, &layout, &l, "pp2 (a) step");

    // inside an asynchronous save while the loop went on
    let mut landed = None;
    for k in 1..=ASYNC_TRIES {
        let out = dir.join(format!("c-async-{k}"));
        let tag = format!("pp2 (c) async, try {k}");
        let point = |o: &Path, se: &Path| {
            let (_, tmp) = checkpoint_steps(o);
            let shown = last_step_line(se).unwrap_or(0);
            tmp.iter().any(|&s| s <= shown)
        };
        let Some(l) = kill_at(&out, true, &layout, &tag, &point) else {
            continue;
        };
        let inside = l.tmp.iter().any(|&s| {
            !l.committed.contains(&s) && s % EVERY == 0 && l.last_step.is_some_and(|x| x >= s)
        });
        report(&tag, &l, inside);
        resume_and_check(&reference, &out, true, &layout, &l, &tag);
        if inside {
            landed = Some(l);
            break;
        }
    }
    assert!(
        landed.is_some(),
        "pp2 (c): no kill landed inside an asynchronous save"
    );
    println!(
        "pp2 kill points landed where they say and resumed bitwise, in {:.1?}",
        t0.elapsed()
    );
}
