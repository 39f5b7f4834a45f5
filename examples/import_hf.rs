//! Starts a training run from a Hugging Face GPT-2 folder (`config.json` +
//! `model.safetensors`, e.g. one `export_hf` wrote, or GPT-2's own): the run's model takes the
//! folder's sizes, its weights are loaded into every rank's tensor-parallel shard
//! (`model.init_from`), and it trains on the run preset's corpus at the given dp and tp.
//!
//! ```text
//! cargo run --release --example import_hf -- HF_DIR [--preset train_gpt] [--steps 20]
//!     [--tp N] [--dp N] [--out runs/import_hf] [any train_gpt flag]
//! ```
//! The corpus is tokenized with the folder's `tokenizer.json` (`data.tokenizer`), so the model
//! sees the token ids it was trained with.

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

use anyhow::{bail, Context};
use kiln_model::hf;
use kiln_train::{run_with, RunConfig, Trainer};
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(pos) = args.iter().position(|a| !a.starts_with("--")) else {
        bail!("usage: import_hf HF_DIR [--preset NAME] [--steps N] [--tp N] [--dp N] [--out DIR] [run flags]");
    };
    let dir = PathBuf::from(args.remove(pos));
    let hf_cfg = hf::read_hf_config(&dir)?;
    let gpt = hf_cfg
        .to_gpt()
        .with_context(|| format!("{} describes a model kiln cannot compute", dir.display()))?;
    let preset = match args.iter().position(|a| a == "--preset") {
        Some(i) if i + 1 < args.len() => {
            let p = args.remove(i + 1);
            args.remove(i);
            p
        }
        Some(_) => bail!("--preset needs a name"),
        None => "train_gpt".into(),
    };
    let mut flags: Vec<String> = vec![
        "--steps".into(),
        "20".into(),
        "--out".into(),
        "runs/import_hf".into(),
        "--ckpt_every".into(),
        "0".into(),
        // a trained model needs no long warm-up
        "--warmup".into(),
        "2".into(),
    ];
    for (k, v) in [
        ("vocab_size", gpt.vocab_size),
        ("n_ctx", gpt.n_ctx),
        ("d_model", gpt.d_model),
        ("n_layers", gpt.n_layers),
        ("n_heads", gpt.n_heads),
    ] {
        flags.push(format!("--model.{k}"));
        flags.push(v.to_string());
    }
    flags.push("--model.init_from".into());
    flags.push(dir.display().to_string());
    // the corpus in the model's own token ids
    let hf_tok = dir.join(hf::HF_TOKENIZER_FILE);
    if hf_tok.is_file() {
        flags.push("--data.tokenizer".into());
        flags.push(hf_tok.display().to_string());
    }
    flags.extend(args);
    let cfg = RunConfig::from_args(&preset, flags)?;
    cfg.validate()?;
    println!(
        "import {}: GPT-2 with {} layers, d_model {}, {} heads, context {}, vocabulary {}",
        dir.display(),
        gpt.n_layers,
        gpt.d_model,
        gpt.n_heads,
        gpt.n_ctx,
        gpt.vocab_size
    );
    match &cfg.data.tokenizer {
        Some(t) => println!("the corpus is tokenized with the folder's {}", t.display()),
        None => println!(
            "warning: {} has no tokenizer.json: the corpus is tokenized with a tokenizer trained \
             on it, whose ids are not the model's",
            dir.display()
        ),
    }
    println!(
        "training it {} steps on {:?} as dp={} x tp={} (ZeRO-{}), outputs in {}",
        cfg.train.steps,
        cfg.data.corpora,
        cfg.parallel.dp,
        cfg.parallel.tp,
        cfg.parallel.zero,
        cfg.output_dir.display()
    );
    let results = run_with(&cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        let mut losses = Vec::new();
        while t.step() < ctx.config.train.steps {
            if let Some(l) = t.train_step()?.loss {
                losses.push(l);
            }
        }
        t.finish()?;
        Ok(losses)
    })?;
    if let Some((_, losses)) = results.into_iter().find(|(rank, _)| *rank == 0) {
        let (first, last) = (losses.first(), losses.last());
        if let (Some(first), Some(last)) = (first, last) {
            println!(
                "loss at step 1 {first:.4} (a fresh model starts near ln({}) = {:.2}), at step {} {last:.4}",
                gpt.vocab_size,
                (gpt.vocab_size as f64).ln(),
                losses.len()
            );
        }
    }
    Ok(())
}
