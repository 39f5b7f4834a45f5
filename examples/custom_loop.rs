//! A training loop written by hand from kiln's crates, without kiln-train's `Trainer`: `tiny`
//! GPT, data parallel with ZeRO, fp16 with loss scaling, activation recomputation, a schedule,
//! clipping, detectors and a breaker between backward and update, sinks, and checkpoints of
//! every component that resume bitwise and reshard. Walk-through: `docs/custom-trainer.md`.
//! Run: `cargo run --release --example custom_loop -- --dp 2 --zero 2` (and `--steps N`,
//! `--every K`, `--out DIR`, `--resume`, `--f32`, `--optimizer '{"type": "sgd", "momentum":
//! 0.9}'`; `--help` lists them). Every kiln type comes through the facade crate `kiln`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use kiln::ckpt::{CheckpointConfig, Checkpointer, Layout, LoadOptions, LocalFs, RankState};
use kiln::ckpt::{ReshardRequest, Stateful, Step};
use kiln::comm::{Communicator, ThreadComm};
use kiln::data::{default_cache_dir, prepare_corpus, DataLoader, LoaderConfig, PrepareConfig};
use kiln::memory::{MicroBatch, RecomputePolicy};
use kiln::model::{Gpt, GptConfig, GptOptions};
use kiln::monitor::{BatchInfo, BreakerPolicy, CircuitBreaker, ConsoleSink, DetectorSet};
use kiln::monitor::{JsonlSink, MetricSink, MultiSink, Response, StepMetrics};
use kiln::optim::{LrSchedule, OptimizerConfig, WarmupDecay, WeightDecayGroups};
use kiln::parallel::{DataParallel, DataParallelConfig, ZeroStage};
use kiln::precision::{DynamicLossScaler, LossScaler, NoScaler};
use std::path::PathBuf;
use std::sync::Arc;

const GLOBAL_BATCH: usize = 8; // sequences per step, over all ranks
const CTX: usize = 64;

