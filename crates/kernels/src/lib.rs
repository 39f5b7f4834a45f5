//! The computation of kiln: the kernels every layer runs, as candle custom ops with a forward
//! and a backward, on the CPU and (feature `cuda`) on CUDA GPUs.
//!
//! - [`dense`]: the matrix product every dense layer uses, `x W^T + b` as one op
//!   ([`dense::LinearBias`], [`dense::LinearNoBias`]) with its backward, at the thread's
//!   [`MatmulPrecision`] (PyTorch's `set_float32_matmul_precision`); its products run on
//!   [`cpu_gemm`], kiln's AVX-512 f32 and bf16 kernels (the gemm crate's elsewhere).
//! - [`ops`]: the fused ops' kernels, forward and backward: layer norm, causal softmax, causal
//!   attention (also straight from a packed QKV projection), GELU with and without a fused
//!   bias, cross-entropy, the residual add, and the vocab-parallel cross-entropy's row
//!   statistics with the LM head fused into its loss.
//! - `cuda` (feature `cuda`): kiln's CUDA kernels (`src/cuda/*.cu`, compiled to PTX by this
//!   crate's build script) and their launchers: the fused ops, and the data-parallel engine's
//!   optimizer step over flat device buffers (AdamW, gradient accumulation, norms, clipping).
//! - [`fastmath`]: a vectorising `exp`, f16 and bf16 rounding, block transposes, and
//!   [`simd_dispatch!`], which runs an AVX-512 copy of a loop where the CPU has it.
//! - [`custom_op`]: what a candle custom op's CPU side is written with (element types,
//!   contiguous access, a match over the float storages, row-parallel loops), and [`pool`],
//!   work items on candle's worker pool.
//!
//! kiln-kernels knows nothing of communication or of kiln-memory's tape: the public functions
//! that validate their inputs and record these ops for the backward live in kiln-model
//! (`kiln_model::ops`) and kiln-parallel (`kiln_parallel::tp::linear`).
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use kiln_kernels::dense::LinearBias;
//! let x = Var::new(&[[1f32, 2.]], &Device::Cpu)?;
//! let w = Tensor::new(&[[3f32, 4.], [5., 6.]], &Device::Cpu)?; // [out 2, in 2]
//! let b = Tensor::new(&[0.5f32, -1.], &Device::Cpu)?;
//! let y = x.apply_op3(&w, &b, LinearBias::new())?; // x W^T + b
//! assert_eq!(y.to_vec2::<f32>()?, [[11.5, 16.]]);
//! let grads = y.sum_all()?.backward()?;
//! let dx = grads.get(&x).map(|g| g.to_vec2::<f32>()).transpose()?;
//! assert_eq!(dx, Some(vec![vec![8., 10.]])); // the column sums of W
//! # Ok::<(), candle_core::Error>(())
//! ```
#![deny(missing_docs)]

pub mod cpu_gemm;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod custom_op;
pub mod dense;
mod error;
pub mod fastmath;
pub mod ops;
pub mod pool;

pub use cpu_gemm::{bf16_kernel, Bf16Kernel};
pub use dense::{matmul_precision, with_matmul_precision, MatmulPrecision};
pub use error::{KernelError, Result};

/// What the exported macros name, so they work in a crate that calls candle by another name.
#[doc(hidden)]
pub mod __private {
    pub use candle_core;
}
