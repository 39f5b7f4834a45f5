//! `bench_parallel`'s pipeline rows: `--only` names them (and refuses a name it does not have,
//! listing them), and one timed step of GPipe, 1F1B and ZB-H1 at pp=2 on the `tiny` preset
//! prints a line whose measured micro-batches in flight are the theory's (GPipe holds all `m`
//! on every rank, 1F1B `min(p - r, m)` on rank `r`, ZB-H1 `min(p, m)`), equal to the
//! schedule's own count, with a bubble between 0 and 1 and each rank's peak activation memory
//! its in-flight count times its stage's bytes per micro-batch.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_bench_parallel");

#[test]
fn only_names_the_pipeline_rows_and_refuses_others() {
    let out = Command::new(EXE).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for name in ["pp2_gpipe", "pp2_1f1b", "pp2_interleaved", "pp2_zb_h1"] {
        assert!(help.contains(name), "--help lacks {name}:\n{help}");
    }
    let out = Command::new(EXE)
        .args(["--only", "pp3_nothing"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("pp3_nothing") && err.contains("pp2_1f1b"),
        "{err}"
    );
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|x| {
            x.as_f64()
                .or_else(|| x.as_str().and_then(|s| s.parse().ok()))
                .unwrap()
        })
        .collect()
}

#[test]
fn pipeline_rows_hold_the_micro_batches_theory_gives() {
    let (p, m) = (2usize, 8usize);
    let theory: [(&str, Vec<usize>); 3] = [
        ("pp2_gpipe", vec![m; p]),
        ("pp2_1f1b", (0..p).map(|r| (p - r).min(m)).collect()),
        ("pp2_zb_h1", vec![p.min(m); p]),
    ];
    for (name, want) in theory {
        let out = Command::new(EXE)
            .args(["--preset", "tiny", "--steps", "1", "--only", name])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{name}: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find(|l| l.contains(&format!("\"config\":\"{name}\"")))
            .unwrap_or_else(|| panic!("{name}: no line in\n{stdout}"));
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        let got: Vec<usize> = floats(&row["peak_in_flight"])
            .iter()
            .map(|&x| x as usize)
            .collect();
        let schedule: Vec<usize> = floats(&row["peak_in_flight_schedule"])
            .iter()
            .map(|&x| x as usize)
            .collect();
        assert_eq!(got, want, "{name}: measured in flight against theory");
        assert_eq!(
            schedule, want,
            "{name}: the schedule's count against theory"
        );
        let bubble = row["bubble_measured"].as_f64().unwrap();
        assert!((0.0..1.0).contains(&bubble), "{name}: bubble {bubble}");
        let per_mb = floats(&row["stage_activation_mib_per_micro_batch"]);
        let peak = floats(&row["peak_activation_mib"]);
        for r in 0..p {
            assert!(per_mb[r] > 0.0, "{name}: stage {r} holds no activations");
            // printed with 2 decimals
            let expect = per_mb[r] * want[r] as f64;
            assert!(
                (peak[r] - expect).abs() <= 0.01 * want[r] as f64,
                "{name}: rank {r} peak {} MiB, {} in flight x {} MiB",
                peak[r],
                want[r],
                per_mb[r]
            );
        }
    }
}
