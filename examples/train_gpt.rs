//! The main job: the GPT-3 architecture scaled down (`small_cpu`: 4 layers, d_model 256,
//! 4 heads, vocab 8192) trained on the committed corpus by 4 thread ranks as data parallel 2 x
//! tensor parallel 2 with ZeRO-1, fp16 compute with dynamic loss scaling, activation
//! checkpointing, warmup + cosine, clipping, checkpoints, spike detection with rollback, and
//! JSONL + TensorBoard + PNG metrics. Prints progress, where the outputs went, and a sample.
//!
//! Run: `cargo run --release --example train_gpt` (flags: `--preset small_cpu`, `--dp 2`,
//! `--tp 2`, `--zero 1`, `--precision f16|bf16|f32`, `--steps N`, `--resume`,
//! `--config run.toml`, and any `RunConfig` field as `--section.field value`; `--help` lists
//! them). `kiln train` (the `kiln` command) runs the same job.
//!
//! As 4 processes over MPI (one rank each): `cargo build --release --features mpi --example
//! train_gpt`, then `mpirun -np 4 target/release/examples/train_gpt --backend mpi`.

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln::alloc::KilnAlloc = kiln::alloc::KilnAlloc;

use clap::Parser;

/// The main job: the GPT-3 architecture scaled down, trained by 4 thread ranks as dp=2 x
/// tp=2 with ZeRO-1 and fp16.
#[derive(Debug, Parser)]
#[command(name = "train_gpt")]
struct Args {
    #[command(flatten)]
    run: kiln_cli::train::TrainArgs,
}

fn main() -> anyhow::Result<()> {
    // the run preset `train_gpt` with the command line's flags, trained, summarised and sampled
    Args::parse().run.train("train_gpt", "train_gpt")
}
