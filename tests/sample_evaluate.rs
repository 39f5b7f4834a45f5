//! `kiln sample` and `kiln evaluate` on a checkpoint trained here: the `tiny` model (vocab
//! 512, context 64) trained by kiln-train's `Trainer` for a few seconds on the first 200 kB of
//! `data/shakespeare.txt`, tokenized with a byte-level BPE of 512 ids trained on the same text
//! (a custom corpus, so the checkpoint folder has no `tokenizer.json`: the subcommands get
//! `--tokenizer`).
//!
//! - `sample --greedy --ids` twice gives the same ids, and they are the ids
//!   `kiln_model::generate` gives in this process from the checkpoint's `Pretrained` weights
//!   (and not those of the untrained model); top-k sampling repeats for a seed, equals
//!   `generate`'s, and changes with the seed;
//! - `evaluate` prints a finite loss whose `exp` is the printed perplexity, equal to the mean
//!   cross-entropy computed here from the model's logits (a log-softmax in f64 over the same
//!   windows), and below ln(512) = 6.24 (the model learned the text); with `--max-tokens` on
//!   a longer text it evaluates the first whole windows only (tokenizing a prefix of the text)
//!   and still equals the reference;
//! - bad input exits non-zero and names what was wrong: a missing folder, no tokenizer, an
//!   unknown flag, a bad number, a prompt outside the vocabulary, a text too short for one
//!   window (with its token count).
//!
//! The `kiln` command is `target/<profile>/kiln` (`cargo test --workspace --release` builds it;
//! where it is missing this test builds it), or the binary `KILN_BIN` names.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use candle_core::{DType, Tensor};
use common::process::{command, kiln, repo, work_dir};
use kiln_data::{write_shard, TokenDtype, TokenSource, Tokenizer, Verify};
use kiln_model::{generate, Gpt, GptOptions, Sampling};
use kiln_train::{Pretrained, RunConfig, Trainer};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;
use std::time::Instant;

/// Bytes of `data/shakespeare.txt` the tokenizer and the model are trained on.
const TRAIN_BYTES: usize = 200_000;
/// Bytes of the same text `evaluate` reads (about 150 windows of 64 tokens).
const EVAL_BYTES: usize = 20_000;
/// Training steps and learning rate.
const STEPS: &str = "150";
const LR: &str = "3e-3";
/// The prompt and length of the greedy samples.
const PROMPT: &str = "ROMEO:\nBut soft, what light";
const MAX_NEW: usize = 40;

/// The trained checkpoint and its files.
struct Fixture {
    /// The run's folder of checkpoints.
    ckpt: PathBuf,
    /// The BPE tokenizer the run's data was written with.
    tokenizer: PathBuf,
    /// The text `evaluate` reads (part of the training text).
    eval_text: PathBuf,
    /// The whole training text.
    train_text: PathBuf,
    /// The work folder.
    dir: PathBuf,
    /// `kiln sample` and `kiln evaluate`.
    sample: Bin,
    evaluate: Bin,
}

/// A subcommand of the `kiln` binary.
struct Bin {
    kiln: PathBuf,
    sub: &'static str,
}

/// The first `n` bytes of `text`, cut after a line end.
fn head(text: &str, n: usize) -> &str {
    let mut end = n.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    match text[..end].rfind('\n') {
        Some(nl) => &text[..nl + 1],
        None => &text[..end],
    }
}

