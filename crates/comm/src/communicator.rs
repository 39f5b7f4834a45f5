//! The `Communicator` trait every backend implements, the descriptors that collectives carry,
//! and the chunking rule for uneven `reduce_scatter` / `all_gather`.

use crate::elem::{Buf, BufMut, CommElem, DType, ReduceOp};
use crate::error::Result;
pub use kiln_state::chunk_range;
use std::fmt;
use std::time::Duration;

/// Which collective a rank called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OpKind {
    /// [`Communicator::all_reduce_buf`].
    AllReduce,
    /// [`Communicator::reduce_scatter_buf`].
    ReduceScatter,
    /// [`Communicator::all_gather_buf`].
    AllGather,
    /// [`Communicator::broadcast_buf`].
    Broadcast,
    /// [`Communicator::barrier`].
    Barrier,
    /// [`Communicator::split`].
    Split,
}

impl OpKind {
    /// Lowercase name, as in error messages.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
            OpKind::Split => "split",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one rank asked of a collective: every rank of a group must present a matching
/// descriptor, or all of them get [`crate::CommError::Mismatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Descriptor {
    /// Sequence number of this collective on this communicator (0 for the first call).
    pub seq: u64,
    /// The collective.
    pub op: OpKind,
    /// Element type (`None` for barrier and split).
    pub dtype: Option<DType>,
    /// Length of the whole logical buffer: the all-reduced or broadcast buffer, the
    /// reduce-scatter input, the all-gather output.
    pub len: usize,
    /// The reduction, for all-reduce and reduce-scatter.
    pub reduce: Option<ReduceOp>,
    /// The root rank, for broadcast.
    pub root: Option<usize>,
}

impl Descriptor {
    /// The descriptor of collective number `seq`.
    pub fn new(
        seq: u64,
        op: OpKind,
        dtype: Option<DType>,
        len: usize,
        reduce: Option<ReduceOp>,
        root: Option<usize>,
    ) -> Descriptor {
        Descriptor {
            seq,
            op,
            dtype,
            len,
            reduce,
            root,
        }
    }

    /// True when two ranks' descriptors describe the same collective call.
    pub fn matches(&self, other: &Descriptor) -> bool {
        self == other
    }
}

impl fmt::Display for Descriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(seq {}", self.op, self.seq)?;
        if let Some(d) = self.dtype {
            write!(f, ", {d}, len {}", self.len)?;
        }
        if let Some(r) = self.reduce {
            write!(f, ", {r}")?;
        }
        if let Some(r) = self.root {
            write!(f, ", root {r}")?;
        }
        f.write_str(")")
    }
}

/// What a backend can do, so that callers adapt to it ([`Communicator::capabilities`]): an
/// engine pads its flat buffers to a multiple of the world when collectives need even chunks,
/// and keeps device buffers on the device when the backend reduces them there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// Collectives on device (CUDA) buffers, beside the host slices every backend takes.
    pub device_buffers: bool,
    /// Device collectives need equal chunks per rank (`reduce_scatter` / `all_gather` on
    /// lengths that are a multiple of the world); host slices always follow [`chunk_range`].
    pub even_chunks_only: bool,
    /// Reductions add in rank order 0, 1, ..., n-1 (f16 and bf16 in f32): bitwise the same result
    /// on every backend with this property and at every world size.
    pub rank_ordered: bool,
    /// Ranks that call different collectives get [`crate::CommError::Mismatch`] rather than
    /// undefined results.
    pub detects_mismatch: bool,
}

impl Capabilities {
    /// The host backends' (thread, MPI): host slices, any chunking, rank-ordered reductions,
    /// mismatches detected.
    pub const HOST: Capabilities = Capabilities {
        device_buffers: false,
        even_chunks_only: false,
        rank_ordered: true,
        detects_mismatch: true,
    };
}

