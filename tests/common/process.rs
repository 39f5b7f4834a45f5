//! Helpers of the tests that run the example binaries (`train_gpt`) and the `kiln` command as
//! child processes (`kill9_train_gpt.rs`, `supervisor.rs`, ...): finding the binaries, a fresh
//! work folder,
//! the `train_gpt` job they share, its committed checkpoints compared file by file, and the loss
//! records of its `metrics.jsonl`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (the tests run the binaries from there).
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `target/<profile>/examples/<name>`, beside this test's `deps/` folder, or the binary `var`
/// names.
pub fn example(name: &str, var: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(var) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    let p = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        p.is_file(),
        "{} is missing: build it first with `cargo build --release --example {name}`",
        p.display()
    );
    p
}

/// The `kiln` command (kiln-cli's binary), or the binary `KILN_BIN` names:
/// `target/<profile>/kiln`, which `cargo test --workspace` builds before any test runs (kiln-cli's
/// own tests need it). Where it is missing (a test run with `-p kiln`) it is built here, once per
/// test process (`cargo build --profile <profile> -p kiln-cli --bin kiln`).
pub fn kiln() -> PathBuf {
    if let Some(p) = std::env::var_os("KILN_BIN") {
        return PathBuf::from(p);
    }
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            // target/<profile>/deps/<this test>
            let exe = std::env::current_exe().unwrap();
            let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
            let p = profile_dir.join("kiln");
            if p.is_file() {
                return p;
            }
            let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
                Some("debug") => "dev".to_string(),
                Some(p) => p.to_string(),
                None => "release".to_string(),
            };
            println!("{} is missing: building it", p.display());
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let out = Command::new(&cargo)
                .current_dir(repo())
                .args([
                    "build",
                    "--profile",
                    &profile,
                    "-p",
                    "kiln-cli",
                    "--bin",
                    "kiln",
                ])
                .output()
                .unwrap_or_else(|e| panic!("cannot run {cargo:?} to build the kiln command: {e}"));
            assert!(
                out.status.success(),
                "{} is missing and `cargo build --profile {profile} -p kiln-cli --bin kiln` \
                 failed (build it, or set KILN_BIN to a kiln binary):\n{}",
                p.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(p.is_file(), "{} is missing after the build", p.display());
            p
        })
        .clone()
}

/// The `train_gpt` example (or the binary `KILN_TRAIN_GPT` names).
pub fn train_gpt() -> PathBuf {
    example("train_gpt", "KILN_TRAIN_GPT")
}

