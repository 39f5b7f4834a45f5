//! Every benchmark answers `--help` with its flags (clap), and refuses an unknown flag naming
//! it, without running anything.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

#[test]
fn every_benchmark_lists_its_flags() {
    let benches: [(&str, &str, &[&str]); 10] = [
        (
            "bench_recompute",
            env!("CARGO_BIN_EXE_bench_recompute"),
            &["--batch", "--layers", "--reps"],
        ),
        (
            "bench_ckpt",
            env!("CARGO_BIN_EXE_bench_ckpt"),
            &["--params", "--reps", "--compute-passes"],
        ),
        (
            "bench_comm",
            env!("CARGO_BIN_EXE_bench_comm"),
            &["--quick", "--backend", "--stage-kib"],
        ),
        (
            "bench_data",
            env!("CARGO_BIN_EXE_bench_data"),
            &["--out", "--paced-batches"],
        ),
        (
            "bench_gemm",
            env!("CARGO_BIN_EXE_bench_gemm"),
            &["--dtype", "--shape"],
        ),
        (
            "bench_model",
            env!("CARGO_BIN_EXE_bench_model"),
            &["--steps", "--only"],
        ),
        (
            "bench_monitor",
            env!("CARGO_BIN_EXE_bench_monitor"),
            &["--help"],
        ),
        (
            "bench_optim",
            env!("CARGO_BIN_EXE_bench_optim"),
            &["PARAMS"],
        ),
        (
            "bench_parallel",
            env!("CARGO_BIN_EXE_bench_parallel"),
            &["--steps", "--preset", "--dtype", "--only"],
        ),
        (
            "bench_train",
            env!("CARGO_BIN_EXE_bench_train"),
            &[
                "--arch",
                "--preset",
                "--d-model",
                "--layers",
                "--heads",
                "--kv-heads",
                "--ffn",
                "--ctx",
                "--vocab",
                "--batch",
                "--dtype",
                "--dp",
                "--tp",
                "--zero",
                "--recompute",
                "--steps",
                "--lr",
                "--bare-candle",
                "--sequence-parallel",
            ],
        ),
    ];
    for (name, exe, flags) in benches {
        let out = Command::new(exe).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name} --help: {}", out.status);
        assert!(help.contains(&format!("Usage: {name}")), "{name}:\n{help}");
        for f in flags {
            assert!(help.contains(f), "{name} --help lacks {f}:\n{help}");
        }
        let out = Command::new(exe).arg("--no-such-flag").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains("--no-such-flag"), "{name}: {err}");
    }
}
