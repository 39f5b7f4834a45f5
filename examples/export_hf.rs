//! Exports a kiln checkpoint, saved with any dp, tp and ZeRO stage, as a Hugging Face GPT-2
//! folder: `model.safetensors` (f32, `transformer.*` names, GPT-2's `Conv1D` orientation),
//! `config.json` (`GPT2LMHeadModel`, `gelu_new`) and the run's `tokenizer.json`, which
//! `transformers.GPT2LMHeadModel.from_pretrained(OUT)` and `tokenizers.Tokenizer.from_file`
//! load as they are.
//!
//! ```text
//! cargo run --release --example export_hf -- CHECKPOINT OUT [--tokenizer FILE]
//! ```
//! `CHECKPOINT` is a folder of checkpoints (`runs/train_gpt/checkpoints`: its newest step),
//! its `latest` file, or one `step-NNNNNNNN` folder.

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

use anyhow::{bail, Context};
use kiln_model::hf;
use kiln_train::Pretrained;
use std::path::PathBuf;

const USAGE: &str = "export_hf CHECKPOINT OUT [--tokenizer FILE]";

fn main() -> anyhow::Result<()> {
    let mut positional = Vec::new();
    let mut tokenizer: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tokenizer" => {
                tokenizer = Some(args.next().context("--tokenizer needs a file")?.into())
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            flag if flag.starts_with("--") => bail!("unknown flag {flag}\nusage: {USAGE}"),
            path => positional.push(PathBuf::from(path)),
        }
    }
    let [ckpt, out] = positional.as_slice() else {
        bail!("expected a checkpoint and an output folder\nusage: {USAGE}");
    };
    let model = Pretrained::from_checkpoint(ckpt)
        .with_context(|| format!("cannot read a model from {}", ckpt.display()))?;
    let c = &model.config;
    println!(
        "read {}: {} layers, d_model {}, {} heads, context {}, vocabulary {} ({} parameters)",
        model.source,
        c.n_layers,
        c.d_model,
        c.n_heads,
        c.n_ctx,
        c.vocab_size,
        c.param_count()
    );
    let tokenizer = tokenizer.or(model.tokenizer.clone());
    let eot = match &tokenizer {
        Some(t) => Some(
            kiln_data::Tokenizer::from_file(t)
                .with_context(|| format!("cannot read the tokenizer {}", t.display()))?
                .eot(),
        ),
        None => {
            println!("no tokenizer.json beside the checkpoints and no --tokenizer: exporting the model alone");
            None
        }
    };
    let files = hf::save_hf_dir(out, &model.config, &model.params, tokenizer.as_deref(), eot)?;
    println!("wrote the Hugging Face GPT-2 folder {}:", out.display());
    for f in &files {
        let size = std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
        println!("  {} ({size} bytes)", f.display());
    }
    println!(
        "load it with transformers.GPT2LMHeadModel.from_pretrained({:?})",
        out.display().to_string()
    );
    Ok(())
}
