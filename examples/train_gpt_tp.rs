//! Tensor parallel: the `train_gpt` model split over 4 thread ranks (Megatron-LM: QKV and fc1
//! column-parallel, the output projections row-parallel, a vocab-parallel embedding and
//! cross-entropy).
//!
//! Run: `cargo run --release --example train_gpt_tp` (same flags as `train_gpt`).

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln::alloc::KilnAlloc = kiln::alloc::KilnAlloc;

use clap::Parser;

/// The train_gpt model split over 4 tensor-parallel thread ranks.
#[derive(Debug, Parser)]
#[command(name = "train_gpt_tp")]
struct Args {
    #[command(flatten)]
    run: kiln_cli::train::TrainArgs,
}

fn main() -> anyhow::Result<()> {
    // the run preset `train_gpt_tp` with the command line's flags, trained, summarised and sampled
    Args::parse().run.train("train_gpt_tp", "train_gpt_tp")
}
