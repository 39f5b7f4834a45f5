//! kiln: reusable Rust libraries for training large language models.
//!
//! This facade re-exports each of kiln's crates as a module, so a project can depend on `kiln`
//! alone:
//!
//! - [`comm`]: the `Communicator` trait, the thread backend and the collectives.
//!
//! ```
//! use kiln::comm::{spawn, CommExt, Communicator, ReduceOp};
//! let maxes = spawn(2, |comm| comm.all_reduce_scalar(comm.rank() as f64, ReduceOp::Max)).unwrap();
//! assert_eq!(maxes, vec![1.0, 1.0]);
//! ```
#![deny(missing_docs)]

pub use kiln_comm as comm;