/// Trains the tokenizer and the `tiny` model once; every test shares them.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let (sample, evaluate) = (
            Bin {
                kiln: kiln(),
                sub: "sample",
            },
            Bin {
                kiln: kiln(),
                sub: "evaluate",
            },
        );
        let t = Instant::now();
        let dir = work_dir("kiln-sample-evaluate");
        let corpus = std::fs::read_to_string(repo().join("data/shakespeare.txt")).unwrap();
        let text = head(&corpus, TRAIN_BYTES);
        let tok = Tokenizer::train_bpe(std::iter::once(text), 512).unwrap();
        assert_eq!(tok.vocab_size(), 512, "200 kB reach the whole vocabulary");
        let tokenizer = dir.join("tokenizer.json");
        tok.save(&tokenizer).unwrap();
        let eval_text = dir.join("eval.txt");
        std::fs::write(&eval_text, head(text, EVAL_BYTES)).unwrap();
        let train_text = dir.join("train.txt");
        std::fs::write(&train_text, text).unwrap();

        let ids = tok.encode(text).unwrap();
        let shard = dir.join("shakespeare.bin");
        write_shard(&shard, &ids, TokenDtype::U16).unwrap();
        let source = TokenSource::open("shakespeare", &[&shard], Verify::Full).unwrap();
        let run = dir.join("run");
        let mut cfg = RunConfig::preset("tiny").unwrap();
        cfg.apply_overrides(&[
            ("steps", STEPS),
            ("lr", LR),
            ("warmup", "2"),
            ("seq_len", "64"),
            ("out", run.to_str().unwrap()),
            ("checkpoint.every_steps", STEPS),
            ("metrics.console", "off"),
            ("metrics.tensorboard", "off"),
            ("metrics.png", "off"),
        ])
        .unwrap();
        let comm = kiln_comm::ThreadComm::group(1, Default::default())
            .unwrap()
            .remove(0);
        let summary = Trainer::builder(cfg)
            .data(vec![source], vec![])
            .build(comm)
            .unwrap()
            .run()
            .unwrap();
        let (first, last) = (summary.losses[0].1, summary.final_loss.unwrap());
        println!(
            "trained tiny on {} tokens' worth of text for {STEPS} steps in {:.1?}: loss {first:.3} \
             -> {last:.3}",
            ids.len(),
            t.elapsed()
        );
        let ckpt = run.join("checkpoints");
        assert!(
            !ckpt.join(kiln_train::TOKENIZER_FILE).exists(),
            "a custom corpus leaves no tokenizer beside the checkpoints"
        );
        Fixture {
            ckpt,
            tokenizer,
            eval_text,
            train_text,
            dir,
            sample,
            evaluate,
        }
    })
}

/// Runs `bin` with `args`; its output.
fn run(bin: &Bin, args: &[&str]) -> Output {
    let t = Instant::now();
    let out = command(&bin.kiln).arg(bin.sub).args(args).output().unwrap();
    println!(
        "kiln {} {} -> {} in {:.1?}",
        bin.sub,
        args.join(" "),
        out.status,
        t.elapsed()
    );
    out
}