/// Collective communication among the ranks of a group.
///
/// Object safe: hold a `Box<dyn Communicator>` or `Arc<dyn Communicator>` and call the typed
/// helpers of [`CommExt`] (`all_reduce(&mut [f32], ReduceOp::Sum)` and so on), which every
/// communicator gets for free.
///
/// Contract for every backend:
/// - every rank of the group calls the same collectives in the same order; a rank that calls a
///   different collective, dtype or length gets [`crate::CommError::Mismatch`] naming both ranks
///   (never a hang);
/// - every blocking call returns [`crate::CommError::Timeout`] after [`Communicator::timeout`],
///   and fails early with [`crate::CommError::RankGone`] when a rank it waits for has exited;
/// - reductions are deterministic: the same inputs give bitwise the same output on every rank
///   and in every run; f16 and bf16 accumulate in f32.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// How long a blocking call waits for the other ranks before it fails.
    fn timeout(&self) -> Duration;
    /// Short name of the backend (`thread`, `mpi`, `nccl`).
    fn backend(&self) -> &'static str;
    /// The descriptor of the last collective this rank entered, if any (for hang diagnostics).
    fn last_collective(&self) -> Option<Descriptor>;

    /// Reduces `buf` element-wise over all ranks; every rank receives the result.
    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Reduces `input` (the same length on every rank) element-wise and leaves in `output` this
    /// rank's chunk of the result, per [`chunk_range`].
    fn reduce_scatter_buf(&self, input: Buf<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Concatenates every rank's `input` (rank `r` holding `chunk_range(output.len(), world, r)`)
    /// into `output` on every rank.
    fn all_gather_buf(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()>;
    /// Copies `root`'s `buf` into `buf` on every rank.
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// Blocks until every rank has called `barrier`.
    fn barrier(&self) -> Result<()>;
    /// Splits the group: ranks passing the same `color` form a new group, ordered by `key` then
    /// by their rank here (MPI's `MPI_Comm_split`). Collective over this group.
    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>>;
    /// What this backend can do ([`Capabilities::HOST`] unless it says otherwise).
    fn capabilities(&self) -> Capabilities {
        Capabilities::HOST
    }
    /// The concrete communicator, for code that uses a backend's own methods beyond this trait
    /// (kiln-parallel reduces device buffers through `nccl::NcclComm`'s device collectives).
    /// `None` (the default) when the backend offers nothing more.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

macro_rules! forward_communicator {
    ($ptr:ident) => {
        /// A shared or boxed communicator is a communicator (`Box<dyn Communicator>` included).
        impl<C: Communicator + ?Sized> Communicator for $ptr<C> {
            fn rank(&self) -> usize {
                (**self).rank()
            }
            fn world_size(&self) -> usize {
                (**self).world_size()
            }
            fn timeout(&self) -> Duration {
                (**self).timeout()
            }
            fn backend(&self) -> &'static str {
                (**self).backend()
            }
            fn last_collective(&self) -> Option<Descriptor> {
                (**self).last_collective()
            }
            fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
                (**self).all_reduce_buf(buf, op)
            }
            fn reduce_scatter_buf(
                &self,
                input: Buf<'_>,
                output: BufMut<'_>,
                op: ReduceOp,
            ) -> Result<()> {
                (**self).reduce_scatter_buf(input, output, op)
            }
            fn all_gather_buf(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()> {
                (**self).all_gather_buf(input, output)
            }
            fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
                (**self).broadcast_buf(buf, root)
            }
            fn barrier(&self) -> Result<()> {
                (**self).barrier()
            }
            fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
                (**self).split(color, key)
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
            fn as_any(&self) -> Option<&dyn std::any::Any> {
                (**self).as_any()
            }
        }
    };
}
use std::sync::Arc;
forward_communicator!(Box);
forward_communicator!(Arc);

impl fmt::Debug for dyn Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("backend", &self.backend())
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish()
    }
}

/// Typed helpers over [`Communicator`], implemented for every communicator (boxed or not).
pub trait CommExt: Communicator {
    /// All-reduce a typed slice in place.
    fn all_reduce<T: CommElem>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_buf(T::buf_mut(buf), op)
    }
    /// Reduce-scatter a typed slice; `output` holds this rank's chunk.
    fn reduce_scatter<T: CommElem>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_buf(T::buf(input), T::buf_mut(output), op)
    }
    /// All-gather typed chunks into `output`.
    fn all_gather<T: CommElem>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.all_gather_buf(T::buf(input), T::buf_mut(output))
    }
    /// Broadcast a typed slice from `root`.
    fn broadcast<T: CommElem>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_buf(T::buf_mut(buf), root)
    }
    /// All-reduce one value and return the result.
    fn all_reduce_scalar<T: CommElem>(&self, value: T, op: ReduceOp) -> Result<T> {
        let mut v = [value];
        self.all_reduce_buf(T::buf_mut(&mut v), op)?;
        Ok(v[0])
    }
    /// The range of a buffer of `len` elements that this rank owns under [`chunk_range`].
    fn my_chunk(&self, len: usize) -> std::ops::Range<usize> {
        chunk_range(len, self.world_size(), self.rank())
    }
}

impl<C: Communicator + ?Sized> CommExt for C {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_exactly_once() {
        for len in [0usize, 1, 2, 7, 8, 1000, 1001] {
            for world in 1..=9 {
                let mut next = 0;
                for r in 0..world {
                    let c = chunk_range(len, world, r);
                    assert_eq!(c.start, next);
                    assert!(c.len() == len / world || c.len() == len / world + 1);
                    next = c.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn descriptor_display_names_everything() {
        let d = Descriptor {
            seq: 3,
            op: OpKind::AllReduce,
            dtype: Some(DType::F32),
            len: 7,
            reduce: Some(ReduceOp::Sum),
            root: None,
        };
        assert_eq!(d.to_string(), "all_reduce(seq 3, f32, len 7, sum)");
    }
}
