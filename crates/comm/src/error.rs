//! The error type of kiln-comm.

use crate::communicator::{Descriptor, OpKind};
use std::time::Duration;

/// Everything a collective can fail with.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// Some ranks did not reach the collective within the timeout.
    #[error("{op} timed out on rank {rank} after {waited:?}: {}", missing_text(.missing))]
    Timeout {
        /// The collective.
        op: OpKind,
        /// The rank that gave up.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// The ranks (in this group) that had not arrived; empty when the collective was under
        /// way and the backend cannot tell which rank stalled it.
        missing: Vec<usize>,
    },
    /// A rank this collective waits for has exited (returned or panicked).
    #[error("{op} on rank {rank} cannot complete: rank {gone} has exited{}", if *.waited > Duration::ZERO { format!(" (noticed after {:?})", .waited) } else { String::new() })]
    RankGone {
        /// The collective.
        op: OpKind,
        /// The rank reporting the error.
        rank: usize,
        /// The rank (in this group) that is gone.
        gone: usize,
        /// How long this rank waited before noticing.
        waited: Duration,
    },
    /// Ranks called different collectives, or the same one with different arguments.
    #[error("collective mismatch seen by rank {rank}: rank {first_rank} called {first} but rank {second_rank} called {second}")]
    Mismatch {
        /// The rank reporting the error.
        rank: usize,
        /// The first rank in the comparison (the lowest rank).
        first_rank: usize,
        /// What it called.
        first: Descriptor,
        /// The first rank whose call differs.
        second_rank: usize,
        /// What it called.
        second: Descriptor,
    },
    /// A buffer length does not fit the collective.
    #[error("{op} on rank {rank}: {what}: expected {expected} elements, got {got}")]
    BadLength {
        /// The collective.
        op: OpKind,
        /// The rank whose buffer is wrong.
        rank: usize,
        /// Which buffer.
        what: &'static str,
        /// The length required by the chunking rule.
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// Two buffers of one call have different element types.
    #[error("{op} on rank {rank}: input is {input} but output is {output}")]
    DtypeMismatch {
        /// The collective.
        op: OpKind,
        /// The rank.
        rank: usize,
        /// Input dtype.
        input: crate::DType,
        /// Output dtype.
        output: crate::DType,
    },
    /// A broadcast root outside the group.
    #[error("{op}: root {root} is not a rank of a group of {world}")]
    BadRoot {
        /// The collective.
        op: OpKind,
        /// The root given.
        root: usize,
        /// The group size.
        world: usize,
    },
    /// An invalid world size or configuration.
    #[error("invalid communicator configuration: {0}")]
    Config(String),
    /// The backend cannot run on this machine (its library or device is missing); nothing was
    /// started.
    #[error("{backend} backend unavailable: {reason}")]
    BackendUnavailable {
        /// The backend.
        backend: &'static str,
        /// Why: which library or device is missing.
        reason: String,
    },
    /// A backend-specific failure (MPI, NCCL, CUDA).
    #[error("{backend} backend: {message}")]
    Backend {
        /// The backend.
        backend: &'static str,
        /// What went wrong.
        message: String,
    },
}

fn missing_text(missing: &[usize]) -> String {
    if missing.is_empty() {
        "the other ranks did not complete it".to_string()
    } else {
        format!("ranks {missing:?} never arrived")
    }
}

/// Result alias of kiln-comm.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
