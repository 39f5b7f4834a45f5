//! The `Communicator` trait every backend implements, the descriptors that collectives and
//! point-to-point messages carry, and the chunking rule for uneven `reduce_scatter` /
//! `all_gather`.

use crate::elem::{Buf, BufMut, CommElem, DType, ReduceOp};
use crate::error::Result;
pub use crate::p2p::P2pOp;
pub use kiln_state::chunk_range;
use std::fmt;
use std::time::Duration;

/// Which collective (or point-to-point operation) a rank called.
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
    /// [`Communicator::send_buf`] (also a send of [`Communicator::p2p_batch`]).
    Send,
    /// [`Communicator::recv_buf`] (also a receive of [`Communicator::p2p_batch`]).
    Recv,
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
            OpKind::Send => "send",
            OpKind::Recv => "recv",
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
///
/// A point-to-point message carries one too ([`OpKind::Send`] on the sender's side,
/// [`OpKind::Recv`] on the receiver's): the receiver compares its tag, dtype and length with the
/// sender's ([`Descriptor::p2p_matches`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Descriptor {
    /// Sequence number of this collective on this communicator (0 for the first call); for a
    /// send or receive, the number of the message between the two ranks (0 for the first message
    /// from one rank to the other).
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
    /// The other rank of a send (its destination) or a receive (its source).
    pub peer: Option<usize>,
    /// The tag of a send or receive.
    pub tag: Option<u32>,
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
            peer: None,
            tag: None,
        }
    }

    /// The descriptor of message number `seq` of a send ([`OpKind::Send`], `peer` the
    /// destination) or receive ([`OpKind::Recv`], `peer` the source).
    pub fn p2p(
        seq: u64,
        op: OpKind,
        dtype: DType,
        len: usize,
        peer: usize,
        tag: u32,
    ) -> Descriptor {
        Descriptor {
            seq,
            op,
            dtype: Some(dtype),
            len,
            reduce: None,
            root: None,
            peer: Some(peer),
            tag: Some(tag),
        }
    }

    /// True when two ranks' descriptors describe the same collective call.
    pub fn matches(&self, other: &Descriptor) -> bool {
        self == other
    }

    /// True when a receive (`self`) and the message a sender presented (`sent`) agree: the same
    /// tag, dtype and length.
    pub fn p2p_matches(&self, sent: &Descriptor) -> bool {
        (self.tag, self.dtype, self.len) == (sent.tag, sent.dtype, sent.len)
    }
}

impl fmt::Display for Descriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(tag) = self.tag {
            // a send or receive: the peer is named by the message around it
            write!(f, "{}(tag {tag}", self.op)?;
            if let Some(d) = self.dtype {
                write!(f, ", {d}, len {}", self.len)?;
            }
            return f.write_str(")");
        }
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
    /// undefined results, and a receive checks the tag, dtype and length of its message.
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
///
/// Point-to-point messages ([`Communicator::send_buf`], [`Communicator::recv_buf`],
/// [`Communicator::p2p_batch`]), as pipeline stages exchange activations and gradients:
/// - a send is *eager*: it returns once the data is copied out of the caller's buffer and never
///   waits for the receiver to post its receive. Two neighbours that both send first and receive
///   second do not deadlock, whatever the size. (NCCL is the exception: its sends complete with
///   their receives, so there only [`Communicator::p2p_batch`] avoids the deadlock.)
/// - a receive blocks until the message has arrived;
/// - messages from one rank to another arrive in the order they were sent: one FIFO per ordered
///   pair of ranks, apart from the collectives' own traffic;
/// - the tag is an agreement check, not a selector: a receive takes the next message from its
///   peer and compares the sender's tag, dtype and length with its own; any difference is
///   [`crate::CommError::Mismatch`] on the receiver, naming both ranks and both descriptors
///   (`rank 1 expected recv(tag 7, f32, len 64) from rank 0, rank 0 sent send(tag 8, f32,
///   len 64)`). The mismatched message is consumed: the next receive takes the one after it;
/// - a receive that waits past [`Communicator::timeout`] is [`crate::CommError::Timeout`]
///   naming the peer; a peer that has exited is [`crate::CommError::RankGone`] naming it, on a
///   receive once every message it sent before leaving has been taken, and on a send at once;
/// - a send or receive to this rank itself, or to a rank outside the group, is
///   [`crate::CommError::BadPeer`].
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
    /// Sends `buf` to rank `peer` of this group, labelled `tag`. Eager: returns once the data is
    /// copied out (see the trait docs for the guarantees).
    fn send_buf(&self, buf: Buf<'_>, peer: usize, tag: u32) -> Result<()> {
        self.p2p_batch(&mut [P2pOp::Send { buf, peer, tag }])
    }
    /// Receives the next message from rank `peer` into `buf`, which must agree with what the
    /// sender presented (tag, dtype, length) or the call is [`crate::CommError::Mismatch`].
    fn recv_buf(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()> {
        self.p2p_batch(&mut [P2pOp::Recv { buf, peer, tag }])
    }
    /// Posts every send and receive of `ops` before waiting for any of them (torch's
    /// `batch_isend_irecv`), so that neighbours exchanging in any order never deadlock, on every
    /// backend. Receives from the same peer take its messages in the order they are listed.
    /// Every operation's peer is checked before any is posted. An error stops the batch
    /// (operations that completed before it stay done); the backends' [`Communicator::send_buf`]
    /// and [`Communicator::recv_buf`] are batches of one.
    fn p2p_batch(&self, ops: &mut [P2pOp<'_>]) -> Result<()>;
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
            fn send_buf(&self, buf: Buf<'_>, peer: usize, tag: u32) -> Result<()> {
                (**self).send_buf(buf, peer, tag)
            }
            fn recv_buf(&self, buf: BufMut<'_>, peer: usize, tag: u32) -> Result<()> {
                (**self).recv_buf(buf, peer, tag)
            }
            fn p2p_batch(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
                (**self).p2p_batch(ops)
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
    /// Sends a typed slice to rank `peer` (eager; see [`Communicator::send_buf`]).
    fn send<T: CommElem>(&self, buf: &[T], peer: usize, tag: u32) -> Result<()> {
        self.send_buf(T::buf(buf), peer, tag)
    }
    /// Receives the next message from rank `peer` into a typed slice (see
    /// [`Communicator::recv_buf`]).
    fn recv<T: CommElem>(&self, buf: &mut [T], peer: usize, tag: u32) -> Result<()> {
        self.recv_buf(T::buf_mut(buf), peer, tag)
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
            peer: None,
            tag: None,
        };
        assert_eq!(d.to_string(), "all_reduce(seq 3, f32, len 7, sum)");
        let s = Descriptor::p2p(5, OpKind::Send, DType::BF16, 64, 2, 8);
        assert_eq!(s.to_string(), "send(tag 8, bf16, len 64)");
        let r = Descriptor::p2p(5, OpKind::Recv, DType::BF16, 64, 0, 8);
        assert!(r.p2p_matches(&s));
        assert!(!r.p2p_matches(&Descriptor::p2p(5, OpKind::Send, DType::F16, 64, 2, 8)));
        assert!(!r.p2p_matches(&Descriptor::p2p(5, OpKind::Send, DType::BF16, 63, 2, 8)));
        assert!(!r.p2p_matches(&Descriptor::p2p(5, OpKind::Send, DType::BF16, 64, 2, 9)));
    }
}
