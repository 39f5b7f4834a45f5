//! The main job: the GPT-3 architecture scaled down (`small_cpu`: 4 layers, d_model 256,
//! 4 heads, vocab 8192) trained on the committed corpus by 4 thread ranks as data parallel 2 x
//! tensor parallel 2 with ZeRO-1, fp16 compute with dynamic loss scaling, activation
//! checkpointing, warmup + cosine, clipping, checkpoints, spike detection with rollback, and
//! JSONL + TensorBoard + PNG metrics. Prints progress, where the outputs went, and a sample.
//!
//! Run: `cargo run --release --example train_gpt` (flags: `--preset small_cpu`, `--dp 2`,
//! `--tp 2`, `--zero 1`, `--precision f16|bf16|f32`, `--steps N`, `--resume`,
//! `--config run.toml`, and any `RunConfig` field as `--section.field value`).
//!
//! As 4 processes over MPI (one rank each): `cargo build --release --features mpi --example
//! train_gpt`, then `mpirun -np 4 target/release/examples/train_gpt --backend mpi`.

#[path = "common/alloc.rs"]
mod alloc;
// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: alloc::KilnAlloc = alloc::KilnAlloc;

#[path = "common/gpt_run.rs"]
mod gpt_run;

fn main() -> anyhow::Result<()> {
    gpt_run::main_for("train_gpt")
}
