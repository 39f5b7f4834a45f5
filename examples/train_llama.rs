//! The main job with the Llama layout: `llama_cpu` (4 layers, d_model 256, 8 query heads of
//! 32 sharing 2 key/value heads, RMSNorm, rotary positions, a SwiGLU MLP of 704, no biases, an
//! untied head, vocab 8192) trained on the committed corpus by 4 thread ranks as data parallel
//! 2 x tensor parallel 2 with sequence parallelism and ZeRO-1, fp16 compute with dynamic loss
//! scaling, selective activation checkpointing, warmup + cosine, clipping, checkpoints, spike
//! detection with rollback, the quality filter, the mixture schedule and the drift monitor.
//! Prints progress, the validation loss, where the outputs went, and a sample.
//!
//! Run: `cargo run --release --example train_llama` (the flags of `train_gpt`: `--steps N`,
//! `--dp`, `--tp`, `--zero`, `--precision f16|bf16|f32`, `--resume`, `--config run.toml`,
//! any `RunConfig` field as `--section.field value`; `--help` lists them). `kiln train --run
//! train_llama` runs the same job.

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln::alloc::KilnAlloc = kiln::alloc::KilnAlloc;

use clap::Parser;

/// The main job with the Llama layout, trained by 4 thread ranks as dp=2 x tp=2 with ZeRO-1
/// and fp16.
#[derive(Debug, Parser)]
#[command(name = "train_llama")]
struct Args {
    #[command(flatten)]
    run: kiln_cli::train::TrainArgs,
}

fn main() -> anyhow::Result<()> {
    // the run preset `train_llama` with the command line's flags, trained, summarised and sampled
    Args::parse().run.train("train_llama", "train_llama")
}
