//! ZeRO-3: the `train_gpt` model and data on 4 data-parallel thread ranks, with parameters,
//! gradients and optimizer states sharded (each segment's parameters are all-gathered just
//! before it runs and dropped after). The micro-batch is chosen by kiln-memory's estimate
//! under a budget of 1 GiB per rank (`train.dynamic_batch`), keeping the global batch.
//!
//! Run: `cargo run --release --example train_gpt_zero3` (same flags as `train_gpt`).

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

#[path = "common/gpt_run.rs"]
mod gpt_run;

fn main() -> anyhow::Result<()> {
    gpt_run::main_for("train_gpt_zero3")
}
