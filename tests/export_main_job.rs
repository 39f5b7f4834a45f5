//! The main job's checkpoint out of kiln, through the binaries a user runs: `train_gpt` (its
//! preset: `small_cpu`, dp=2 x tp=2 with sequence parallelism, ZeRO-1, fp16, activation
//! checkpointing; only shortened to 6 steps without evaluation), then
//! `kiln export-hf runs/.../checkpoints/latest OUT`. An independent GPT-2 in numpy
//! (`scripts/gpt2_numpy_forward.py`) computes, from the exported files alone, the logits kiln
//! computes from the checkpoint, within 1e-5; `kiln sample --greedy` prints the same
//! continuation from the checkpoint and from the export.
//!
//! Needs the `train_gpt` example and the `kiln` command (`cargo test --workspace --release`
//! builds both) and python3 with numpy (CI installs it, and its absence fails under
//! `CI=true`; elsewhere the numpy part is skipped with a message).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::process::{command, kiln, stdout_of, train_gpt, work_dir};
use std::path::Path;

/// The `ids:` line of `kiln sample --greedy --ids` on `model`.
fn greedy_ids(model: &Path) -> String {
    let out = command(&kiln())
        .arg("sample")
        .arg(model)
        .args([
            "--greedy",
            "--ids",
            "--max-tokens",
            "24",
            "--prompt",
            "ROMEO:\nBut soft",
        ])
        .output()
        .unwrap();
    let stdout = stdout_of("kiln sample", out);
    stdout
        .lines()
        .find(|l| l.starts_with("ids:"))
        .unwrap_or_else(|| panic!("no ids: line in\n{stdout}"))
        .to_string()
}

#[test]
fn the_main_jobs_export_is_gpt2_to_numpy() {
    let root = work_dir("export-main-job");
    let out = root.join("run");
    // the README snippet test prepares the same corpus (vocabulary 8192) into this cache
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("readme-data-cache");
    let flags = "--steps 6 --ckpt_every 6 --warmup 2 --eval_every 0 --eval.at_end false \
                 --metrics.tensorboard false --metrics.png false";
    let run = command(&train_gpt())
        .args(flags.split_whitespace())
        .arg("--out")
        .arg(&out)
        .arg("--cache_dir")
        .arg(&cache)
        .output()
        .unwrap();
    let stdout = stdout_of("train_gpt", run);
    assert!(
        stdout.contains("dp=2 x tp=2 (sequence-parallel), ZeRO-1, f16"),
        "{stdout}"
    );

    let latest = out.join("checkpoints/latest");
    let export = root.join("hf");
    let ex = command(&kiln())
        .arg("export-hf")
        .arg(&latest)
        .arg(&export)
        .output()
        .unwrap();
    let printed = stdout_of("kiln export-hf", ex);
    println!("{printed}");
    assert!(
        printed.contains("step 6") && printed.contains("dp=2 tp=2 zero=1"),
        "{printed}"
    );
    for f in ["model.safetensors", "config.json", "tokenizer.json"] {
        assert!(export.join(f).is_file(), "{f} missing: {printed}");
    }

    // kiln's logits from the checkpoint; the numpy GPT-2's from the export
    common::process::numpy_export_matches("GPT-2", "gpt2_numpy_forward.py", &latest, &export);

    // the same greedy continuation from the checkpoint and from its export
    let a = greedy_ids(&out.join("checkpoints"));
    let b = greedy_ids(&export);
    assert_eq!(a, b);
    println!("greedy sample from the checkpoint and from the export: {a}");
}
