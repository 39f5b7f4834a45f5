//! Every subcommand of the `kiln` binary, run once as a user runs it, on small real inputs:
//!
//! - `--help` on the command and on each subcommand lists its flags and names only presets
//!   kiln-model knows; a wrong flag is a usage error (exit code 2) naming it;
//! - `kiln train --run tiny` trains 8 steps and writes finite losses and a checkpoint;
//!   `--print-config` prints the configuration it would train, which reads back as that run;
//! - `kiln export-hf` writes the checkpoint as a GPT-2 folder whose `config.json` has the
//!   model's sizes and whose tensors are the checkpoint's, value for value;
//! - `kiln import-hf` starts a run from that folder: its first loss is the trained model's on
//!   the first batch, below the first loss of the run that started from scratch; a Llama with
//!   Llama 3.1's rotary scaling goes out and back in with its `rope_scaling`;
//! - `kiln sample --greedy --ids` prints the ids `kiln_model::generate` gives in this process;
//! - `kiln evaluate` prints the cross-entropy a log-softmax in f64 computes here;
//! - `kiln plan-memory` prints ZeRO's 2 + 2 + 12 bytes per parameter;
//! - `kiln plan-pipeline` prints each rank's timeline, the bubble fraction of the closed form
//!   ((p-1)/(m+p-1) for 1F1B, (p-1)/(3m+p-1) for ZB-H1) and 1F1B's p - rank activations in
//!   flight, writes a PNG of the size it says, and names the rule a bad shape breaks;
//! - `kiln prepare-data` trains a tokenizer of the asked size and writes shards holding the
//!   tokens it says, then finds them in place;
//! - `kiln launch` gives each process its rank and one shared rendezvous token, and names a
//!   failing rank; `kiln supervise` restarts a killed command with `--resume`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor};
use kiln_model::{generate, Gpt, GptOptions, Sampling};
use kiln_train::{Pretrained, RunConfig};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn kiln() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    // the repository root: `data/` is the default corpus folder
    c.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
        .env("RUST_BACKTRACE", "0")
        .env_remove("KILN_STORE_TOKEN");
    c
}

fn tmp(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kiln-cli")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    println!(
        "{:?} -> {}\n{}",
        cmd.get_args().collect::<Vec<_>>(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or_default()
    );
    out
}

fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{:?} failed: {}\n--- stdout\n{}\n--- stderr\n{}",
        cmd.get_args().collect::<Vec<_>>(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `(step, loss)` of every step record of a run's `metrics.jsonl`.
fn losses(out: &Path) -> Vec<(u64, f64)> {
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

/// The flags of the small runs here: no evaluation, TensorBoard, plot or console; the data
/// cache shared by the tests.
fn quiet(cmd: &mut Command) -> &mut Command {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kiln-cli-data-cache");
    cmd.args(["--eval_every", "0", "--eval.at_end", "false"])
        .args(["--metrics.tensorboard", "false", "--metrics.png", "false"])
        .args(["--metrics.console", "false", "--cache_dir"])
        .arg(cache)
}

/// The run every model subcommand reads: `kiln train --run tiny`, 8 steps, one checkpoint.
struct Trained {
    out: PathBuf,
    stdout: String,
}

const STEPS: u64 = 8;

fn trained() -> &'static Trained {
    static T: OnceLock<Trained> = OnceLock::new();
    T.get_or_init(|| {
        let out = tmp("train");
        let mut cmd = kiln();
        cmd.args([
            "train",
            "--run",
            "tiny",
            "--steps",
            &STEPS.to_string(),
            "--out",
        ])
        .arg(&out);
        quiet(&mut cmd).args([
            "--ckpt_every",
            &STEPS.to_string(),
            "--lr",
            "3e-3",
            "--warmup",
            "2",
        ]);
        let stdout = ok(&mut cmd);
        Trained { out, stdout }
    })
}

#[test]
fn help_lists_every_subcommand_and_its_flags() {
    let top = ok(kiln().arg("--help"));
    let subs: [(&str, &[&str]); 10] = [
        (
            "train",
            &[
                "--run",
                "--config",
                "--steps",
                "--dp",
                "--tp",
                "--zero",
                "--precision",
                "--resume",
                "--print-config",
                "--section.field",
            ],
        ),
        (
            "launch",
            &[
                "--nproc-per-node",
                "--nnodes",
                "--node-rank",
                "--master-addr",
                "--master-port",
                "--store-token",
            ],
        ),
        (
            "supervise",
            &[
                "--max-restarts",
                "--restart-dp",
                "--restart-arg",
                "--progress",
                "--events",
            ],
        ),
        ("export-hf", &["CHECKPOINT", "OUT", "--tokenizer"]),
        ("import-hf", &["HF_DIR", "--run", "--steps", "--tp"]),
        (
            "sample",
            &[
                "MODEL",
                "--prompt",
                "--max-tokens",
                "--greedy",
                "--temperature",
                "--top-k",
                "--seed",
                "--ids",
                "--device",
            ],
        ),
        (
            "evaluate",
            &["MODEL", "--text", "--max-tokens", "--batch", "--tokenizer"],
        ),
        (
            "plan-memory",
            &[
                "PRESET",
                "--dp",
                "--tp",
                "--micro-batch",
                "--precision",
                "--sequence-parallel",
            ],
        ),
        (
            "plan-pipeline",
            &[
                "--pp",
                "--micro-batches",
                "--schedule",
                "--virtual-stages",
                "--png",
                "--forward-cost",
                "--backward-cost",
                "--weight-cost",
                "--p2p-cost",
                "gpipe, 1f1b, interleaved or zb_h1",
            ],
        ),
        ("prepare-data", &["--out", "--data", "--vocab", "--shards"]),
    ];
    for (sub, flags) in subs {
        assert!(top.contains(sub), "kiln --help lacks {sub}:\n{top}");
        let help = ok(kiln().args([sub, "--help"]));
        for f in flags {
            assert!(help.contains(f), "kiln {sub} --help lacks {f}:\n{help}");
        }
        // every preset the help names is one the model knows
        if let Some(line) = help.lines().find(|l| l.contains("--preset")) {
            let named = line.split_once('(').unwrap().1.split_once(')').unwrap().0;
            let names: Vec<&str> = named
                .split([',', ' '])
                .filter(|n| !n.is_empty() && *n != "...")
                .collect();
            assert!(names.len() >= 3, "kiln {sub}: {line}");
            for n in names {
                assert!(
                    kiln_model::GptConfig::by_name(n).is_ok(),
                    "kiln {sub} --help names the preset {n}, which kiln-model does not know"
                );
            }
        }
    }
    // usage errors name the flag and exit with 2
    for args in [
        &["sample", "m", "--frobnicate"][..],
        &["plan-memory", "--dp", "many"],
        &["plan-pipeline", "--schedule", "pipedream"],
        &["launch", "--nproc-per-node", "0", "--", "true"],
        &["train", "--run", "no_such_run"],
    ] {
        let out = run(kiln().args(args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        let named = args.iter().any(|a| a.starts_with("--") && err.contains(a));
        assert!(named || err.contains("no_such_run"), "{args:?}: {err}");
    }
}

#[test]
fn train_writes_finite_losses_a_checkpoint_and_its_configuration() {
    let t = trained();
    assert!(
        t.stdout.starts_with("kiln tiny: GPT-3 architecture"),
        "{}",
        t.stdout
    );
    assert!(
        t.stdout.contains(&format!("done: {STEPS} steps")),
        "{}",
        t.stdout
    );
    assert!(t.stdout.contains("sample (top-k 40, temperature 0.8):"));
    let l = losses(&t.out);
    assert_eq!(
        l.iter().map(|s| s.0).collect::<Vec<_>>(),
        (1..=STEPS).collect::<Vec<_>>()
    );
    assert!(l.iter().all(|s| s.1.is_finite()), "{l:?}");
    assert!(
        l[0].1 > 5.5 && l[0].1 < 7.0,
        "a fresh model of 512 ids: {l:?}"
    );
    assert!(t.out.join(format!("checkpoints/step-{STEPS:08}")).is_dir());

    // --print-config: the run it would train, as TOML that reads back as that run
    let mut cmd = kiln();
    cmd.args([
        "train",
        "--run",
        "tiny",
        "--steps",
        "5",
        "--dp",
        "2",
        "--print-config",
    ])
    .args(["--optim.schedule.min_lr", "1e-5"]);
    let toml = ok(&mut cmd);
    let cfg = RunConfig::from_toml_str(&toml).unwrap();
    let mut want = RunConfig::preset("tiny").unwrap();
    want.apply_overrides(&[
        ("steps", "5"),
        ("dp", "2"),
        ("optim.schedule.min_lr", "1e-5"),
    ])
    .unwrap();
    assert_eq!(
        cfg.to_toml_string().unwrap(),
        want.to_toml_string().unwrap()
    );
}

#[test]
fn export_hf_writes_the_checkpoints_tensors() {
    let t = trained();
    let export = tmp("export");
    let ckpt = t.out.join("checkpoints/latest");
    let printed = ok(kiln().arg("export-hf").arg(&ckpt).arg(&export));
    assert!(printed.contains(&format!("step {STEPS}")), "{printed}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
            .unwrap();
    let from_ckpt = Pretrained::load(&ckpt).unwrap();
    let c = &from_ckpt.config;
    for (key, want) in [
        ("n_layer", c.n_layers),
        ("n_embd", c.d_model),
        ("n_head", c.n_heads),
        ("n_positions", c.n_ctx),
        ("vocab_size", c.vocab_size),
    ] {
        assert_eq!(config[key].as_u64(), Some(want as u64), "{key}: {config}");
    }
    // the export read back holds the checkpoint's weights, value for value
    let from_export = Pretrained::load(&export).unwrap();
    let (a, b) = (
        Gpt::new(c, &GptOptions::seeded(1)).unwrap(),
        Gpt::new(c, &GptOptions::seeded(2)).unwrap(),
    );
    from_ckpt.load_into(&a).unwrap();
    from_export.load_into(&b).unwrap();
    let x = Tensor::new(&[[1u32, 5, 9, 200, 3, 77]], &Device::Cpu).unwrap();
    let (la, lb) = (a.forward(&x).unwrap(), b.forward(&x).unwrap());
    let diff = (la - lb)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0, "the export's logits are the checkpoint's");
}

#[test]
fn import_hf_starts_from_the_folders_weights() {
    let t = trained();
    let export = tmp("import-src");
    ok(kiln()
        .arg("export-hf")
        .arg(t.out.join("checkpoints"))
        .arg(&export));
    let out = tmp("import");
    let mut cmd = kiln();
    cmd.arg("import-hf")
        .arg(&export)
        .args(["--run", "tiny", "--steps", "2", "--out"])
        .arg(&out);
    let printed = ok(quiet(&mut cmd));
    assert!(
        printed.contains("the corpus is tokenized with the folder's"),
        "{printed}"
    );
    let imported = losses(&out);
    let scratch = losses(&t.out);
    assert_eq!(imported.len(), 2, "{imported:?}");
    // the same first batch: the trained weights predict it better than the initialisation did
    println!(
        "step-1 loss from scratch {:.4}, after import {:.4}",
        scratch[0].1, imported[0].1
    );
    assert!(
        imported[0].1 < scratch[0].1 - 0.05,
        "import {imported:?} vs scratch {scratch:?}"
    );
}

/// A Llama with Llama 3.1's rotary frequency scaling goes out and back in: `kiln train` takes
/// the scaling as `--model.rope_scaling`, `export-hf` writes it into `config.json` as the
/// `llama3` rope type, and `import-hf` starts a run from that folder with the same scaling
/// (the architecture check compares it, so a run without it would be refused).
#[test]
fn a_llama_with_rope_scaling_goes_out_and_back_in() {
    let scaling = r#"{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":32}"#;
    let out = tmp("llama-scaled");
    let mut cmd = kiln();
    cmd.args(["train", "--run", "tiny", "--preset", "llama_tiny"])
        .args(["--model.rope_scaling", scaling])
        .args(["--steps", "2", "--ckpt_every", "2", "--out"])
        .arg(&out);
    let printed = ok(quiet(&mut cmd));
    assert!(printed.contains("Llama architecture"), "{printed}");
    let export = tmp("llama-scaled-hf");
    ok(kiln()
        .arg("export-hf")
        .arg(out.join("checkpoints"))
        .arg(&export));
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(export.join("config.json")).unwrap()).unwrap();
    let rs = &config["rope_scaling"];
    assert_eq!(rs["rope_type"], "llama3", "{config}");
    assert_eq!(rs["factor"], 8.0, "{config}");
    assert_eq!(rs["original_max_position_embeddings"], 32, "{config}");
    let back = tmp("llama-scaled-import");
    let mut cmd = kiln();
    cmd.arg("import-hf")
        .arg(&export)
        .args([
            "--run",
            "tiny",
            "--steps",
            "2",
            "--ckpt_every",
            "2",
            "--out",
        ])
        .arg(&back);
    ok(quiet(&mut cmd));
    let gpt = Pretrained::load(&back.join("checkpoints")).unwrap().config;
    assert_eq!(
        gpt.rope_scaling,
        Some(serde_json::from_str(scaling).unwrap()),
        "{gpt:?}"
    );
    assert_eq!(losses(&back).len(), 2);
    // without the scaling the folder's weights do not fit the run's architecture
    let mut cmd = kiln();
    cmd.args([
        "train",
        "--run",
        "tiny",
        "--preset",
        "llama_tiny",
        "--steps",
        "1",
    ])
    .arg("--model.init_from")
    .arg(&export)
    .arg("--out")
    .arg(tmp("llama-unscaled"));
    let o = run(quiet(&mut cmd));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("rope_scaling"), "{err}");
}

/// The trained model, loaded here.
fn model(ckpt: &Path) -> (Gpt, Pretrained) {
    let p = Pretrained::load(ckpt).unwrap();
    let m = Gpt::new(&p.config, &GptOptions::seeded(0)).unwrap();
    p.load_into(&m).unwrap();
    (m, p)
}

#[test]
fn sample_prints_the_ids_generate_gives() {
    let t = trained();
    let ckpt = t.out.join("checkpoints");
    let prompt = "ROMEO:\nBut soft";
    let printed = ok(kiln().arg("sample").arg(&ckpt).args([
        "--greedy",
        "--ids",
        "--max-tokens",
        "12",
        "--prompt",
        prompt,
    ]));
    let ids: Vec<u32> = printed
        .lines()
        .find_map(|l| l.strip_prefix("ids:"))
        .unwrap_or_else(|| panic!("no ids line:\n{printed}"))
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    let (m, p) = model(&ckpt);
    let tok = kiln_data::Tokenizer::from_file(p.tokenizer.as_ref().unwrap()).unwrap();
    let enc = tok.encode(prompt).unwrap();
    let want = generate(&m, &enc, 12, Sampling::Greedy, 0).unwrap();
    assert_eq!(ids, want[enc.len()..]);
    // greedy decoding and sampling flags do not go together
    let out = run(kiln()
        .arg("sample")
        .arg(&ckpt)
        .args(["--greedy", "--top-k", "5"]));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--greedy") && err.contains("--top-k"), "{err}");
}

#[test]
fn evaluate_prints_the_cross_entropy_of_the_logits() {
    let t = trained();
    let ckpt = t.out.join("checkpoints");
    let printed = ok(kiln().arg("evaluate").arg(&ckpt).args([
        "--text",
        "data/austen.txt",
        "--max-tokens",
        "320",
        "--batch",
        "2",
    ]));
    let json: serde_json::Value = printed
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON line:\n{printed}"));
    let (tokens, loss) = (
        json["tokens"].as_u64().unwrap(),
        json["loss"].as_f64().unwrap(),
    );
    assert_eq!(tokens, 320, "5 windows of 64");
    assert!((json["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-6 * loss.exp());
    // the reference: the first 5 windows of the text, a log-softmax of the logits in f64
    let (m, p) = model(&ckpt);
    let tok = kiln_data::Tokenizer::from_file(p.tokenizer.as_ref().unwrap()).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join("data/austen.txt")).unwrap();
    let ids = tok.encode(&text[..20_000]).unwrap();
    let n = m.config().n_ctx;
    let mut nll = 0.0f64;
    for w in 0..5 {
        let x = Tensor::new(&ids[w * n..(w + 1) * n], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits: Vec<Vec<f64>> = m
            .forward(&x)
            .unwrap()
            .get(0)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec2()
            .unwrap();
        for (i, row) in logits.iter().enumerate() {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            nll += lse - row[ids[w * n + i + 1] as usize];
        }
    }
    let want = nll / (5 * n) as f64;
    println!("evaluate: {loss:.6}; log-softmax here: {want:.6}");
    assert!((loss - want).abs() < 1e-4 * want, "{loss} vs {want}");
}

#[test]
fn plan_memory_counts_16_bytes_per_parameter() {
    let printed = ok(kiln().args(["plan-memory", "gpt3_175b", "--dp", "64", "--tp", "8"]));
    let row = |name: &str| -> Vec<String> {
        printed
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row:\n{printed}"))
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    let gib = |bytes: f64| format!("{:.2}", bytes / (1u64 << 30) as f64);
    // replicated: 2 (fp16 weights) + 2 (gradients) + 12 (fp32 master and Adam moments) bytes
    // per parameter of this tensor-parallel rank; ZeRO-1 splits the 12 over dp = 64, ZeRO-2
    // the gradients too, ZeRO-3 all of it
    let p: f64 = row("replicated")[1].parse().unwrap();
    assert!(p > 175e9 / 8.0 * 0.95 && p < 175e9 / 8.0 * 1.05, "{p}");
    let dp = 64.0;
    for (stage, bytes) in [
        ("replicated", 16.0 * p),
        ("zero-1", 4.0 * p + 12.0 * p / dp),
        ("zero-2", 2.0 * p + 14.0 * p / dp),
        ("zero-3", 16.0 * p / dp),
    ] {
        assert_eq!(
            row(stage)[5],
            gib(bytes),
            "{stage} model states:\n{printed}"
        );
    }
    assert_eq!(
        row("zero-1")[4],
        gib(12.0 * p / dp),
        "optimizer states / dp"
    );
}

#[test]
fn plan_pipeline_prints_the_timeline_bubble_and_activations_and_draws_the_png() {
    let dir = tmp("plan-pipeline");
    let png = dir.join("sub/1f1b.png");
    let printed = ok(kiln()
        .args(["plan-pipeline", "--pp", "4", "--micro-batches", "8"])
        .args(["--schedule", "1f1b", "--png"])
        .arg(&png));
    println!("{printed}");
    let (p, m) = (4.0, 8.0);
    // 1F1B idles (p - 1) (F + B) of each rank's (m + p - 1) (F + B)
    let bubble = format!("{:.4}", (p - 1.0) / (m + p - 1.0));
    assert!(
        printed.contains(&format!("bubble fraction {bubble} (theory {bubble})")),
        "{printed}"
    );
    assert!(
        printed.contains("makespan 33;"),
        "(m + p - 1) (F + B) = 33:\n{printed}"
    );
    assert!(
        printed
            .contains("peak micro-batches in flight: rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1"),
        "{printed}"
    );
    // one timeline line per rank, each with every forward and backward once
    let lines: Vec<&str> = printed.lines().filter(|l| l.starts_with("rank ")).collect();
    assert_eq!(lines.len(), 4, "{printed}");
    for l in &lines {
        for mb in 0..8 {
            for kind in ["F", "B"] {
                let label = format!("{kind}{mb}");
                let n = l.split_whitespace().filter(|w| *w == label).count();
                assert_eq!(n, 1, "{label} in {l}");
            }
        }
    }
    // a PNG, 1600 wide (40 pixels per unit of a 33-unit step, at least 1600) and 140 + 70 x 4
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    assert_eq!(&bytes[12..16], b"IHDR");
    assert_eq!((be(16), be(20)), (1600, 420));
    assert!(bytes.len() > 10_000, "{} bytes", bytes.len());

    // ZB-H1 with F = B = W: the paper's (p - 1) (F + B - W) of bubble
    let printed = ok(kiln().args([
        "plan-pipeline",
        "--pp",
        "4",
        "--micro-batches",
        "8",
        "--schedule",
        "zb_h1",
    ]));
    let bubble = format!("{:.4}", (p - 1.0) / (3.0 * m + p - 1.0));
    assert!(
        printed.contains(&format!("bubble fraction {bubble} (theory {bubble})")),
        "{printed}"
    );
    assert!(printed.contains(" W7"), "{printed}");

    // a shape the schedule cannot run names the factor and the rule
    for (args, rule) in [
        (
            &["--schedule", "gpipe", "--virtual-stages", "2"][..],
            "virtual stages need the interleaved schedule; gpipe got virtual_stages = 2",
        ),
        (
            &["--schedule", "interleaved", "--micro-batches", "6"],
            "micro_batches divisible by stages",
        ),
        (
            &["--weight-cost", "3"],
            "--weight-cost 3 is more than --backward-cost 2",
        ),
    ] {
        let out = run(kiln().arg("plan-pipeline").args(args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(rule), "{args:?}: {err}");
    }
}

#[test]
fn prepare_data_trains_the_tokenizer_and_writes_the_shards() {
    let dir = tmp("prepare");
    let (data, out) = (dir.join("data"), dir.join("cache"));
    std::fs::create_dir_all(&data).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for name in ["shakespeare", "austen", "web_bible"] {
        let text = std::fs::read_to_string(root.join(format!("data/{name}.txt"))).unwrap();
        let cut = text
            .char_indices()
            .nth(60_000)
            .map_or(text.len(), |(i, _)| i);
        std::fs::write(data.join(format!("{name}.txt")), &text[..cut]).unwrap();
    }
    let prepare = || {
        let mut c = kiln();
        c.arg("prepare-data")
            .arg("--data")
            .arg(&data)
            .arg("--out")
            .arg(&out);
        c.args(["--vocab", "300", "--shards", "2"]);
        c
    };
    let first = ok(&mut prepare());
    assert!(first.starts_with("prepared"), "{first}");
    let tok_path = first
        .split("tokenizer ")
        .nth(1)
        .unwrap()
        .split(" (")
        .next()
        .unwrap();
    let tok = kiln_data::Tokenizer::from_file(tok_path).unwrap();
    assert_eq!(tok.vocab_size(), 300);
    for line in first.lines().skip(1) {
        // "  name  bytes bytes -> train N tokens in 2 shards, val M tokens ... FOLDER"
        let words: Vec<&str> = line.split_whitespace().collect();
        let train: u64 = words[5].parse().unwrap();
        let folder = PathBuf::from(words.last().unwrap());
        let mut shards: Vec<_> = std::fs::read_dir(&folder)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().contains("train"))
            .collect();
        shards.sort();
        assert_eq!(shards.len(), 2, "{line}: {shards:?}");
        let refs: Vec<&Path> = shards.iter().map(PathBuf::as_path).collect();
        let src = kiln_data::TokenSource::open(words[0], &refs, kiln_data::Verify::Full).unwrap();
        assert_eq!(src.tokens(), train, "{line}");
    }
    let second = ok(&mut prepare());
    assert!(second.starts_with("found"), "{second}");
}

#[test]
fn launch_hands_out_ranks_and_one_token_and_names_a_failure() {
    let dir = tmp("launch");
    let script = format!(
        "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $MASTER_PORT $KILN_STORE_TOKEN\" > {}/rank$RANK",
        dir.display()
    );
    let mut cmd = kiln();
    cmd.args([
        "launch",
        "--nproc-per-node",
        "3",
        "--master-port",
        "29611",
        "--",
    ])
    .args(["sh", "-c", &script]);
    ok(&mut cmd);
    let lines: Vec<Vec<String>> = (0..3)
        .map(|r| {
            std::fs::read_to_string(dir.join(format!("rank{r}")))
                .unwrap()
                .split_whitespace()
                .map(String::from)
                .collect()
        })
        .collect();
    for (r, l) in lines.iter().enumerate() {
        assert_eq!(
            l[..4],
            [r.to_string(), "3".into(), r.to_string(), "29611".into()]
        );
        assert_eq!(l[4].len(), 32, "a random 128-bit token: {l:?}");
        assert_eq!(l[4], lines[0][4], "one token for the job");
    }
    // a given token is passed on as it is
    let mut cmd = kiln();
    cmd.args([
        "launch",
        "--nproc-per-node",
        "1",
        "--store-token",
        "given-token",
        "--",
    ])
    .args(["sh", "-c", &script]);
    ok(&mut cmd);
    let l = std::fs::read_to_string(dir.join("rank0")).unwrap();
    assert!(l.trim().ends_with(" given-token"), "{l}");
    // rank 1 fails: the launch fails and names it
    let out = run(kiln()
        .args(["launch", "--nproc-per-node", "2", "--"])
        .args(["sh", "-c", "exit $((RANK * 3))"]));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1 failed (exit code 3)"), "{err}");
}

#[test]
fn supervise_restarts_a_killed_command_with_resume() {
    let dir = tmp("supervise");
    let progress = dir.join("progress.jsonl");
    // the first attempt records a step and is SIGKILLed; the second must have --resume
    let script = format!(
        "if [ ! -e {d}/crashed ]; then touch {d}/crashed; echo '{{\"step\":1}}' >> {p}; kill -9 $$; \
         else echo \"$@\" > {d}/second; fi",
        d = dir.display(),
        p = progress.display()
    );
    let mut cmd = kiln();
    cmd.args([
        "supervise",
        "--max-restarts",
        "2",
        "--restart-dp",
        "1",
        "--progress",
    ])
    .arg(&progress)
    .args(["--", "sh", "-c", &script, "sh", "--steps", "4"]);
    ok(&mut cmd);
    let second = std::fs::read_to_string(dir.join("second")).unwrap();
    assert_eq!(second.trim(), "--steps 4 --resume --dp 1");
    let events: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("supervise.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let names: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        names.iter().filter(|n| **n == "start").count(),
        2,
        "{names:?}"
    );
    assert_eq!(
        names.iter().filter(|n| **n == "restart").count(),
        1,
        "{names:?}"
    );
    assert_eq!(names.last(), Some(&"done"), "{names:?}");
    let exit = events.iter().find(|e| e["event"] == "exit").unwrap();
    assert_eq!(exit["signal"].as_i64(), Some(9), "{exit}");
}
