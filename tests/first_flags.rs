//! The first flags a user gives `train_gpt`, through the binary: `--preset tiny --steps 3`
//! trains (the tiny model brings its context of 64 in place of the main job's 128, and the
//! warmup of 20 steps is capped at the run's 3, said once), the run states the basis of its
//! MFU, and a context the model cannot take is an error naming the field.
//!
//! Needs the `train_gpt` example (`cargo test --workspace --release` builds it).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::process::{command, train_gpt, work_dir};
use std::path::Path;

#[test]
fn preset_tiny_for_three_steps_trains_and_says_what_it_changed() {
    let out = work_dir("first-flags");
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kiln-train-gpt-cache");
    let quiet = "--eval.at_end false --metrics.tensorboard false --metrics.png false";
    let run = |flags: &str| {
        command(&train_gpt())
            .args(flags.split_whitespace())
            .args(quiet.split_whitespace())
            .arg("--out")
            .arg(&out)
            .arg("--cache_dir")
            .arg(&cache)
            .output()
            .unwrap()
    };
    let o = run("--preset tiny --steps 3");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        o.status.success(),
        "train_gpt --preset tiny --steps 3 failed:\n{stdout}\n{stderr}"
    );
    // the tiny model (2 layers, d_model 128) at its own context
    assert!(
        stdout.contains("(2 layers, d_model 128, 4 heads, ctx 64, vocab 512"),
        "{stdout}"
    );
    assert!(stdout.contains("done: 3 steps"), "{stdout}");
    // the capped warmup, said once on the console (stderr)
    let note = "optim.schedule.warmup_steps 20 is longer than the run's 3 steps: warming up \
                over all 3";
    assert_eq!(stderr.matches(note).count(), 1, "{stderr}");
    // the MFU's basis: this CPU's f16 peak, or why there is none
    let basis = stderr
        .lines()
        .find(|l| {
            l.contains("mfu: model FLOPs per second over the") || l.contains("mfu not reported")
        })
        .unwrap_or_else(|| panic!("no mfu basis in\n{stderr}"));
    if basis.contains("over the") {
        assert!(
            basis.contains(" f16 peak: ") && basis.contains(" GHz x "),
            "{basis}"
        );
        assert!(stdout.contains("at the last step, of the "), "{stdout}");
    }

    // an explicit context the model cannot take stays an error naming the field
    let o = run("--preset tiny --ctx 128 --steps 3");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("RunConfig.train.seq_len: must be in 1..=64 (the model's n_ctx), got 128"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&out).unwrap();
}
