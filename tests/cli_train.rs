//! `kiln train` runs the main job exactly as the `train_gpt` example does: the same flags (the
//! process tests' job: the main job's corpora, quality filter, mixture and drift monitor with
//! the `tiny` model, dp=2 x tp=2, ZeRO-1, fp16 with a moving loss scale) give the same header
//! and bitwise the same loss at every step of `metrics.jsonl`, and the same checkpoint files,
//! byte for byte.
//!
//! Needs the `train_gpt` example and the `kiln` command (`cargo test --workspace --release`
//! builds both); `KILN_TRAIN_GPT` and `KILN_BIN` name others.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::process::{
    assert_checkpoint_bytes_equal, command, kiln, loss_bits, stdout_of, train_gpt, work_dir,
    TrainJob,
};

const JOB: TrainJob = TrainJob {
    steps: 6,
    ckpt_every: 6,
    warmup: 2,
    console: false,
};

#[test]
fn kiln_train_gives_the_losses_of_train_gpt_bitwise() {
    let root = work_dir("kiln-train-vs-train-gpt");
    let (a, b) = (root.join("train_gpt"), root.join("kiln_train"));
    let example = command(&train_gpt())
        .args(JOB.args(&a, false))
        .output()
        .unwrap();
    let example = stdout_of("train_gpt", example);
    let cli = command(&kiln())
        .arg("train")
        .args(JOB.args(&b, false))
        .output()
        .unwrap();
    let cli = stdout_of("kiln train", cli);
    // the same header: the run preset, the layout
    let head = |s: &str| s.lines().take(2).collect::<Vec<_>>().join("\n");
    assert_eq!(head(&cli), head(&example));
    assert!(head(&cli).starts_with("kiln train_gpt: "), "{cli}");
    assert!(
        cli.contains("dp=2 x tp=2 (sequence-parallel), ZeRO-1, f16"),
        "{cli}"
    );
    let (la, lb) = (loss_bits(&a), loss_bits(&b));
    assert_eq!(la.len(), JOB.steps as usize, "{la:?}");
    assert_eq!(la, lb, "kiln train's losses are train_gpt's, bit for bit");
    let files = assert_checkpoint_bytes_equal(&a, &b, JOB.steps, "kiln train");
    assert!(files > 1);
    println!(
        "kiln train and train_gpt: {} losses bitwise equal, {files} checkpoint files byte for byte",
        la.len()
    );
}
