//! A simulated training run wired to every part of kiln-monitor: the loss of a toy run with
//! one poisoned sample, the standard detectors, the circuit breaker rolling back to the last
//! checkpoint and skipping the poisoned batch, and all sinks (console, JSONL, TensorBoard,
//! PNG plot).
//!
//! Run: `cargo run --release --example monitor_run [-- OUT_DIR]`
//! (default `target/monitor_run`), then look at `OUT_DIR/run.png`, or run
//! `tensorboard --logdir OUT_DIR/tb`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln::alloc::KilnAlloc = kiln::alloc::KilnAlloc;

use kiln::monitor::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashSet;
use std::path::PathBuf;

const STEPS: u64 = 800;
const BATCH: usize = 4;
const CKPT_EVERY: u64 = 50;
const POISONED: u64 = 1_703;

/// What a checkpoint of the toy run holds: the data cursor and the noise stream position.
#[derive(Clone)]
struct Ckpt {
    step: u64,
    cursor: u64,
    rng: ChaCha8Rng,
}

/// A simulated training run wired to every part of kiln-monitor.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "monitor_run")]
struct Args {
    /// Where the sinks write (run.jsonl, tb/, run.png)
    #[arg(value_name = "OUT_DIR", default_value = "target/monitor_run")]
    out: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let out = <Args as clap::Parser>::parse().out;
    let mut sinks = MultiSink::new()
        .with(ConsoleSink::new(Some(STEPS), 100))
        .with(JsonlSink::create(out.join("run.jsonl"))?)
        .with(TensorBoardSink::create(out.join("tb"))?)
        .with(PlotSink::new(out.join("run.png")));
    let mut detectors = DetectorSet::standard();
    let mut breaker = CircuitBreaker::new(BreakerPolicy::default())?;
    // MFU against this machine's f32 peak (cores x clock x vector units), its basis printed;
    // none where the CPU does not say enough to compute it
    let mfu = match CpuInfo::probe().and_then(|cpu| cpu.peak(kiln::state::DType::F32)) {
        Ok(peak) => {
            println!("mfu of the simulated step times against the {peak}");
            Some(Mfu::new(
                Mfu::transformer_flops_per_token(3_200_000, 4, 256, 128),
                peak.flops_per_s,
            )?)
        }
        Err(e) => {
            println!("mfu not reported: {e}");
            None
        }
    };

    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut cursor = 0u64;
    let mut ckpt = Ckpt {
        step: 0,
        cursor,
        rng: rng.clone(),
    };
    let mut step = 0u64;
    let mut skipped_steps = 0u64;
    while step < STEPS {
        step += 1;
        // the data loader: the next BATCH ids that no skipped window holds
        let skip: HashSet<u64> = breaker.breaker_state().skipped_sample_ids();
        let mut ids = Vec::with_capacity(BATCH);
        while ids.len() < BATCH {
            if !skip.contains(&cursor) {
                ids.push(cursor);
            }
            cursor += 1;
        }
        let t = step as f64;
        let noise: f64 = rng.gen_range(-0.05..0.05);
        let mut loss = 2.0 + 8.0 * (-t / 300.0).exp() + noise;
        if ids.contains(&POISONED) {
            loss *= 1.8;
        }
        let step_time = 0.25 + 0.01 * rng.gen::<f64>();
        let mut m = StepMetrics {
            loss: Some(loss),
            grad_norm: Some(0.8 + 2.0 * (-t / 200.0).exp() + 0.05 * rng.gen::<f64>()),
            lr: Some(3e-4 * breaker.lr_factor(step) * (t / 50.0).min(1.0)),
            skipped_steps: Some(skipped_steps),
            tokens_seen: Some(step * (BATCH as u64) * 128),
            ..StepMetrics::new(step)
        };
        m.set_throughput(BATCH as u64 * 128, BATCH as u64, step_time);
        if let Some(mfu) = &mfu {
            m.set_mfu(mfu);
        }
        m.set_memory();

        let verdicts = detectors.observe(&m);
        let batch = BatchInfo {
            sample_ids: &ids,
            last_checkpoint_step: Some(ckpt.step),
        };
        let decision = breaker.decide(step, &verdicts, &batch);
        sinks.record(&m)?;
        sinks.events(&decision.events)?;
        match decision.into_result()? {
            Action::Rollback { to_step, .. } => {
                // restore everything the checkpoint holds (not the breaker: it keeps the skip)
                assert_eq!(to_step, ckpt.step);
                step = ckpt.step;
                cursor = ckpt.cursor;
                rng = ckpt.rng.clone();
                detectors.rollback(to_step);
                continue;
            }
            Action::SkipBatch => skipped_steps += 1,
            _ => {}
        }
        if step % CKPT_EVERY == 0 {
            ckpt = Ckpt {
                step,
                cursor,
                rng: rng.clone(),
            };
            breaker.checkpoint_saved(step);
        }
    }
    sinks.close()?;
    let st = breaker.breaker_state();
    let mut skipped: Vec<u64> = st.skipped_sample_ids().into_iter().collect();
    skipped.sort_unstable();
    println!(
        "done: {} rollbacks, skipped samples {skipped:?}; wrote {}/run.jsonl, {}/run.png, {}/tb",
        st.rollbacks,
        out.display(),
        out.display(),
        out.display()
    );
    Ok(())
}
