//! Memory per rank for a GPT preset under every ZeRO stage, for a given dp x tp grid.
//!
//! Prints the ZeRO paper's model-state accounting (16-bit weights and gradients, fp32 master
//! weights and Adam moments: 2 + 2 + 12 bytes per parameter) split over the data-parallel group,
//! the activations of one micro-batch with and without activation checkpointing, and the
//! communication buffers.
//!
//! Run: `cargo run --release --example plan_memory -- gpt3_175b --dp 64 --tp 8`
//! (other presets: `gpt3_small` ... `gpt3_6_7b`, `small_cpu`, `tiny`; `--micro-batch N`,
//! `--precision f32`, `--sequence-parallel` to split the activations tensor parallelism
//! replicates over the tp ranks too).

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

use kiln_memory::{CheckpointPolicy, MemPrecision, MemoryPlan, ShardingStage};
use kiln_model::GptConfig;

fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let preset = args
        .first()
        .filter(|a| !a.starts_with("--"))
        .cloned()
        .unwrap_or_else(|| "gpt3_175b".into());
    let dp: u64 = flag("--dp").map(|s| s.parse()).transpose()?.unwrap_or(64);
    let tp: u64 = flag("--tp").map(|s| s.parse()).transpose()?.unwrap_or(8);
    let micro_batch: u64 = flag("--micro-batch")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1);
    let precision = match flag("--precision").as_deref() {
        Some("f32") => MemPrecision::F32,
        _ => MemPrecision::Mixed16,
    };
    let sequence_parallel = args.iter().any(|a| a == "--sequence-parallel");
    let cfg = GptConfig::by_name(&preset)?;
    let shape = cfg.shape();
    println!(
        "{preset}: {:.2}B parameters ({} layers, d_model {}, {} heads, ctx {}, vocab {}), dp={dp} tp={tp}{}, micro-batch {micro_batch}, {precision:?}",
        shape.params() as f64 / 1e9,
        shape.n_layers,
        shape.d_model,
        shape.n_heads,
        shape.ctx,
        shape.vocab,
        if sequence_parallel { " sequence-parallel" } else { "" }
    );
    println!(
        "{:<11} {:>12} {:>10} {:>12} {:>13} {:>16} {:>9} {:>13} {:>16}",
        "stage",
        "params/rank",
        "weights",
        "gradients",
        "optimizer",
        "model states",
        "comm",
        "activations",
        "act (no ckpt)"
    );
    for (name, stage) in [
        ("replicated", ShardingStage::Replicated),
        ("zero-1", ShardingStage::Zero1),
        ("zero-2", ShardingStage::Zero2),
        ("zero-3", ShardingStage::Zero3),
    ] {
        let plan = MemoryPlan {
            shape,
            precision,
            stage,
            dp,
            tp,
            micro_batch,
            checkpointing: CheckpointPolicy::EveryBlock,
            bucket_bytes: 25 << 20,
            sequence_parallel,
        };
        let e = plan.estimate()?;
        let no_ckpt = MemoryPlan {
            checkpointing: CheckpointPolicy::None,
            ..plan
        }
        .activation_bytes();
        println!(
            "{:<11} {:>12} {:>10} {:>12} {:>13} {:>16} {:>9} {:>13} {:>16}",
            name,
            e.params_per_rank,
            gib(e.weights),
            gib(e.grads),
            gib(e.optimizer),
            gib(e.model_states()),
            gib(e.comm_buffers),
            gib(e.activations),
            gib(no_ckpt)
        );
    }
    println!("(GiB per rank; activations for one micro-batch, with activation checkpointing every block unless noted)");
    Ok(())
}
