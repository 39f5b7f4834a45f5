//! The error type of kiln-comm.

use crate::communicator::{Descriptor, OpKind};
use std::time::Duration;

/// Everything a collective can fail with.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// Some ranks did not reach the collective within the timeout.
    #[error("{op} timed out on rank {rank} after {waited:?}: {}", missing_text(*.op, .missing))]
    Timeout {
        /// The collective.
        op: OpKind,
        /// The rank that gave up.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// The ranks (in this group) that had not arrived; empty when the collective was under
        /// way and the backend cannot tell which rank stalled it. For a receive, the peer whose
        /// message never came.
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
    /// Ranks called different collectives, or the same one with different arguments; or a
    /// receive found a message that differs from what it expects (tag, dtype or length). For a
    /// receive, `first` is the receive (`first_rank` the receiver, who reports it) and `second`
    /// the send (`second_rank` the sender).
    #[error("{}", mismatch_text(*.rank, *.first_rank, .first, *.second_rank, .second))]
    Mismatch {
        /// The rank reporting the error.
        rank: usize,
        /// The first rank in the comparison (the lowest rank; the receiver for a receive).
        first_rank: usize,
        /// What it called (boxed: two descriptors would make every `Result` of kiln-comm large).
        first: Box<Descriptor>,
        /// The first rank whose call differs (the sender for a receive).
        second_rank: usize,
        /// What it called.
        second: Box<Descriptor>,
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
    /// A send or receive to this rank itself or to a rank outside the group.
    #[error("{op} on rank {rank}: {}", bad_peer_text(*.rank, *.peer, *.world))]
    BadPeer {
        /// The operation.
        op: OpKind,
        /// The rank that called it.
        rank: usize,
        /// The peer given.
        peer: usize,
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

fn missing_text(op: OpKind, missing: &[usize]) -> String {
    if op == OpKind::Recv {
        return match missing {
            [peer] => format!("no message from rank {peer}"),
            _ => format!("no message from ranks {missing:?}"),
        };
    }
    if missing.is_empty() {
        "the other ranks did not complete it".to_string()
    } else {
        format!("ranks {missing:?} never arrived")
    }
}

fn mismatch_text(
    rank: usize,
    first_rank: usize,
    first: &Descriptor,
    second_rank: usize,
    second: &Descriptor,
) -> String {
    if first.op == OpKind::Recv {
        format!("rank {first_rank} expected {first} from rank {second_rank}, rank {second_rank} sent {second}")
    } else {
        format!("collective mismatch seen by rank {rank}: rank {first_rank} called {first} but rank {second_rank} called {second}")
    }
}

fn bad_peer_text(rank: usize, peer: usize, world: usize) -> String {
    if peer == rank {
        format!("peer {peer} is this rank itself (a group of {world}); a rank cannot send to or receive from itself")
    } else {
        format!("peer {peer} is not a rank of a group of {world} (ranks 0..{world})")
    }
}

/// Result alias of kiln-comm.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
