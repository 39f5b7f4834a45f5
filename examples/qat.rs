//! Int8 quantization-aware training: pretrain `tiny` in f32 on Shakespeare (or start from a
//! checkpoint, `--from DIR`), quantize it to int8 as it is (post-training quantization, with
//! input ranges calibrated on training batches), then fine-tune it with fake-quantized weights
//! and inputs (data parallel over thread ranks, observers agreed over the ranks after every
//! step, checkpoints of the engine and the observers) and export real int8 weights. Prints the
//! validation perplexity of the f32 model, of int8 without and with QAT, their gaps, and the
//! export's size.
//!
//! Run: `cargo run --release --example qat` (flags: `--from DIR`, `--pretrain-steps 300`,
//! `--steps 150`, `--dp 2`, `--lr 1e-3`, `--out runs/qat`).

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln::alloc::KilnAlloc = kiln::alloc::KilnAlloc;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use kiln::ckpt::ZeroStage;
use kiln::ckpt::{CheckpointConfig, Checkpointer, Layout, LocalFs, RankState, Stateful, Step};
use kiln::comm::Communicator;
use kiln::data::{default_cache_dir, prepare_corpus, DataLoader, LoaderConfig, PrepareConfig};
use kiln::data::{TokenSource, Verify};
use kiln::model::{Gpt, GptOptions};
use kiln::parallel::{DataParallel, DataParallelConfig};
use kiln::precision::NoScaler;
use kiln::train::{run_with, Pretrained, RunConfig, Trainer};
use kiln::tune::{export_int8, load_int8, qat_gpt, Qat, QatConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

const CTX: usize = 64;
const BATCH: usize = 16;
const EVAL_BATCHES: usize = 16;
const CALIBRATION_BATCHES: usize = 8;

/// Int8 quantization-aware training of a tiny GPT, its int8 export and integer inference.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "qat")]
struct Args {
    /// The f32 base's checkpoint folder (default: pretrain one first)
    #[arg(long, value_name = "DIR")]
    from: Option<PathBuf>,
    /// Steps of the base's pretraining
    #[arg(long, value_name = "N", default_value_t = 300)]
    pretrain_steps: u64,
    /// Quantization-aware training steps
    #[arg(long, value_name = "N", default_value_t = 150)]
    steps: u64,
    /// Data-parallel thread ranks (divides the batch of 16)
    #[arg(long, value_name = "N", default_value_t = 2)]
    dp: usize,
    /// Learning rate
    #[arg(long, value_name = "LR", default_value_t = 1e-3)]
    lr: f32,
    /// Output folder
    #[arg(long, value_name = "DIR", default_value = "runs/qat")]
    out: PathBuf,
}

/// The command line, checked.
fn args() -> Result<Args> {
    let a = <Args as clap::Parser>::parse();
    if BATCH % a.dp != 0 {
        bail!("--dp ({}) must divide the batch of {BATCH}", a.dp);
    }
    Ok(a)
}

/// Pretrains the f32 base with kiln-train and returns its checkpoint folder.
fn pretrain(a: &Args) -> Result<PathBuf> {
    let mut cfg = RunConfig::preset("tiny")?;
    cfg.name = "qat_base".into();
    cfg.output_dir = a.out.join("base");
    cfg.data.corpora = vec!["shakespeare".into()];
    cfg.data.mixture = Default::default();
    cfg.parallel.dp = a.dp;
    cfg.train.steps = a.pretrain_steps;
    cfg.train.micro_batch = BATCH / a.dp;
    cfg.train.seq_len = CTX;
    cfg.eval.every = 0;
    cfg.metrics.console_every = 100;
    cfg.checkpoint.every_steps = 100;
    cfg.checkpoint.save_final = true;
    cfg.metrics.tensorboard = false;
    cfg.metrics.png = false;
    let dir = cfg.checkpoint_dir();
    if dir.join("latest").is_file() {
        println!("base: reusing {}", dir.display());
        return Ok(dir);
    }
    println!(
        "base: pretraining tiny in f32 on shakespeare for {} steps",
        a.pretrain_steps
    );
    run_with(&cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        while t.step() < ctx.config.train.steps {
            t.train_step()?;
        }
        t.finish()
    })?;
    Ok(dir)
}

