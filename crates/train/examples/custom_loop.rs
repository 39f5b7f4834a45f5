//! A training loop written by hand from kiln's crates, without kiln-train's `Trainer`: the
//! trainer is a convenience, not a cage. Two thread ranks train the `tiny` GPT data-parallel
//! with ZeRO-1, fp16 compute and dynamic loss scaling, activation checkpointing, warmup +
//! cosine and clipping; spike detectors judge each step before its update (this loop skips a
//! spiking batch instead of rolling back); rank 0 logs to the console and a JSONL file; the
//! run ends with a sharded checkpoint.
//!
//! Run: `cargo run --release -p kiln-train --example custom_loop`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use kiln_ckpt::{
    CheckpointConfig, Checkpointer, Layout, LocalFs, RankState, Shard, StateDict, Step, TensorData,
};
use kiln_comm::Communicator;
use kiln_data::{
    default_cache_dir, prepare_corpus, DataLoader, LoaderConfig, PrepareConfig, Verify,
};
use kiln_memory::CheckpointPolicy;
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_monitor::{
    BatchInfo, BreakerPolicy, CircuitBreaker, ConsoleSink, DetectorSet, JsonlSink, MetricSink,
    MultiSink, Response, StepMetrics,
};
use kiln_optim::{LrSchedule, Optimizer, WarmupDecay};
use kiln_parallel::{DataParallel, DataParallelConfig, Stage};
use kiln_precision::DynamicLossScaler;
use std::sync::Arc;
use std::time::Instant;

const STEPS: u64 = 60;
const DP: usize = 2;
const BATCH: usize = 4; // sequences per rank and step
const CTX: usize = 64;

fn main() -> Result<()> {
    // the tokenizer (512 ids, as the tiny model) and token shards, built once under the cache
    let corpus = prepare_corpus(&PrepareConfig {
        corpora: vec!["shakespeare".into()],
        vocab_size: 512,
        tokenizer_sample_bytes: 1 << 20,
        ..PrepareConfig::new("data", default_cache_dir().join("custom_loop"))
    })?;
    let out_dir = std::path::PathBuf::from("runs/custom_loop");
    std::fs::create_dir_all(&out_dir)?;
    let cfg = GptConfig::tiny();
    let losses = kiln_comm::spawn(DP, |comm| -> Result<(f32, f32)> {
        // data parallel only: the world is the data-parallel group (see ParallelDims for dp x tp)
        let world: Arc<dyn Communicator> = Arc::new(comm);
        let rank = world.rank();

        let model = Gpt::new(&cfg, &GptOptions::seeded(1).with_compute_dtype(DType::F16))?;
        let dpc = DataParallelConfig {
            stage: Stage::Zero1,
            max_grad_norm: Some(1.0),
            checkpoint: CheckpointPolicy::EveryBlock,
            ..DataParallelConfig::default()
        };
        let mut engine = DataParallel::new(&model.segment_param_lists(), &*world, dpc)?;
        let mut scaler = DynamicLossScaler::new(Default::default())?;
        let schedule = WarmupDecay::cosine(3e-3, 3e-4, 10, STEPS)?;
        let lc = LoaderConfig {
            dp: DP,
            rank,
            seed: 7,
            ..LoaderConfig::new(CTX, BATCH)
        };
        let mut loader = DataLoader::new(corpus.train_sources(Verify::Full)?, None, lc)?;

        // every rank judges every step the same way (the loss and gradient norm are global)
        let mut detectors = DetectorSet::standard();
        let on_loss_spike = Response::SkipBatch;
        let mut breaker = CircuitBreaker::new(BreakerPolicy {
            on_loss_spike,
            ..Default::default()
        })?;
        let mut sink = MultiSink::new(); // rank 0 logs, the others keep it empty
        if rank == 0 {
            sink.push(Box::new(ConsoleSink::new(Some(STEPS), 10)));
            sink.push(Box::new(JsonlSink::create(out_dir.join("metrics.jsonl"))?));
        }

        let mut losses = Vec::new();
        for step in 1..=STEPS {
            let t0 = Instant::now();
            let batch = loader.next_batch()?;
            let x = Tensor::from_slice(&batch.inputs, (BATCH, CTX), &Device::Cpu)?;
            let y = Tensor::from_slice(&batch.targets, (BATCH, CTX), &Device::Cpu)?;
            // the schedule follows optimizer steps: a skipped step does not advance it
            let lr = schedule.lr(engine.optimizers()[0].step_count());
            let mut events = Vec::new();
            let (r, applied) = engine.step_gated(&model, &[(x, y)], lr, &mut scaler, &mut |p| {
                let mut m = StepMetrics::new(step);
                (m.loss, m.grad_norm) = (Some(p.loss as f64), p.grad_norm);
                let decision = breaker.decide(step, &detectors.observe(&m), &BatchInfo::default());
                events = decision.events;
                decision.action.applies_update()
            })?;
            let mut m = StepMetrics::new(step);
            (m.loss, m.grad_norm, m.lr) = (Some(r.loss as f64), r.grad_norm, Some(lr as f64));
            m.loss_scale = Some(r.loss_scale as f64);
            m.skipped_steps = Some(u64::from(!applied));
            let secs = t0.elapsed().as_secs_f64();
            m.set_throughput((DP * BATCH * CTX) as u64, (DP * BATCH) as u64, secs);
            sink.record(&m)?;
            sink.events(&events)?;
            losses.push(r.loss);
        }

        // a checkpoint: each rank's ZeRO chunk of every flat unit, as a flat shard of the unit
        let mut weights = StateDict::new();
        for (u, chunk) in engine.master().iter().enumerate() {
            let len = engine.layout().units()[u].len;
            let (shard, data) = (
                Shard::flat_chunk(&[len], DP, rank)?,
                TensorData::from_vec1(chunk),
            );
            weights.insert_sharded(&format!("unit{u:03}"), data, shard)?;
        }
        let mut state = RankState::new();
        state.insert("model", weights)?;
        state.capture("step", &Step(STEPS))?;
        let storage = Arc::new(LocalFs::new(out_dir.join("checkpoints"))?);
        let layout = Layout::new(DP, 1, 1)?;
        let mut ckpt = Checkpointer::new(storage, CheckpointConfig::new(layout, "gpt-tiny"))?;
        ckpt.save(&*world, STEPS, &state)?;
        sink.close()?;
        Ok((losses[0], losses[losses.len() - 1]))
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;

    let (first, last) = losses[0];
    println!("custom loop: loss {first:.3} -> {last:.3} in {STEPS} steps on {DP} ranks");
    println!("  metrics     {}", out_dir.join("metrics.jsonl").display());
    println!("  checkpoint  {}", out_dir.join("checkpoints").display());
    anyhow::ensure!(last < first, "the loss did not decrease");
    Ok(())
}