/// The stdout of a finished child, which must have succeeded (`what` names it in the failure,
/// with both streams).
pub fn stdout_of(what: &str, out: std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A command running `program` from the workspace root, without backtraces.
pub fn command(program: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir(repo()).env("RUST_BACKTRACE", "0");
    cmd
}

/// `rel` under the tests' temporary folder, emptied.
pub fn work_dir(rel: impl AsRef<Path>) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(rel);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The `train_gpt` job of the process tests: the main job (its corpora, quality filter,
/// mixture schedule and drift monitor) with the `tiny` model, context 32, dp=2 x tp=2, ZeRO-1,
/// fp16 with a loss scale that starts too high and grows every 3 clean steps (so steps are
/// skipped and the scale moves both ways), a checkpoint every `ckpt_every` steps (all kept), no
/// evaluation, TensorBoard or plot, and the data cache shared by the tests.
#[derive(Clone, Copy, Debug)]
pub struct TrainJob {
    pub steps: u64,
    pub ckpt_every: u64,
    pub warmup: u64,
    /// A console line per step on stderr (else no console).
    pub console: bool,
}

impl TrainJob {
    /// The flags of the job writing to `out`, with or without asynchronous checkpoint saves.
    pub fn args(&self, out: &Path, async_save: bool) -> Vec<String> {
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kiln-train-gpt-cache");
        let flags = [
            "--preset tiny --ctx 32 --dp 2 --tp 2 --zero 1 --precision f16",
            "--precision.scaler.init_scale 1048576 --precision.scaler.growth_interval 3",
            "--checkpoint.keep_last 0 --eval_every 0 --eval.at_end false",
            "--metrics.tensorboard false --metrics.png false",
        ];
        let mut a: Vec<String> = flags
            .iter()
            .flat_map(|f| f.split_whitespace())
            .map(String::from)
            .collect();
        a.extend(["--metrics.console".into(), self.console.to_string()]);
        if self.console {
            a.extend(["--metrics.console_every".into(), "1".into()]);
        }
        a.extend([
            "--warmup".into(),
            self.warmup.to_string(),
            "--ckpt_every".into(),
            self.ckpt_every.to_string(),
            "--steps".into(),
            self.steps.to_string(),
            "--checkpoint.async_save".into(),
            async_save.to_string(),
            "--out".into(),
            out.display().to_string(),
            "--cache_dir".into(),
            cache.display().to_string(),
        ]);
        a
    }
}

/// The committed checkpoint folder of `step` in the run folder `out`.
pub fn checkpoint_dir(out: &Path, step: u64) -> PathBuf {
    out.join(format!("checkpoints/step-{step:08}"))
}

/// The file names in the checkpoint of `step` in `out`, sorted.
pub fn checkpoint_files(out: &Path, step: u64) -> Vec<OsString> {
    let mut names: Vec<_> = std::fs::read_dir(checkpoint_dir(out, step))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    names
}

/// Every file of the reference's checkpoint of `step` equals the same file of `run`'s, byte
/// for byte (a file `run` lacks reads as empty); `what` names the run in the failure. The
/// number of files compared.
pub fn assert_checkpoint_bytes_equal(reference: &Path, run: &Path, step: u64, what: &str) -> usize {
    let (da, db) = (checkpoint_dir(reference, step), checkpoint_dir(run, step));
    let names = checkpoint_files(reference, step);
    for n in &names {
        let (x, y) = (
            std::fs::read(da.join(n)).unwrap(),
            std::fs::read(db.join(n)).unwrap_or_default(),
        );
        assert!(
            x == y,
            "{what}: checkpoint {step} file {} differs",
            n.to_string_lossy()
        );
    }
    names.len()
}

/// Every step record of `metrics.jsonl` in `out` (events left out) as (step, loss), in file
/// order.
pub fn losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            if v.get("event").is_some() {
                return None;
            }
            Some((v["step"].as_u64()?, v["loss"].as_f64()?))
        })
        .collect()
}

/// The same records as (step, loss bits).
pub fn loss_bits(out: &Path) -> Vec<(u64, u64)> {
    losses(out)
        .into_iter()
        .map(|(s, l)| (s, l.to_bits()))
        .collect()
}

/// kiln's logits from the checkpoint `ckpt` (a folder of checkpoints or one step) on
/// `n_ctx` fixed token ids, against those of the numpy model `script` (under `scripts/`,
/// called as `script DIR IDS OUT`) from the exported folder `export`: the largest difference,
/// which must be at most 1e-5 (`what` names the model in the message). `None` where python3
/// with numpy is missing outside CI (under `CI=true` that is a failure).
pub fn numpy_export_matches(what: &str, script: &str, ckpt: &Path, export: &Path) -> Option<f32> {
    use candle_core::{Device, Tensor};
    let p = kiln_train::Pretrained::load(ckpt).unwrap();
    let model = kiln_model::Gpt::new(&p.config, &kiln_model::GptOptions::seeded(0)).unwrap();
    p.load_into(&model).unwrap();
    let ids: Vec<u32> = (0..p.config.n_ctx as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(17) % p.config.vocab_size as u32)
        .collect();
    let tokens = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits: Vec<f32> = model
        .forward(&tokens)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let python = kiln_testkit::Python::require(&format!("the numpy {what} reference"), &["numpy"])?;
    let file = export.join("numpy_logits.f32");
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let path = repo().join("scripts").join(script);
    python.run(
        script,
        [
            path.as_os_str(),
            export.as_os_str(),
            std::ffi::OsStr::new(&list.join(",")),
            file.as_os_str(),
        ],
    );
    let reference: Vec<f32> = std::fs::read(&file)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(reference.len(), logits.len());
    let worst = logits
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!(
        "numpy {what} on the export vs kiln on the checkpoint: {} logits, largest |difference| {worst:.3e}",
        logits.len()
    );
    assert!(worst <= 1e-5, "{what}: logits differ by {worst:e}");
    Some(worst)
}
