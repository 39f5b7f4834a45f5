//! `kiln export-hf` (a kiln checkpoint, saved with any dp, tp and ZeRO stage, as a Hugging Face
//! GPT-2 or `LlamaForCausalLM` folder) and `kiln import-hf` (a training run started from such
//! a folder's weights).

use crate::train::TrainArgs;
use anyhow::Context;
use kiln_model::hf;
use kiln_train::{run_with, Pretrained, Trainer, RUN_PRESETS};
use std::path::PathBuf;

/// `kiln export-hf`: writes `model.safetensors` (f32, `transformer.*` names, GPT-2's `Conv1D`
/// orientation), `config.json` (`GPT2LMHeadModel`, `gelu_new`) and the run's
/// `tokenizer.json`, which `transformers.GPT2LMHeadModel.from_pretrained(OUT)` and
/// `tokenizers.Tokenizer.from_file` load as they are; a model in the Llama layout as a
/// `LlamaForCausalLM` folder (`model.layers.*` names, shards with an index above 5 GB,
/// `generation_config.json`).
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Example:\n  kiln export-hf runs/train_gpt/checkpoints/latest out/")]
pub struct ExportArgs {
    /// A folder of checkpoints (its newest step), its `latest` file, or one step-NNNNNNNN
    /// folder
    #[arg(value_name = "CHECKPOINT")]
    pub checkpoint: PathBuf,
    /// The folder to write
    #[arg(value_name = "OUT")]
    pub out: PathBuf,
    /// The tokenizer.json to ship (default: the one beside the checkpoints)
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

impl ExportArgs {
    /// Reads the checkpoint and writes the folder, printing what it wrote.
    pub fn run(&self) -> anyhow::Result<()> {
        let (ckpt, out) = (&self.checkpoint, &self.out);
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
        let tokenizer = self.tokenizer.clone().or(model.tokenizer.clone());
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
        let class = match hf::llama::llama_layout(c) {
            Ok(()) => ("Llama", "LlamaForCausalLM"),
            Err(_) => ("GPT-2", "GPT2LMHeadModel"),
        };
        println!(
            "wrote the Hugging Face {} folder {}:",
            class.0,
            out.display()
        );
        for f in &files {
            let size = std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
            println!("  {} ({size} bytes)", f.display());
        }
        println!(
            "load it with transformers.{}.from_pretrained({:?})",
            class.1,
            out.display().to_string()
        );
        Ok(())
    }
}

/// `kiln import-hf`: the run's model takes the folder's sizes, its weights are loaded into every
/// rank's tensor-parallel shard (`model.init_from`), and it trains on the run preset's corpus,
/// tokenized with the folder's `tokenizer.json` (`data.tokenizer`) so the model sees the token
/// ids it was trained with. Defaults: 20 steps, a warm-up of 2, no checkpoints, outputs in
/// runs/import_hf; any flag of `kiln train` overrides them.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Example:\n  kiln import-hf out/ --tp 4 --steps 20")]
pub struct ImportArgs {
    /// A Hugging Face GPT-2 or Llama folder (config.json + model.safetensors or its shards)
    #[arg(value_name = "HF_DIR")]
    pub dir: PathBuf,
    /// The run preset whose corpus and layout it trains with
    #[arg(long, value_name = "NAME", default_value = "train_gpt", value_parser = clap::builder::PossibleValuesParser::new(RUN_PRESETS))]
    pub run: String,
    /// The run's flags.
    #[command(flatten)]
    pub args: TrainArgs,
}

impl ImportArgs {
    /// Trains from the folder's weights, printing the first and last losses.
    pub fn run(&self) -> anyhow::Result<()> {
        let dir = &self.dir;
        let gpt = hf::read_model_config(dir)
            .with_context(|| format!("{} describes a model kiln cannot compute", dir.display()))?;
        let llama = hf::llama::llama_layout(&gpt).is_ok();
        // the defaults of an import, then the folder's model, then the user's flags
        let mut flags: Vec<String> = [
            "--steps",
            "20",
            "--out",
            "runs/import_hf",
            "--ckpt_every",
            "0",
            // a trained model needs no long warm-up
            "--warmup",
            "2",
        ]
        .map(String::from)
        .to_vec();
        let mut sizes = vec![
            ("vocab_size", gpt.vocab_size.to_string()),
            ("n_ctx", gpt.n_ctx.to_string()),
            ("d_model", gpt.d_model.to_string()),
            ("n_layers", gpt.n_layers.to_string()),
            ("n_heads", gpt.n_heads.to_string()),
        ];
        if llama {
            // the Llama layout, then the folder's sizes
            sizes.insert(0, ("preset", "llama_cpu".into()));
            sizes.extend([
                ("n_kv_heads", gpt.kv_heads().to_string()),
                ("ffn_hidden_size", gpt.d_ff().to_string()),
                ("rope_theta", gpt.rope_theta.to_string()),
                ("norm_eps", gpt.layer_norm_eps.to_string()),
                ("tied_embeddings", gpt.tied_embeddings.to_string()),
            ]);
            if let Some(scaling) = &gpt.rope_scaling {
                sizes.push(("rope_scaling", serde_json::to_string(scaling)?));
            }
        }
        for (k, v) in sizes {
            flags.push(format!("--model.{k}"));
            flags.push(v);
        }
        flags.push("--model.init_from".into());
        flags.push(dir.display().to_string());
        // the corpus in the model's own token ids
        let hf_tok = dir.join(hf::HF_TOKENIZER_FILE);
        if hf_tok.is_file() {
            flags.push("--data.tokenizer".into());
            flags.push(hf_tok.display().to_string());
        }
        flags.extend(self.args.to_args());
        let cfg = kiln_train::RunConfig::from_args(&self.run, flags)?;
        cfg.validate()?;
        println!(
            "import {}: {} with {} layers, d_model {}, {} heads, context {}, vocabulary {}",
            dir.display(),
            if llama { "Llama" } else { "GPT-2" },
            gpt.n_layers,
            gpt.d_model,
            gpt.n_heads,
            gpt.n_ctx,
            gpt.vocab_size
        );
        match &cfg.data.tokenizer {
            Some(t) => println!("the corpus is tokenized with the folder's {}", t.display()),
            None => println!(
                "warning: {} has no tokenizer.json: the corpus is tokenized with a tokenizer \
                 trained on it, whose ids are not the model's",
                dir.display()
            ),
        }
        println!(
            "training it {} steps on {:?} as dp={} x tp={}{} (ZeRO-{}), outputs in {}",
            cfg.train.steps,
            cfg.data.corpora,
            cfg.parallel.dp,
            cfg.parallel.tp,
            if cfg.parallel.pp > 1 {
                format!(" x pp={}", cfg.parallel.pp)
            } else {
                String::new()
            },
            cfg.parallel.zero.number(),
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
            if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
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
}