/// Runs `bin` with `args`, which must succeed; its stdout.
fn run_ok(bin: &Bin, args: &[&str]) -> String {
    let out = run(bin, args);
    assert!(
        out.status.success(),
        "kiln {} {args:?} failed: {}\n--- stdout\n{}\n--- stderr\n{}",
        bin.sub,
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `bin` with `args`, which must fail; its stderr, which must contain every `needle`.
fn run_err(bin: &Bin, args: &[&str], needles: &[&str]) -> String {
    let out = run(bin, args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "kiln {} {args:?} should fail:\n{}",
        bin.sub,
        String::from_utf8_lossy(&out.stdout)
    );
    for n in needles {
        assert!(stderr.contains(n), "{args:?}: {n:?} not in\n{stderr}");
    }
    println!("  {}", stderr.lines().next().unwrap_or_default());
    stderr
}

/// The ids of the `ids:` line of `sample --ids`.
fn ids_line(stdout: &str) -> Vec<u32> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("ids:"))
        .unwrap_or_else(|| panic!("no ids: line in\n{stdout}"));
    line.split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

/// The trained model, loaded here as the examples load it.
fn load_model(ckpt: &Path) -> Gpt {
    let p = Pretrained::load(ckpt).unwrap();
    let model = Gpt::new(&p.config, &GptOptions::seeded(0)).unwrap();
    p.load_into(&model).unwrap();
    model
}

/// Runs `sample` on the checkpoint with its tokenizer, continuing `PROMPT` by `MAX_NEW`
/// tokens, with the flags `extra`; its stdout.
fn sample(f: &Fixture, extra: &[&str]) -> String {
    let max = MAX_NEW.to_string();
    let mut args = vec![
        f.ckpt.to_str().unwrap(),
        "--tokenizer",
        f.tokenizer.to_str().unwrap(),
        "--prompt",
        PROMPT,
        "--max-tokens",
        &max,
    ];
    args.extend_from_slice(extra);
    run_ok(&f.sample, &args)
}

#[test]
fn sample_greedy_is_deterministic_and_uses_the_checkpoint() {
    let f = fixture();
    let first = sample(f, &["--greedy", "--ids"]);
    let second = sample(f, &["--greedy", "--ids"]);
    println!("{first}");
    assert!(
        first.contains("the checkpoint of step 150"),
        "prints its source:\n{first}"
    );
    assert!(
        first.contains("2 layers, d_model 128, 4 heads, context 64, vocab 512"),
        "prints the architecture:\n{first}"
    );
    let ids = ids_line(&first);
    assert_eq!(ids.len(), MAX_NEW);
    assert_eq!(ids, ids_line(&second), "greedy sampling is deterministic");

    // the same continuation from the checkpoint's weights in this process
    let tok = Tokenizer::from_file(&f.tokenizer).unwrap();
    let prompt = tok.encode(PROMPT).unwrap();
    let model = load_model(&f.ckpt);
    let want = generate(&model, &prompt, MAX_NEW, Sampling::Greedy, 0).unwrap();
    assert_eq!(
        ids,
        want[prompt.len()..],
        "kiln sample samples the checkpoint"
    );
    let text = tok.decode(&ids).unwrap();
    assert!(first.contains(&text), "prints the continuation {text:?}");

    // a model that did not learn (the initialisation) continues differently
    let fresh = Gpt::new(model.config(), &GptOptions::seeded(0)).unwrap();
    let other = generate(&fresh, &prompt, MAX_NEW, Sampling::Greedy, 0).unwrap();
    assert_ne!(other, want, "the trained weights matter");

    // top-k sampling: the same seed gives the same text, another seed another text
    let topk = |seed: &str| {
        ids_line(&sample(
            f,
            &[
                "--top-k",
                "40",
                "--temperature",
                "1.0",
                "--seed",
                seed,
                "--ids",
            ],
        ))
    };
    let (a, b) = (topk("1"), topk("1"));
    assert_eq!(a, b, "sampling is deterministic for a seed");
    let want = generate(
        &model,
        &prompt,
        MAX_NEW,
        Sampling::TopK {
            k: 40,
            temperature: 1.0,
        },
        1,
    )
    .unwrap();
    assert_eq!(a, want[prompt.len()..], "top-k sampling in process");
    assert_ne!(a, topk("2"), "another seed samples another continuation");
}

/// The `tokens`, `loss` and `perplexity` of `evaluate`'s JSON line; the perplexity is checked
/// against `exp(loss)`.
fn evaluate_result(stdout: &str) -> (usize, f64) {
    let json: serde_json::Value = stdout
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON line in\n{stdout}"));
    let tokens = json["tokens"].as_u64().unwrap() as usize;
    let loss = json["loss"].as_f64().unwrap();
    let ppl = json["perplexity"].as_f64().unwrap();
    assert!(loss.is_finite(), "{loss}");
    assert!(
        (loss.exp() - ppl).abs() <= 1e-6 * ppl,
        "perplexity {ppl} vs exp(loss) {}",
        loss.exp()
    );
    (tokens, loss)
}

/// The mean next-token cross-entropy of `model` over the first `windows` non-overlapping
/// windows of `ids` (n_ctx inputs, each with the next token as target), one window at a time,
/// by a log-softmax of the logits in f64.
fn reference_loss(model: &Gpt, ids: &[u32], windows: usize) -> f64 {
    let n_ctx = model.config().n_ctx;
    let mut nll = 0.0f64;
    for w in 0..windows {
        let x = Tensor::new(&ids[w * n_ctx..(w + 1) * n_ctx], &candle_core::Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits: Vec<Vec<f64>> = model
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
            nll += lse - row[ids[w * n_ctx + i + 1] as usize];
        }
    }
    nll / (windows * n_ctx) as f64
}

/// `evaluate`'s arguments for the checkpoint with its tokenizer over `text`, then `extra`.
fn evaluate_args<'a>(f: &'a Fixture, text: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        f.ckpt.to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--tokenizer",
        f.tokenizer.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    args
}

