//! Preference alignment on a synthetic preference set generated in code (the preferred
//! response repeats the prompt's last word, the dispreferred one is another word): first a
//! reward model (a scalar head on the decoder, Bradley-Terry loss), then DPO of the policy
//! against its frozen starting point, both written from kiln's crates (the data-parallel
//! engine, tensor parallelism, ZeRO, checkpoints that resume, kiln-monitor's sinks with the DPO
//! statistics as extra scalars). Prints the held-out preference accuracy before and after.
//!
//! Run: `cargo run --release --example dpo` (flags: `--dp 2`, `--tp 1`, `--zero 1`, `--steps
//! 150`, `--reward-steps 100`, `--beta 0.1`, `--lr 3e-3`, `--out runs/dpo`, `--resume`).

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln::alloc::KilnAlloc = kiln::alloc::KilnAlloc;

use anyhow::{bail, Result};
use candle_core::Device;
use kiln::ckpt::{CheckpointConfig, Checkpointer, Layout, LoadOptions, LocalFs, RankState};
use kiln::ckpt::{ReshardRequest, Stateful, Step};
use kiln::comm::Communicator;
use kiln::model::{Gpt, GptConfig, GptOptions};
use kiln::monitor::{ConsoleSink, JsonlSink, MetricSink, MultiSink, StepMetrics};
use kiln::parallel::{DataParallel, DataParallelConfig, ParallelDims, ZeroStage};
use kiln::precision::NoScaler;
use kiln::tune::{
    last_word_pairs, model_log_probs, preference_batch, DpoConfig, DpoObjective, ExampleLoader,
    PreferencePair, RewardModel, IGNORE_INDEX,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

const CTX: usize = 8;
const PAIRS_PER_STEP: usize = 16;

/// A reward model and DPO on synthetic preference pairs, from a pretrained tiny GPT.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "dpo")]
struct Args {
    /// Data-parallel thread ranks (divides the 16 pairs of a step)
    #[arg(long, value_name = "N", default_value_t = 2)]
    dp: usize,
    /// Tensor-parallel thread ranks
    #[arg(long, value_name = "N", default_value_t = 1)]
    tp: usize,
    /// ZeRO stage, 0-3
    #[arg(long, value_name = "STAGE", default_value = "1")]
    zero: ZeroStage,
    /// DPO steps
    #[arg(long, value_name = "N", default_value_t = 150)]
    steps: u64,
    /// Reward-model steps
    #[arg(long, value_name = "N", default_value_t = 100)]
    reward_steps: u64,
    /// DPO's beta
    #[arg(long, value_name = "B", default_value_t = 0.1)]
    beta: f64,
    /// Learning rate
    #[arg(long, value_name = "LR", default_value_t = 3e-3)]
    lr: f32,
    /// Output folder
    #[arg(long, value_name = "DIR", default_value = "runs/dpo")]
    out: PathBuf,
    /// Resume from the newest checkpoint
    #[arg(long)]
    resume: bool,
}

/// The command line, checked.
fn args() -> Result<Args> {
    let a = <Args as clap::Parser>::parse();
    if PAIRS_PER_STEP % a.dp != 0 {
        bail!(
            "--dp ({}) must divide the {PAIRS_PER_STEP} pairs of a step",
            a.dp
        );
    }
    Ok(a)
}

fn opts() -> GptOptions {
    GptOptions {
        ignore_index: Some(IGNORE_INDEX),
        ..GptOptions::seeded(1)
    }
}

/// The model on this rank: dense, or its tensor-parallel shard.
fn build(cfg: &GptConfig, tp: &Arc<dyn Communicator>) -> Result<Gpt> {
    Ok(if tp.world_size() > 1 {
        Gpt::tensor_parallel(cfg, &opts(), tp.clone())?
    } else {
        Gpt::new(cfg, &opts())?
    })
}

struct Report {
    reward: (f64, f64),
    dpo_reward_acc: (f64, f64),
    dpo_policy_acc: (f64, f64),
    margin: f64,
    from: u64,
}

fn rank(world: Arc<dyn Communicator>, a: &Args) -> Result<Report> {
    let cfg = GptConfig::tiny();
    let dims = ParallelDims::new(a.dp, a.tp, world.world_size(), &cfg.shape())?;
    let groups = dims.build_groups(&*world)?;
    let dp: Arc<dyn Communicator> = Arc::from(groups.dp);
    let tp: Arc<dyn Communicator> = Arc::from(groups.tp);
    let dp_rank = dims.dp_rank(world.rank());
    let train = last_word_pairs(4096, 16, 4, 10)?;
    let held_out = last_word_pairs(512, 16, 4, 20)?;
    let hrefs: Vec<&PreferencePair> = held_out.iter().collect();
    let hb = preference_batch(&hrefs, CTX, &Device::Cpu)?;
    let dpc = DataParallelConfig {
        stage: a.zero,
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    let per = PAIRS_PER_STEP / a.dp;
    let main = world.rank() == 0;

    // 1. the reward model
    let rm = RewardModel::new(build(&cfg, &tp)?, 2)?;
    let rm_before = rm.evaluate(&hb)?.accuracy();
    let mut engine = DataParallel::new(&rm.segment_param_lists(), &*dp, dpc)?
        .with_world(world.clone())
        .with_param_splits(&rm.param_splits())?;
    if a.tp > 1 {
        engine = engine.with_tensor_parallel(tp.clone());
    }
    let mut loader = ExampleLoader::new(train.len(), a.dp, dp_rank, per, 3)?;
    for _ in 0..a.reward_steps {
        let idx = loader.next_indices()?;
        let refs: Vec<&PreferencePair> = idx.iter().map(|&i| &train[i]).collect();
        let b = preference_batch(&refs, CTX, &Device::Cpu)?;
        engine.step(&rm, &[RewardModel::micro_batch(&b)?], 1e-3, &mut NoScaler)?;
        rm.take_stats();
    }
    if dpc.stage == ZeroStage::Zero3 {
        write_back(&engine, &rm.segment_param_lists())?;
    }
    let rm_after = rm.evaluate(&hb)?.accuracy();
    if main {
        println!(
            "reward model: {} steps, held-out pairwise accuracy {:.1}% -> {:.1}%",
            a.reward_steps,
            100.0 * rm_before,
            100.0 * rm_after
        );
    }
    drop(engine);

    // 2. DPO against the frozen starting point
    let mut reference = build(&cfg, &tp)?;
    reference.freeze(|_| true);
    let policy = build(&cfg, &tp)?;
    let dpo = DpoObjective::new(
        &policy,
        DpoConfig {
            beta: a.beta,
            ..Default::default()
        },
    )?;
    let h_ref = model_log_probs(&reference, &hb.inputs, &hb.targets)?;
    let before = dpo.evaluate(&hb, &h_ref)?;
    let mut engine = DataParallel::new(&policy.segment_param_lists(), &*dp, dpc)?
        .with_world(world.clone())
        .with_param_splits(&policy.param_splits())?;
    if a.tp > 1 {
        engine = engine.with_tensor_parallel(tp.clone());
    }
    let mut loader = ExampleLoader::new(train.len(), a.dp, dp_rank, per, 5)?;
    let mut step = Step(0);
    let layout = Layout::new(a.dp, a.tp, a.zero)?;
    let storage = Arc::new(LocalFs::new(a.out.join("checkpoints"))?);
    let mut ckpt = Checkpointer::new(storage, CheckpointConfig::new(layout, "dpo-tiny"))?;
    if a.resume {
        let req = ReshardRequest::new(layout).component("engine", &engine);
        if let Some(l) = ckpt.load_latest_resharded(&*world, &req)?.loaded {
            l.state.restore_all(
                &mut [
                    ("engine", &mut engine),
                    ("loader", &mut loader),
                    ("step", &mut step),
                ],
                LoadOptions::default(),
            )?;
        }
    }
    let from = step.0;
    let mut sink = MultiSink::new();
    if main {
        sink.push(Box::new(ConsoleSink::new(Some(a.steps), 25)));
        sink.push(Box::new(JsonlSink::append(a.out.join("metrics.jsonl"))?));
    }
    while step.0 < a.steps {
        let idx = loader.next_indices()?;
        let refs: Vec<&PreferencePair> = idx.iter().map(|&i| &train[i]).collect();
        let b = preference_batch(&refs, CTX, &Device::Cpu)?;
        let ref_lp = model_log_probs(&reference, &b.inputs, &b.targets)?;
        let mb = DpoObjective::micro_batch(&b, &ref_lp)?;
        let r = engine.step(&dpo, &[mb], a.lr, &mut NoScaler)?;
        step.0 += 1;
        let stats = dpo.take_stats().all_reduce(&*dp)?;
        let mut m = StepMetrics::new(step.0);
        (m.loss, m.grad_norm, m.lr) = (Some(r.loss as f64), r.grad_norm, Some(a.lr as f64));
        m.extra.extend(stats.metrics());
        sink.record(&m)?;
        if step.0 % 50 == 0 || step.0 == a.steps {
            let st = RankState::capture_all(&[
                ("engine", &engine as &dyn Stateful),
                ("loader", &loader),
                ("step", &step),
            ])?;
            ckpt.save(&*world, step.0, &st)?;
        }
    }
    sink.close()?;
    if dpc.stage == ZeroStage::Zero3 {
        write_back(&engine, &policy.segment_param_lists())?;
    }
    let after = dpo.evaluate(&hb, &h_ref)?;
    Ok(Report {
        reward: (rm_before, rm_after),
        dpo_reward_acc: (before.reward_accuracy(), after.reward_accuracy()),
        dpo_policy_acc: (before.policy_accuracy(), after.policy_accuracy()),
        margin: after.margin(),
        from,
    })
}

/// Under ZeRO-3 the engine holds the trained weights as shards: gathers them into the model's
/// variables, for evaluation (collective over the data-parallel group).
fn write_back(engine: &DataParallel, lists: &[Vec<(String, candle_core::Var)>]) -> Result<()> {
    let vars: std::collections::HashMap<String, candle_core::Var> =
        lists.iter().flatten().cloned().collect();
    for (name, values) in engine.full_params()? {
        if let Some(v) = vars.get(&name) {
            kiln::parallel::write_var(v, &values)?;
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let a = args()?;
    if !a.resume {
        let _ = std::fs::remove_dir_all(&a.out);
    }
    std::fs::create_dir_all(&a.out)?;
    let t0 = Instant::now();
    println!(
        "dpo: tiny GPT on {} thread ranks (dp={} x tp={}, ZeRO-{}), {PAIRS_PER_STEP} pairs per step",
        a.dp * a.tp,
        a.dp,
        a.tp,
        a.zero.number()
    );
    let shared = a.clone();
    let outs = kiln::comm::spawn(a.dp * a.tp, move |comm| rank(Arc::new(comm), &shared))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let r = &outs[0];
    if r.from > 0 {
        println!("resumed DPO from step {}", r.from);
    }
    println!();
    println!(
        "reward model: held-out pairwise accuracy {:.1}% -> {:.1}%",
        100.0 * r.reward.0,
        100.0 * r.reward.1
    );
    println!(
        "DPO (beta {}): held-out preference accuracy (implicit reward) {:.1}% -> {:.1}%, policy \
         prefers the chosen response {:.1}% -> {:.1}%, mean reward margin {:.3}",
        a.beta,
        100.0 * r.dpo_reward_acc.0,
        100.0 * r.dpo_reward_acc.1,
        100.0 * r.dpo_policy_acc.0,
        100.0 * r.dpo_policy_acc.1,
        r.margin
    );
    println!(
        "metrics in {}, checkpoints in {}; done in {:.1} s",
        a.out.join("metrics.jsonl").display(),
        a.out.join("checkpoints").display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
