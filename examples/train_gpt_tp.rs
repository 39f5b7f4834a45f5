//! Tensor parallel: the `train_gpt` model split over 4 thread ranks (Megatron-LM: QKV and fc1
//! column-parallel, the output projections row-parallel, a vocab-parallel embedding and
//! cross-entropy).
//!
//! Run: `cargo run --release --example train_gpt_tp` (same flags as `train_gpt`).

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

#[path = "common/gpt_run.rs"]
mod gpt_run;

fn main() -> anyhow::Result<()> {
    gpt_run::main_for("train_gpt_tp")
}
