//! ZeRO-3: the `train_gpt` model and data on 4 data-parallel thread ranks, with parameters,
//! gradients and optimizer states sharded (each segment's parameters are all-gathered just
//! before it runs and dropped after). The micro-batch is chosen by kiln-memory's estimate
//! under a budget of 1 GiB per rank (`train.dynamic_batch`), keeping the global batch.
//!
//! Run: `cargo run --release --example train_gpt_zero3` (same flags as `train_gpt`).

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln::alloc::KilnAlloc = kiln::alloc::KilnAlloc;

use clap::Parser;

/// The train_gpt model on 4 data-parallel thread ranks with ZeRO-3.
#[derive(Debug, Parser)]
#[command(name = "train_gpt_zero3")]
struct Args {
    #[command(flatten)]
    run: kiln_cli::train::TrainArgs,
}

fn main() -> anyhow::Result<()> {
    // the run preset `train_gpt_zero3` with the command line's flags, trained, summarised and sampled
    Args::parse()
        .run
        .train("train_gpt_zero3", "train_gpt_zero3")
}
