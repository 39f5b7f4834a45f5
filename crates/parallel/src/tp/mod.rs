//! Megatron-LM tensor parallelism as candle building blocks.
//!
//! - The conjugate operators, candle custom ops whose backward runs the conjugate collective
//!   over the tensor-parallel group [`TpComm`]: [`copy_to_tp_region`] (`f`: identity forward,
//!   all-reduce backward) and [`reduce_from_tp_region`] (`g`: all-reduce forward, identity
//!   backward), plus [`gather_from_tp_region`] / [`scatter_to_tp_region`] along the last
//!   dimension.
//! - [`ColumnParallelLinear`] (weight split by output features; QKV and fc1) and
//!   [`RowParallelLinear`] (split by input features, bias added after the all-reduce; attention
//!   output and fc2), or the plain functions [`column_parallel_linear`] and
//!   [`row_parallel_linear`] on tensors.
//! - [`VocabParallelEmbedding`] with its tied head ([`vocab_parallel_logits`]) and
//!   [`vocab_parallel_cross_entropy`], which never gathers the logits.
//! - Megatron's sequence parallelism: [`gather_from_sequence_parallel_region`],
//!   [`reduce_scatter_to_sequence_parallel_region`] and
//!   [`scatter_to_sequence_parallel_region`] split the replicated region (normalisation,
//!   residual, bias) along the token rows; [`column_parallel_linear_sp`],
//!   [`row_parallel_linear_sp`], [`vocab_parallel_embedding_sp`] and
//!   [`sequence_parallel_linear_cross_entropy`] are the layers over it.
//! - [`TpSplit`] and [`shard_column`], [`shard_row`], [`shard_qkv`] (head-aware),
//!   [`shard_vocab`]: whole parameters to shards and back ([`TpSplit::unshard`]).
//!
//! Every rank of the group must run the same ops in the same order, forward and backward. A
//! failed collective inside an op comes back as a candle error carrying the
//! [`kiln_comm::CommError`] text.
//!
//! The ops run on CPU tensors and, with the `cuda` feature, on CUDA tensors. kiln-comm's
//! communicators work on host slices, so on CUDA every collective (and the cross-entropy's
//! row statistics) stages through host memory until a device communicator (NCCL) exists: one
//! device-to-host copy of the op's input, the same host code as on the CPU, one host-to-device
//! copy of its result.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use kiln_parallel::tp::{ColumnParallelLinear, RowParallelLinear, TpComm};
//! use std::sync::Arc;
//! // y = W2 (W1 x): W1 = [[1, 0], [0, 2]] split by rows, W2 = [[1, 1]] split by columns
//! let out = kiln_comm::spawn(2, |comm| {
//!     let tp: TpComm = Arc::new(comm);
//!     let w1 = Tensor::new(&[[1f32, 0.], [0., 2.]], &Device::Cpu)?;
//!     let w2 = Tensor::new(&[[1f32, 1.]], &Device::Cpu)?;
//!     let fc1 = ColumnParallelLinear::from_full(&w1, None, tp.clone())?;
//!     let fc2 = RowParallelLinear::from_full(&w2, None, tp)?;
//!     let x = Var::new(&[[3f32, 4.]], &Device::Cpu)?;
//!     let y = fc2.forward(&fc1.forward(x.as_tensor())?)?;
//!     let dx = y.sum_all()?.backward()?.get(&x).map(|g| g.to_vec2::<f32>()).transpose()?;
//!     Ok::<_, kiln_parallel::ParallelError>((y.to_vec2::<f32>()?, dx))
//! })?;
//! assert_eq!(out[1].0, [[11.]]); // 3 + 2 * 4 on every rank
//! assert_eq!(out[0].1, Some(vec![vec![1., 2.]])); // dy/dx = W2 W1, summed by f
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod linear;
mod ops;
mod sequence;
mod shard;
mod vocab;

/// The precision [`linear`]'s CPU products follow, per thread, and the bf16 kernel this CPU
/// runs: kiln-kernels' own, re-exported where the layers that follow them are.
pub use kiln_kernels::{
    bf16_kernel, matmul_precision, with_matmul_precision, Bf16Kernel, MatmulPrecision,
};
pub use linear::{
    column_parallel_linear, column_parallel_linear_sp, linear, row_parallel_linear,
    row_parallel_linear_sp, ColumnParallelLinear, RowParallelLinear,
};
pub use ops::{
    all_reduce_tensor, copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
    scatter_to_tp_region, TpComm,
};
pub use sequence::{
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, sequence_parallel_rows,
};
pub use shard::{shard_column, shard_qkv, shard_row, shard_vocab, vocab_range, TpSplit};
pub use vocab::{
    linear_cross_entropy, sequence_parallel_linear_cross_entropy, vocab_parallel_cross_entropy,
    vocab_parallel_embedding, vocab_parallel_embedding_sp, vocab_parallel_linear_cross_entropy,
    vocab_parallel_logits, VocabParallelEmbedding,
};
