//! LoRA fine-tuning on a style the base model never saw: pretrain `tiny` briefly on Shakespeare
//! and Austen (or start from a checkpoint you trained, `--from runs/train_gpt/checkpoints`),
//! then train LoRA adapters (rank 8 on q, k, v, o, fc1 and fc2; the base frozen) on the World
//! English Bible with kiln-train's `Trainer` (`RunConfig.model.lora`), data parallel over
//! thread ranks. Prints the validation loss on the held-out style before and after, the
//! trainable share and the model-state memory against kiln-memory's estimate, and writes the
//! adapter alone (`adapter_model.safetensors`, readable by Python's `safetensors`). Checkpoints
//! of the fine-tuning run hold the adapters only and resume with `--resume`.
//!
//! Run: `cargo run --release --example finetune_lora` (flags: `--from DIR`, `--pretrain-steps
//! 300`, `--steps 200`, `--dp 2`, `--tp 1`, `--rank 8`, `--lr 5e-3`, `--out runs/finetune_lora`,
//! `--resume`).

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln::alloc::KilnAlloc = kiln::alloc::KilnAlloc;

use anyhow::{bail, Context, Result};
use kiln::memory::{MemPrecision, MemoryPlan, RecomputePolicy};
use kiln::model::{GptConfig, PRESET_NAMES};
use kiln::train::{run_with, Pretrained, RunConfig, Trainer};
use kiln::tune::{LoraConfig, LoraTarget};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// LoRA fine-tuning of a tiny GPT pretrained on Shakespeare to a style it never saw.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "finetune_lora")]
struct Args {
    /// The base's checkpoint folder (default: pretrain one first)
    #[arg(long, value_name = "DIR")]
    from: Option<PathBuf>,
    /// Steps of the base's pretraining
    #[arg(long, value_name = "N", default_value_t = 300)]
    pretrain_steps: u64,
    /// LoRA fine-tuning steps
    #[arg(long, value_name = "N", default_value_t = 200)]
    steps: u64,
    /// Data-parallel thread ranks
    #[arg(long, value_name = "N", default_value_t = 2)]
    dp: usize,
    /// Tensor-parallel thread ranks
    #[arg(long, value_name = "N", default_value_t = 1)]
    tp: usize,
    /// LoRA rank
    #[arg(long, value_name = "R", default_value_t = 8)]
    rank: usize,
    /// Learning rate
    #[arg(long, value_name = "LR", default_value_t = 5e-3)]
    lr: f64,
    /// Output folder
    #[arg(long, value_name = "DIR", default_value = "runs/finetune_lora")]
    out: PathBuf,
    /// Resume the fine-tuning from its newest checkpoint
    #[arg(long)]
    resume: bool,
}

/// The command line, checked.
fn args() -> Result<Args> {
    let a = <Args as clap::Parser>::parse();
    Ok(a)
}

/// The `tiny` run on the given corpora, quiet, at `dp x tp`.
fn run_config(a: &Args, name: &str, corpora: &[&str], steps: u64) -> Result<RunConfig> {
    let mut cfg = RunConfig::preset("tiny")?;
    cfg.name = name.into();
    cfg.output_dir = a.out.join(name);
    cfg.data.corpora = corpora.iter().map(|s| s.to_string()).collect();
    cfg.data.mixture = Default::default();
    cfg.parallel.dp = a.dp;
    cfg.parallel.tp = a.tp;
    cfg.train.steps = steps;
    cfg.train.micro_batch = 8;
    cfg.train.seq_len = 64;
    cfg.eval.every = 0;
    cfg.eval.batches = 16;
    cfg.checkpoint.every_steps = 100;
    cfg.checkpoint.save_final = true;
    cfg.metrics.console_every = 50;
    cfg.metrics.tensorboard = false;
    cfg.metrics.png = false;
    Ok(cfg)
}

/// Pretrains the base and returns its checkpoint folder.
fn pretrain(a: &Args) -> Result<PathBuf> {
    let cfg = run_config(a, "base", &["shakespeare", "austen"], a.pretrain_steps)?;
    let dir = cfg.checkpoint_dir();
    if dir.join("latest").is_file() {
        println!("base: reusing {}", dir.display());
        return Ok(dir);
    }
    println!(
        "base: pretraining tiny on shakespeare + austen for {} steps",
        a.pretrain_steps
    );
    let t0 = Instant::now();
    let out = run_with(&cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        while t.step() < ctx.config.train.steps {
            t.train_step()?;
        }
        t.finish()
    })?;
    if let Some((_, s)) = out.first() {
        println!(
            "base: {} steps in {:.1} s, final loss {:.4}",
            s.steps,
            t0.elapsed().as_secs_f64(),
            s.final_loss.unwrap_or(f32::NAN)
        );
    }
    Ok(dir)
}

/// The preset (with size overrides) that describes `c`.
fn model_section(c: &GptConfig, cfg: &mut RunConfig) -> Result<()> {
    for name in PRESET_NAMES {
        let mut p = GptConfig::by_name(name)?;
        p.n_ctx = c.n_ctx;
        p.vocab_size = c.vocab_size;
        if &p == c {
            cfg.model.preset = name.to_string();
            cfg.model.n_ctx = Some(c.n_ctx);
            cfg.model.vocab_size = Some(c.vocab_size);
            return Ok(());
        }
    }
    bail!("the base model's architecture is none of the presets {PRESET_NAMES:?}: {c:?}")
}

