//! Data parallel, ZeRO stages 1 to 3 and Megatron-style tensor parallel, proven equal to one
//! rank.
//!
//! - [`ParallelDims`] validates the dp x tp grid against the world and the model and builds the
//!   data-parallel and tensor-parallel groups.
//! - [`tp`]: tensor-parallel building blocks (the f/g conjugate operators, column- and
//!   row-parallel linear layers, a vocab-parallel embedding and cross-entropy).
//!
//! ```
//! use kiln_memory::ModelShape;
//! use kiln_parallel::ParallelDims;
//! let shape = ModelShape { n_layers: 4, d_model: 256, n_heads: 4, ctx: 128, vocab: 8192 };
//! let dims = ParallelDims::new(2, 2, 4, &shape)?;
//! assert_eq!(dims.world(), 4);
//! # Ok::<(), kiln_parallel::ParallelError>(())
//! ```
#![deny(missing_docs)]

mod dims;
mod error;
pub mod tp;

pub use dims::{Groups, ParallelDims};
pub use error::{ParallelError, Result};
