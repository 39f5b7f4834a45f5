//! A run that does not resume refuses a checkpoint folder holding an earlier run's checkpoints
//! (a later `--resume` would pick up the wrong run), with an error naming the folder and the
//! way out; with `--resume` the same folder continues.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{test_dir, tiny_config};
use kiln_train::{run_threads, TrainError};

#[test]
fn a_fresh_run_refuses_an_earlier_runs_checkpoints() {
    let root = test_dir("fresh_run_guard");
    let mut cfg = tiny_config("fresh_run_guard", &root, "shakespeare_200k", 200_000);
    cfg.apply_overrides(&[("steps", "4"), ("warmup", "1"), ("ckpt_every", "2")])
        .unwrap();
    let first = run_threads(&cfg).unwrap();
    assert_eq!(first.checkpoints, vec![2, 4]);

    let err = run_threads(&cfg).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, TrainError::Config { .. }), "{msg}");
    assert!(msg.contains("RunConfig.checkpoint.resume"), "{msg}");
    assert!(msg.contains("newest of step 4"), "{msg}");
    assert!(
        msg.contains(&cfg.checkpoint_dir().display().to_string()),
        "{msg}"
    );
    assert!(msg.contains("--resume"), "{msg}");

    cfg.apply_overrides(&[("checkpoint.resume", "true"), ("steps", "6")])
        .unwrap();
    let resumed = run_threads(&cfg).unwrap();
    assert_eq!(resumed.resumed_from, Some(4));
    assert_eq!(resumed.steps, 6);
}