/// A training loop written by hand from kiln's crates: the tiny GPT on data-parallel thread
/// ranks with ZeRO, checkpoints that resume bitwise and reshard.
#[derive(Debug, Parser)]
#[command(name = "custom_loop")]
struct Args {
    /// Data-parallel thread ranks (divides the global batch of 8)
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// ZeRO stage, 0-3
    #[arg(long, default_value = "2")]
    zero: ZeroStage,
    /// Optimizer steps
    #[arg(long, default_value_t = 30)]
    steps: u64,
    /// A checkpoint every K steps
    #[arg(long, value_name = "K", default_value_t = 10)]
    every: u64,
    /// The optimizer as JSON (default: AdamW)
    #[arg(long, value_name = "JSON")]
    optimizer: Option<OptimizerConfig>,
    /// Output folder (metrics.jsonl, checkpoints/)
    #[arg(long, value_name = "DIR", default_value = "runs/custom_loop")]
    out: PathBuf,
    /// Resume from the newest checkpoint (of any dp and ZeRO stage)
    #[arg(long)]
    resume: bool,
    /// Train in f32 (default: f16 compute with dynamic loss scaling)
    #[arg(long)]
    f32: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (dp, zero, steps, every) = (args.dp, args.zero, args.steps, args.every);
    let optimizer = args.optimizer.unwrap_or_default();
    let (out, resume, f32) = (args.out.clone(), args.resume, args.f32);
    // the tokenizer (512 ids, as the tiny model) and token shards, built once under the cache
    let mut pc = PrepareConfig::new("data", default_cache_dir().join("custom_loop"));
    (pc.corpora, pc.vocab_size) = (vec!["shakespeare".into()], 512);
    let corpus = prepare_corpus(&pc)?;
    let train = |comm: ThreadComm| -> Result<(u64, f32)> {
        let world: Arc<dyn Communicator> = Arc::new(comm);
        let dtype = if f32 { DType::F32 } else { DType::F16 };
        let opts = GptOptions::seeded(1).with_compute_dtype(dtype);
        let model = Gpt::new(&GptConfig::tiny(), &opts)?;
        let dpc = DataParallelConfig {
            stage: zero,
            max_grad_norm: Some(1.0),
            recompute: RecomputePolicy::EveryBlock,
            optimizer, // AdamW by default: no decay on biases, norms, embeddings (below)
            ..DataParallelConfig::default()
        };
        let mut engine = DataParallel::new(&model.segment_param_lists(), &*world, dpc)?
            .with_param_splits(&model.param_splits())?
            .with_decay_groups(&model.param_kinds(), &WeightDecayGroups::default())?;
        let mut scaler: Box<dyn LossScaler> = Box::new(DynamicLossScaler::default());
        if f32 {
            scaler = Box::new(NoScaler); // f32 needs no loss scaling
        }
        let mut schedule = WarmupDecay::cosine(3e-3, 3e-4, 5, steps)?;
        let per = GLOBAL_BATCH / dp;
        let mut lc = LoaderConfig::new(CTX, per);
        (lc.dp, lc.rank, lc.seed) = (dp, world.rank(), 7);
        let mut loader =
            DataLoader::new(corpus.train_sources(kiln::data::Verify::Full)?, None, lc)?;
        let mut detectors = DetectorSet::standard();
        let policy = BreakerPolicy {
            on_loss_spike: Response::SkipBatch,
            ..Default::default()
        };
        let (mut breaker, mut step) = (CircuitBreaker::new(policy)?, Step(0));
        // every component saves and restores itself; the engine asks for the slices of each
        // parameter it needs, so a checkpoint of another dp or ZeRO stage loads too
        let layout = Layout::new(dp, 1, zero)?;
        let storage = Arc::new(LocalFs::new(out.join("checkpoints"))?);
        let mut ckpt = Checkpointer::new(storage, CheckpointConfig::new(layout, "gpt-tiny"))?;
        if resume {
            let req = ReshardRequest::new(layout).component("engine", &engine);
            if let Some(l) = ckpt.load_latest_resharded(&*world, &req)?.loaded {
                l.state.restore_all(
                    &mut [
                        ("engine", &mut engine),
                        ("scaler", &mut scaler),
                        ("loader", &mut loader),
                        ("detectors", &mut detectors),
                        ("breaker", &mut breaker),
                        ("schedule", &mut schedule),
                        ("step", &mut step),
                    ],
                    LoadOptions::default(),
                )?;
            }
        }
        let (first, mut loss) = (step.0, f32::NAN);
        let mut sink = MultiSink::new(); // rank 0 logs, the others keep it empty
        if world.rank() == 0 {
            sink.push(Box::new(ConsoleSink::new(Some(steps), 10)));
            sink.push(Box::new(JsonlSink::append(out.join("metrics.jsonl"))?));
        }
        while step.0 < steps {
            let b = loader.next_batch()?;
            let x = Tensor::from_slice(&b.inputs, (per, CTX), &Device::Cpu)?;
            let y = Tensor::from_slice(&b.targets, (per, CTX), &Device::Cpu)?;
            let lr = schedule.lr(engine.steps()); // a skipped step does not advance it
            let p = engine.backward(&model, &[MicroBatch::new(x, y)?], &mut *scaler)?;
            step.0 += 1;
            let mut m = StepMetrics::new(step.0);
            (m.loss, m.grad_norm, m.lr) = (Some(p.loss as f64), p.grad_norm, Some(lr as f64));
            // every rank judges alike (loss and norm are global), before the update
            let d = breaker.decide(step.0, &detectors.observe(&m), &BatchInfo::default());
            let applied = !p.found_inf && d.action.applies_update();
            loss = if applied {
                engine.apply(lr)?
            } else {
                engine.discard()?
            }
            .loss;
            (m.loss_scale, m.skipped_steps) =
                (Some(p.loss_scale as f64), Some(u64::from(!applied)));
            sink.record(&m)?;
            sink.events(&d.events)?;
            if step.0 % every == 0 || step.0 == steps {
                let st = RankState::capture_all(&[
                    ("engine", &engine as &dyn Stateful),
                    ("scaler", &scaler),
                    ("loader", &loader),
                    ("detectors", &detectors),
                    ("breaker", &breaker),
                    ("schedule", &schedule),
                    ("step", &step),
                ])?;
                ckpt.save(&*world, step.0, &st)?;
            }
        }
        sink.close()?;
        Ok((first, loss))
    };
    let outs = kiln::comm::spawn(dp, train).map_err(|e| anyhow::anyhow!("{e}"))?;
    let (from, loss) = outs[0];
    println!(
        "custom loop: steps {from}..{steps} on {dp} ranks, ZeRO-{}, final loss {loss:.4}",
        zero.number()
    );
    println!("  outputs in {}", out.display());
    Ok(())
}