/// Mean validation loss of `model` over the same `EVAL_BATCHES` batches every time.
fn val_loss(model: &Gpt, val: &[TokenSource]) -> Result<f64> {
    let mut lc = LoaderConfig::new(CTX, BATCH);
    (lc.seed, lc.workers) = (0x0076_616c, 0);
    let mut loader = DataLoader::new(val.to_vec(), None, lc)?;
    let mut sum = 0.0;
    for _ in 0..EVAL_BATCHES {
        let b = loader.next_batch()?;
        let x = Tensor::from_slice(&b.inputs, (BATCH, CTX), &Device::Cpu)?;
        let y = Tensor::from_slice(&b.targets, (BATCH, CTX), &Device::Cpu)?;
        sum += f64::from(model.loss(&x, &y)?.to_scalar::<f32>()?);
    }
    Ok(sum / EVAL_BATCHES as f64)
}

/// Runs `CALIBRATION_BATCHES` training batches forward and sets the observers from them.
fn calibrate(model: &Gpt, qat: &Qat, train: &[TokenSource]) -> Result<()> {
    let mut lc = LoaderConfig::new(CTX, BATCH);
    (lc.seed, lc.workers) = (0x000c_a11b, 0);
    let mut loader = DataLoader::new(train.to_vec(), None, lc)?;
    for _ in 0..CALIBRATION_BATCHES {
        let b = loader.next_batch()?;
        let x = Tensor::from_slice(&b.inputs, (BATCH, CTX), &Device::Cpu)?;
        model.forward(&x)?;
        qat.update_observers(None)?;
    }
    Ok(())
}

