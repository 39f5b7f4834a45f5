//! The hand-written loop of `examples/custom_loop.rs`, run as a real process:
//! - killed with SIGKILL after its step-20 checkpoint of 30 (dp=2, ZeRO-2, fp16) and relaunched
//!   with `--resume`, it ends bitwise equal to the uninterrupted run (every rank file of the
//!   step-30 checkpoint byte for byte, and the losses of the resumed steps);
//! - its dp=2 ZeRO-2 checkpoint of step 20 resumes at dp=1 and at dp=4 and reaches step 30
//!   within the tolerance of the trainer's resharding tests (1e-6 on every parameter, in f32
//!   with AdamW eps 1e-3; see `reshard.rs` for why).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use kiln_ckpt::{CheckpointConfig, Checkpointer, Layout, LocalFs, ReshardRequest, Want, ZeroStage};
use kiln_testkit::{run_with_deadline, ProcessRun};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn example() -> PathBuf {
    common::process::example("custom_loop", "KILN_CUSTOM_LOOP")
}

fn dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("custom-loop")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn command(out: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(example());
    c.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .args(["--out", out.to_str().unwrap(), "--every", "5"])
        .args(args)
        .env(
            "KILN_DATA_CACHE",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("custom-loop-cache"),
        );
    c
}

fn run(out: &Path, args: &[&str]) -> ProcessRun {
    let r = run_with_deadline(command(out, args), Duration::from_secs(600));
    assert!(r.success(), "{args:?}: {}", r.output());
    r
}

/// step -> loss bits, from the JSONL metrics.
fn losses(out: &Path) -> BTreeMap<u64, u64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((v["step"].as_u64()?, v["loss"].as_f64()?.to_bits()))
        })
        .collect()
}

fn step_dir(out: &Path, step: u64) -> PathBuf {
    out.join(format!("checkpoints/step-{step:08}"))
}

/// Every parameter of the engine at `step`, whole: the checkpoint read as one rank (kiln-ckpt
/// assembles each tensor from every rank's shard).
fn params(out: &Path, step: u64) -> BTreeMap<String, Vec<f32>> {
    let comm = kiln_comm::ThreadComm::group(1, Default::default())
        .unwrap()
        .remove(0);
    let layout = Layout::new(1, 1, ZeroStage::Replicated).unwrap();
    let storage = Arc::new(LocalFs::new(out.join("checkpoints")).unwrap());
    let ck = Checkpointer::new(storage, CheckpointConfig::new(layout, "gpt-tiny")).unwrap();
    let req = ReshardRequest::new(layout).part("engine", Want::Full);
    let mut st = ck.load_resharded(&comm, step, &req).unwrap().state;
    let sd = st.take_part("engine").unwrap();
    sd.iter()
        .filter(|(n, _)| n.starts_with("param/"))
        .map(|(n, t)| (n.to_string(), t.to_vec::<f32>().unwrap()))
        .collect()
}

#[test]
fn killed_at_step_20_and_resumed_ends_bitwise_equal() {
    let (a, b) = (dir("uninterrupted"), dir("killed"));
    run(&a, &[]);
    // kill -9 the loop once its step-20 checkpoint is committed
    let mut child = command(&b, &[])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !step_dir(&b, 20).join("manifest.json").is_file() {
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "no step-20 checkpoint"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before the kill"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Command::new("kill")
        .args(["-KILL", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "killed: {status:?}");
    assert!(!step_dir(&b, 30).exists(), "the run ended before the kill");
    let r = run(&b, &["--resume"]);
    let from: u64 = r
        .stdout
        .split("steps ")
        .nth(1)
        .and_then(|s| s.split("..").next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (20..30).contains(&from),
        "resumed from {from}: {}",
        r.output()
    );
    for f in std::fs::read_dir(step_dir(&a, 30)).unwrap() {
        let name = f.unwrap().file_name();
        let (x, y) = (
            std::fs::read(step_dir(&a, 30).join(&name)).unwrap(),
            std::fs::read(step_dir(&b, 30).join(&name)).unwrap(),
        );
        assert!(x == y, "{name:?} differs after the resume");
    }
    let (la, lb) = (losses(&a), losses(&b));
    for s in from + 1..=30 {
        assert_eq!(la.get(&s), lb.get(&s), "loss of step {s}");
    }
}

#[test]
fn a_dp2_zero2_checkpoint_continues_at_dp1_and_dp4() {
    let f32_args = ["--f32", "--optimizer", r#"{"type": "adamw", "eps": 1e-3}"#];
    let base = dir("reshard-base");
    run(
        &base,
        &[&f32_args[..], &["--dp", "2", "--zero", "2"]].concat(),
    );
    let want = params(&base, 30);
    for dp in ["1", "4"] {
        let out = dir(&format!("reshard-dp{dp}"));
        std::fs::create_dir_all(step_dir(&out, 20)).unwrap();
        for f in std::fs::read_dir(step_dir(&base, 20)).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), step_dir(&out, 20).join(f.file_name())).unwrap();
        }
        let r = run(
            &out,
            &[&f32_args[..], &["--dp", dp, "--zero", "2", "--resume"]].concat(),
        );
        assert!(r.stdout.contains("steps 20..30"), "{}", r.output());
        let got = params(&out, 30);
        assert_eq!(got.len(), want.len());
        let mut worst = 0.0f64;
        for (name, w) in &want {
            assert_eq!(got[name].len(), w.len(), "{name}: length");
            for (x, y) in got[name].iter().zip(w) {
                worst = worst.max((*x as f64 - *y as f64).abs());
            }
        }
        println!("dp=2 ZeRO-2 -> dp={dp}: largest parameter difference at step 30: {worst:e}");
        assert!(worst <= 1e-6, "dp={dp}: {worst:e}");
    }
}