fn main() -> Result<()> {
    let a = args()?;
    let t0 = Instant::now();
    let base = match &a.from {
        Some(p) => p.clone(),
        None => pretrain(&a)?,
    };
    let pre = Pretrained::load(&base)?;
    println!("base model: {}", pre.source);
    let lora = LoraConfig {
        rank: a.rank,
        alpha: 2.0 * a.rank as f64,
        dropout: 0.0,
        targets: LoraTarget::ALL.to_vec(),
    };
    let mut cfg = run_config(&a, "lora", &["web_bible"], a.steps)?;
    model_section(&pre.config, &mut cfg)?;
    cfg.model.init_from = Some(base.clone());
    cfg.model.lora = Some(lora.clone());
    // the base's tokenizer, so the held-out corpus reads as the base model's token ids
    cfg.data.tokenizer = Some(
        pre.tokenizer
            .clone()
            .context("the base checkpoint keeps no tokenizer.json")?,
    );
    cfg.optim.schedule.lr = a.lr;
    cfg.optim.schedule.min_lr = a.lr / 10.0;
    cfg.checkpoint.resume = a.resume;
    // the adapters' gradient norm grows as B leaves zero: a spike must be 4x the median here
    cfg.monitor.grad_spike.min_rel_jump = 4.0;
    cfg.validate()?;
    if !a.resume {
        // a fresh fine-tuning run each time (the base is reused)
        let _ = std::fs::remove_dir_all(&cfg.output_dir);
    }
    let adapter_dir = a.out.join("adapter");
    let tp = a.tp;
    let shape = pre.config.shape();
    type Outcome = (
        Option<f64>,
        Option<f64>,
        u64,
        usize,
        usize,
        (u64, u64, u64),
        u64,
    );
    let results = run_with(
        &cfg,
        |ctx| -> kiln::train::Result<(kiln::train::TrainSummary, Outcome)> {
            let handle = Arc::new(Mutex::new(None));
            let slot = handle.clone();
            let mut t = Trainer::builder(ctx.config.clone())
                .model(move |m| {
                    let (gpt, lora) = m.build_gpt_lora()?;
                    if let Ok(mut s) = slot.lock() {
                        *s = lora;
                    }
                    Ok(gpt)
                })
                .build(ctx.comm)?;
            let lora = handle
                .lock()
                .ok()
                .and_then(|mut s| s.take())
                .ok_or_else(|| kiln::train::TrainError::Builder("no LoRA adapters".into()))?;
            let before = t.evaluate()?;
            while t.step() < ctx.config.train.steps {
                t.train_step()?;
            }
            let after = t.evaluate()?;
            // the adapter file, written by the first tensor-parallel group
            if t.engine().dp_dims().1 == 0 {
                lora.save_adapter(&adapter_dir)?;
            }
            let m = t.model();
            let frozen = (m.num_parameters() - m.num_trainable_parameters()) as u64;
            let out = (
                before,
                after,
                frozen,
                m.num_trainable_parameters(),
                m.num_parameters(),
                t.engine().model_state_bytes(),
                lora.num_parameters() as u64,
            );
            Ok((t.finish()?, out))
        },
    )?;
    let Some((_, (summary, (before, after, frozen, trainable, total, (_, g, o), _)))) =
        results.into_iter().find(|(r, _)| *r == 0)
    else {
        bail!("rank 0 returned nothing");
    };
    let plan = MemoryPlan {
        shape,
        precision: MemPrecision::F32,
        stage: cfg.parallel.zero,
        dp: a.dp as u64,
        tp: tp as u64,
        micro_batch: cfg.train.micro_batch as u64,
        recompute: RecomputePolicy::None,
        bucket_bytes: 25 << 20,
        sequence_parallel: false,
    };
    let est = plan.estimate_frozen(frozen, trainable as u64)?;
    let full = plan.estimate()?;
    println!();
    println!(
        "LoRA r={} on q, k, v, o, fc1, fc2: {trainable} of {total} parameters train ({:.2}%)",
        a.rank,
        100.0 * trainable as f64 / total as f64
    );
    if let (Some(b), Some(f)) = (before, after) {
        println!(
            "held-out style (web_bible) validation loss {b:.4} -> {f:.4} (perplexity {:.1} -> {:.1}) after {} steps",
            b.exp(),
            f.exp(),
            summary.steps
        );
    }
    println!(
        "model states of rank 0: gradients {} B, optimizer {} B (estimate {} B and {} B; full \
         fine-tuning would hold {} B and {} B)",
        g, o, est.grads, est.optimizer, full.grads, full.optimizer
    );
    println!(
        "adapter: {} ({} bytes); adapter-only checkpoints in {}",
        adapter_dir
            .join(kiln::tune::lora::ADAPTER_WEIGHTS_FILE)
            .display(),
        file_len(&adapter_dir.join(kiln::tune::lora::ADAPTER_WEIGHTS_FILE)),
        cfg.checkpoint_dir().display()
    );
    println!("done in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}