#[test]
fn evaluate_matches_the_cross_entropy_of_the_logits() {
    let f = fixture();
    let tok = Tokenizer::from_file(&f.tokenizer).unwrap();
    let model = load_model(&f.ckpt);
    let n_ctx = model.config().n_ctx;

    // the whole text, in batches of 8 windows (the last one short)
    let stdout = run_ok(
        &f.evaluate,
        &evaluate_args(f, &f.eval_text, &["--batch", "8"]),
    );
    println!("{stdout}");
    let (tokens, loss) = evaluate_result(&stdout);
    assert!(
        loss < 512f64.ln(),
        "the trained model predicts its text better than uniform: {loss}"
    );
    let ids = tok
        .encode(&std::fs::read_to_string(&f.eval_text).unwrap())
        .unwrap();
    let windows = (ids.len() - 1) / n_ctx;
    assert!(windows > 10 && windows % 8 != 0, "{} tokens", ids.len());
    assert_eq!(tokens, windows * n_ctx, "every full window is evaluated");
    let want = reference_loss(&model, &ids, windows);
    println!("evaluate: loss {loss:.6} over {tokens} tokens; log-softmax here: {want:.6}");
    assert!(
        (loss - want).abs() < 1e-4 * want,
        "evaluate's loss {loss} vs the logits' cross-entropy {want}"
    );

    // --max-tokens keeps the first whole windows: 10 of the 200 kB text, tokenized by a prefix
    let stdout = run_ok(
        &f.evaluate,
        &evaluate_args(f, &f.train_text, &["--max-tokens", "700"]),
    );
    let (tokens, loss) = evaluate_result(&stdout);
    assert_eq!(tokens, 10 * n_ctx, "10 windows of 64:\n{stdout}");
    assert!(
        stdout.contains("the first "),
        "a prefix is tokenized:\n{stdout}"
    );
    let ids = tok
        .encode(&std::fs::read_to_string(&f.train_text).unwrap())
        .unwrap();
    let want = reference_loss(&model, &ids, 10);
    println!("evaluate --max-tokens 700: loss {loss:.6}; log-softmax here: {want:.6}");
    assert!(
        (loss - want).abs() < 1e-4 * want,
        "evaluate's loss {loss} vs the logits' cross-entropy {want}"
    );
}

#[test]
fn bad_input_is_named() {
    let f = fixture();
    let (ckpt, tok_path) = (f.ckpt.to_str().unwrap(), f.tokenizer.to_str().unwrap());
    let missing = f.dir.join("no-such-checkpoints");
    let missing = missing.to_str().unwrap();
    let text_path = f.eval_text.to_str().unwrap();
    for (bin, args) in [
        (&f.sample, vec![missing, "--tokenizer", tok_path]),
        (&f.evaluate, vec![missing, "--text", text_path]),
    ] {
        run_err(bin, &args, &[missing, "no such file or folder"]);
        run_err(
            bin,
            &[ckpt, "--frobnicate", "1"],
            &["unexpected argument '--frobnicate'"],
        );
    }
    run_err(
        &f.sample,
        &[ckpt],
        &["--tokenizer", "has no tokenizer.json"],
    );
    run_err(
        &f.sample,
        &[ckpt, "--tokenizer", tok_path, "--max-tokens", "ten"],
        &["--max-tokens", "'ten'"],
    );
    run_err(
        &f.sample,
        &[ckpt, "--tokenizer", tok_path, "--prompt", ""],
        &["prompt", "empty"],
    );
    run_err(
        &f.sample,
        &[ckpt, "--tokenizer", tok_path, "--greedy", "--top-k", "5"],
        &["--greedy", "--top-k"],
    );

    // a tokenizer with more ids than the model: a prompt outside its vocabulary
    let tok = Tokenizer::from_file(&f.tokenizer).unwrap();
    let corpus = std::fs::read_to_string(repo().join("data/shakespeare.txt")).unwrap();
    let big = Tokenizer::train_bpe(std::iter::once(head(&corpus, TRAIN_BYTES)), 1024).unwrap();
    let big_path = f.dir.join("tokenizer-1024.json");
    big.save(&big_path).unwrap();
    let prompt = "ROMEO and JULIET, wherefore art thou";
    let bad = *big
        .encode(prompt)
        .unwrap()
        .iter()
        .find(|&&t| t >= 512)
        .unwrap();
    run_err(
        &f.sample,
        &[
            ckpt,
            "--tokenizer",
            big_path.to_str().unwrap(),
            "--prompt",
            prompt,
        ],
        &[&format!("token {bad}"), "vocabulary of 512"],
    );

    // evaluate: a missing text file, and one too short for a window of 64 + 1 tokens
    let no_text = f.dir.join("no-such-text.txt");
    run_err(
        &f.evaluate,
        &evaluate_args(f, &no_text, &[]),
        &[no_text.to_str().unwrap(), "no such file"],
    );
    let short = f.dir.join("short.txt");
    let short_text = "To be, or not to be, that is the question.\n";
    std::fs::write(&short, short_text).unwrap();
    let n = tok.encode(short_text).unwrap().len();
    assert!(n < 65);
    run_err(
        &f.evaluate,
        &evaluate_args(f, &short, &[]),
        &[
            short.to_str().unwrap(),
            &format!("has {n} tokens"),
            "needs 65",
        ],
    );
}