/// Fine-tunes `model` for `a.steps` steps on dp thread ranks (rank `world.rank()` of them),
/// with fake quantization when `qat` is given (its observers agreed over the ranks after
/// every step), checkpointing the engine (and the observers) at the end.
fn finetune(
    world: &Arc<dyn Communicator>,
    model: &Gpt,
    qat: Option<&Qat>,
    train: &[TokenSource],
    a: &Args,
    name: &str,
) -> Result<()> {
    let dpc = DataParallelConfig {
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    let mut engine = DataParallel::new(&model.segment_param_lists(), &**world, dpc)?
        .with_param_splits(&model.param_splits())?
        .with_decay_groups(&model.param_kinds(), &Default::default())?;
    let rows = BATCH / a.dp;
    let mut lc = LoaderConfig::new(CTX, rows);
    (lc.dp, lc.rank, lc.seed) = (a.dp, world.rank(), 11);
    let mut loader = DataLoader::new(train.to_vec(), None, lc)?;
    let layout = Layout::new(a.dp, 1, ZeroStage::Replicated)?;
    let storage = Arc::new(LocalFs::new(a.out.join(name).join("checkpoints"))?);
    let mut ckpt = Checkpointer::new(storage, CheckpointConfig::new(layout, name))?;
    let mut step = Step(0);
    while step.0 < a.steps {
        let b = loader.next_batch()?;
        let x = Tensor::from_slice(&b.inputs, (rows, CTX), &Device::Cpu)?;
        let y = Tensor::from_slice(&b.targets, (rows, CTX), &Device::Cpu)?;
        let loss = engine
            .step(
                model,
                &[kiln::memory::MicroBatch::new(x, y)?],
                a.lr,
                &mut NoScaler,
            )?
            .loss;
        if let Some(q) = qat {
            // every rank quantizes the next step's inputs with the same, global range
            q.update_observers(Some(&**world))?;
        }
        step.0 += 1;
        if world.rank() == 0 && step.0 % 50 == 0 {
            println!("{name} step {} | loss {loss:.4}", step.0);
        }
    }
    let mut parts: Vec<(&str, &dyn Stateful)> =
        vec![("engine", &engine), ("loader", &loader), ("step", &step)];
    if let Some(q) = qat {
        parts.push(("qat", q));
    }
    ckpt.save(&**world, step.0, &RankState::capture_all(&parts)?)?;
    Ok(())
}

/// Post-training quantization of `model`'s weights: a fake-quantized copy, calibrated, written
/// as int8 to `path`.
fn ptq(model: &Gpt, train: &[TokenSource], path: &std::path::Path) -> Result<()> {
    let (q, obs) = qat_gpt(
        model.config(),
        &GptOptions::seeded(1),
        &QatConfig::default(),
        None,
    )?;
    let params = model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| {
            let t = v.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            Ok((n, kiln::state::TensorData::from_slice(v.dims(), &t)?))
        })
        .collect::<Result<Vec<_>>>()?;
    q.load_full_parameters(&params)?;
    calibrate(&q, &obs, train)?;
    export_int8(&q, &obs, path)?;
    Ok(())
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
    let mut pc = PrepareConfig::new("data", default_cache_dir().join("qat"));
    pc.corpora = vec!["shakespeare".into()];
    pc.vocab_size = pre.config.vocab_size;
    pc.tokenizer = Some(
        pre.tokenizer
            .clone()
            .context("the base keeps no tokenizer.json")?,
    );
    let corpus = prepare_corpus(&pc)?;
    let (train, val) = (
        corpus.train_sources(Verify::Full)?,
        corpus.val_sources(Verify::Full)?,
    );
    std::fs::create_dir_all(&a.out)?;
    let _ = std::fs::remove_dir_all(a.out.join("f32"));
    let _ = std::fs::remove_dir_all(a.out.join("qat"));
    let opts = GptOptions::seeded(1);
    let base_model = Gpt::new(&pre.config, &opts)?;
    pre.load_into(&base_model)?;
    let loss_base = val_loss(&base_model, &val)?;

    // the same fine-tuning twice from the base: in f32 (then quantized as it is), and with
    // fake quantization (quantization-aware)
    let f32_ptq = a.out.join("f32_ptq_int8.safetensors");
    let qat_path = a.out.join("qat_int8.safetensors");
    let shared = (
        a.clone(),
        pre.clone(),
        train.clone(),
        val.clone(),
        opts.clone(),
    );
    let (f32_ptq2, qat_path2) = (f32_ptq.clone(), qat_path.clone());
    let outs = kiln::comm::spawn(a.dp, move |comm| -> Result<(f64, u64, u64)> {
        let (a, pre, train, val, opts) = &shared;
        let world: Arc<dyn Communicator> = Arc::new(comm);
        let plain = Gpt::new(&pre.config, opts)?;
        pre.load_into(&plain)?;
        finetune(&world, &plain, None, train, a, "f32")?;
        let (model, qat) = qat_gpt(&pre.config, opts, &QatConfig::default(), None)?;
        pre.load_into(&model)?;
        calibrate(&model, &qat, train)?;
        finetune(&world, &model, Some(&qat), train, a, "qat")?;
        if world.rank() != 0 {
            return Ok((0.0, 0, 0));
        }
        ptq(&plain, train, &f32_ptq2)?;
        let r = export_int8(&model, &qat, &qat_path2)?;
        Ok((val_loss(&plain, val)?, r.file_bytes, r.f32_bytes))
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (loss_f32, file_bytes, f32_bytes) = outs[0];
    let loss_ptq = val_loss(&load_int8(&f32_ptq, &opts)?, &val)?;
    let loss_qat = val_loss(&load_int8(&qat_path, &opts)?, &val)?;
    let ppl = |l: f64| l.exp();
    let gap = |l: f64| {
        format!(
            "(gap {:+.3}, {:+.2}%)",
            ppl(l) - ppl(loss_f32),
            100.0 * (ppl(l) / ppl(loss_f32) - 1.0)
        )
    };
    println!();
    println!("validation perplexity (shakespeare, {EVAL_BATCHES} batches of {BATCH} x {CTX}):");
    println!(
        "  base (f32)                              {:.3}",
        ppl(loss_base)
    );
    println!(
        "  fine-tuned {} steps in f32              {:.3}",
        a.steps,
        ppl(loss_f32)
    );
    println!(
        "  the same, quantized to int8 after (PTQ) {:.3}  {}",
        ppl(loss_ptq),
        gap(loss_ptq)
    );
    println!(
        "  fine-tuned with QAT, int8 export        {:.3}  {}",
        ppl(loss_qat),
        gap(loss_qat)
    );
    println!(
        "int8 export: {} ({file_bytes} bytes against {f32_bytes} in f32, {:.2}x smaller); done in {:.1} s",
        qat_path.display(),
        f32_bytes as f64 / file_bytes as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
