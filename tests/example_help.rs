//! Every example answers `--help` with its flags (clap), and refuses an unknown flag naming it,
//! without training. The examples are built by `cargo test` (`KILN_<NAME>` names another
//! binary).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::process::{command, example};

#[test]
fn every_example_lists_its_flags() {
    let examples: [(&str, &[&str]); 9] = [
        (
            "train_gpt",
            &[
                "--config",
                "--steps",
                "--dp",
                "--tp",
                "--zero",
                "--precision",
                "--resume",
                "--section.field",
            ],
        ),
        ("train_gpt_tp", &["--steps", "--tp"]),
        ("train_llama", &["--steps", "--tp", "--zero", "--precision"]),
        ("train_gpt_zero3", &["--steps", "--zero"]),
        (
            "custom_loop",
            &[
                "--dp",
                "--zero",
                "--steps",
                "--every",
                "--optimizer",
                "--out",
                "--resume",
                "--f32",
            ],
        ),
        (
            "finetune_lora",
            &[
                "--from",
                "--pretrain-steps",
                "--steps",
                "--dp",
                "--tp",
                "--rank",
                "--lr",
                "--out",
                "--resume",
            ],
        ),
        (
            "dpo",
            &[
                "--dp",
                "--tp",
                "--zero",
                "--steps",
                "--reward-steps",
                "--beta",
                "--lr",
                "--out",
                "--resume",
            ],
        ),
        (
            "qat",
            &[
                "--from",
                "--pretrain-steps",
                "--steps",
                "--dp",
                "--lr",
                "--out",
            ],
        ),
        ("monitor_run", &["OUT_DIR"]),
    ];
    for (name, flags) in examples {
        let exe = example(name, &format!("KILN_{}", name.to_uppercase()));
        let out = command(&exe).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name} --help: {}", out.status);
        assert!(help.contains(&format!("Usage: {name}")), "{name}:\n{help}");
        for f in flags {
            assert!(help.contains(f), "{name} --help lacks {f}:\n{help}");
        }
        // the training examples take any `--section.field` and refuse an unknown one later
        if !name.starts_with("train_") {
            let out = command(&exe).arg("--no-such-flag").output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{name}: {err}");
            assert!(err.contains("--no-such-flag"), "{name}: {err}");
        }
    }
}
