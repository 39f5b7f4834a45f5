//! Collective communication for kiln: one [`Communicator`] trait, and the backends behind it.
//!
//! - [`Communicator`]: `rank`, `world_size`, `all_reduce`, `reduce_scatter`, `all_gather`,
//!   `broadcast`, `barrier` and `split` into sub-groups, object safe; the typed helpers live in
//!   [`CommExt`] (`all_reduce(&mut [f32], ReduceOp::Sum)`).
//! - Point-to-point messages for pipeline stages: `send_buf` / `recv_buf` (typed: `send`,
//!   `recv`) and [`Communicator::p2p_batch`] of [`P2pOp`]s; sends are eager, messages between
//!   two ranks arrive in order, and a receive checks the sender's tag, dtype and length.
//! - [`ThreadComm`]: the ranks are threads of one process exchanging through shared memory; the
//!   embedded default on which every kiln test and example runs. [`spawn`] runs a closure on N
//!   ranks.
//! - `MpiComm` (feature `mpi`): one rank per process over MPI, started by mpirun or srun, with
//!   bitwise the thread backend's results.
//! - `nccl::NcclComm` (feature `nccl`): one rank per GPU over NCCL (cudarc), collectives on
//!   device buffers in place and on host slices; see [`Capabilities`] for how it differs.
//! - [`Backend`]: the backends by name (`thread`, `mpi`, `nccl`), as a run configuration
//!   chooses them; kiln-launch creates a process's world communicator of one from what its
//!   launcher says.
//! - Element types through the sealed [`CommElem`]: f32, f64, f16, bf16, i64, u32; f16 and bf16
//!   reduce in f32. Reductions are deterministic (fixed rank order).
//! - Faults are errors, never hangs: every wait has a timeout ([`CommError::Timeout`]), a rank
//!   that exited is noticed ([`CommError::RankGone`]), and ranks that disagree on the collective
//!   get [`CommError::Mismatch`] naming both calls.
//! - Uneven `reduce_scatter` / `all_gather` follow [`chunk_range`].
//!
//! ```
//! use kiln_comm::{spawn, CommExt, Communicator, ReduceOp};
//!
//! let out = spawn(4, |comm| {
//!     // each rank holds its rank number in 6 slots
//!     let grads = vec![comm.rank() as f32; 6];
//!     let mut avg = grads.clone();
//!     comm.all_reduce(&mut avg, ReduceOp::Avg)?;
//!     // ZeRO-style: each rank keeps only its chunk of the sum
//!     let mut shard = vec![0.0f32; comm.my_chunk(6).len()];
//!     comm.reduce_scatter(&grads, &mut shard, ReduceOp::Sum)?;
//!     Ok::<_, kiln_comm::CommError>((avg[0], shard))
//! })?;
//! assert_eq!(out[0], (1.5, vec![6.0, 6.0]));
//! assert_eq!(out[3], (1.5, vec![6.0]));
//! # Ok::<(), kiln_comm::RankError<kiln_comm::CommError>>(())
//! ```
#![deny(missing_docs)]

mod backend;
mod check;
mod communicator;
mod elem;
mod error;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod p2p;
mod thread;
#[cfg(any(feature = "mpi", test))]
mod wire;

pub use backend::Backend;
pub use communicator::{
    chunk_range, Capabilities, CommExt, Communicator, Descriptor, OpKind, P2pOp,
};
pub use elem::{Buf, BufMut, CommElem, DType, ReduceOp};
pub use error::{CommError, Result};
#[cfg(feature = "mpi")]
pub use mpi::{Mpi, MpiComm, MpiCommConfig};
pub use thread::{
    spawn, spawn_with, RankError, RankFailure, ThreadComm, ThreadCommConfig, DEFAULT_TIMEOUT,
};
