//! Point-to-point operations: the [`P2pOp`] of a batch, and the checks every backend runs on
//! them (a valid peer, and a message that agrees with its receive).

use crate::communicator::{Descriptor, OpKind};
use crate::elem::{Buf, BufMut, CommElem, DType};
use crate::error::{CommError, Result};

/// One send or receive of [`crate::Communicator::p2p_batch`].
///
/// ```
/// use kiln_comm::{spawn, CommExt, Communicator, P2pOp};
/// // a ring shift: every rank sends its rank to the next and receives from the previous
/// let got = spawn(3, |comm| {
///     let (n, r) = (comm.world_size(), comm.rank());
///     let mine = [r as f32; 4];
///     let mut from_prev = [0.0f32; 4];
///     comm.p2p_batch(&mut [
///         P2pOp::send(&mine, (r + 1) % n, 0),
///         P2pOp::recv(&mut from_prev, (r + n - 1) % n, 0),
///     ])?;
///     Ok::<_, kiln_comm::CommError>(from_prev[0])
/// })?;
/// assert_eq!(got, vec![2.0, 0.0, 1.0]);
/// # Ok::<(), kiln_comm::RankError<kiln_comm::CommError>>(())
/// ```
#[derive(Debug)]
pub enum P2pOp<'a> {
    /// Send `buf` to rank `peer`, labelled `tag`.
    Send {
        /// The data.
        buf: Buf<'a>,
        /// The destination rank (in this group).
        peer: usize,
        /// The label the receiver checks.
        tag: u32,
    },
    /// Receive the next message from rank `peer` into `buf`, expecting `tag`.
    Recv {
        /// Where the data goes; its dtype and length must be the sender's.
        buf: BufMut<'a>,
        /// The source rank (in this group).
        peer: usize,
        /// The label expected.
        tag: u32,
    },
}

impl<'a> P2pOp<'a> {
    /// A send of a typed slice.
    pub fn send<T: CommElem>(buf: &'a [T], peer: usize, tag: u32) -> Self {
        P2pOp::Send {
            buf: T::buf(buf),
            peer,
            tag,
        }
    }

    /// A receive into a typed slice.
    pub fn recv<T: CommElem>(buf: &'a mut [T], peer: usize, tag: u32) -> Self {
        P2pOp::Recv {
            buf: T::buf_mut(buf),
            peer,
            tag,
        }
    }

    /// [`OpKind::Send`] or [`OpKind::Recv`].
    pub fn op(&self) -> OpKind {
        match self {
            P2pOp::Send { .. } => OpKind::Send,
            P2pOp::Recv { .. } => OpKind::Recv,
        }
    }

    /// The other rank.
    pub fn peer(&self) -> usize {
        match self {
            P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => *peer,
        }
    }

    /// The tag.
    pub fn tag(&self) -> u32 {
        match self {
            P2pOp::Send { tag, .. } | P2pOp::Recv { tag, .. } => *tag,
        }
    }

    /// The element type of the buffer.
    pub fn dtype(&self) -> DType {
        match self {
            P2pOp::Send { buf, .. } => buf.dtype(),
            P2pOp::Recv { buf, .. } => buf.dtype(),
        }
    }

    /// The number of elements of the buffer.
    pub fn len(&self) -> usize {
        match self {
            P2pOp::Send { buf, .. } => buf.len(),
            P2pOp::Recv { buf, .. } => buf.len(),
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The descriptor of this operation as message number `seq` between the two ranks.
    pub(crate) fn descriptor(&self, seq: u64) -> Descriptor {
        Descriptor::p2p(
            seq,
            self.op(),
            self.dtype(),
            self.len(),
            self.peer(),
            self.tag(),
        )
    }
}

/// Refuses a batch with an operation whose peer is this rank or outside the group, before
/// anything is posted.
pub(crate) fn check_peers(ops: &[P2pOp<'_>], rank: usize, world: usize) -> Result<()> {
    match ops.iter().find(|o| o.peer() == rank || o.peer() >= world) {
        Some(o) => Err(CommError::BadPeer {
            op: o.op(),
            rank,
            peer: o.peer(),
            world,
        }),
        None => Ok(()),
    }
}

/// The receive `expected` (on rank `me`) against the message `sent` that rank `peer` presented.
pub(crate) fn check_message(
    me: usize,
    expected: Descriptor,
    peer: usize,
    sent: Descriptor,
) -> Result<()> {
    if expected.p2p_matches(&sent) {
        Ok(())
    } else {
        Err(CommError::Mismatch {
            rank: me,
            first_rank: me,
            first: Box::new(expected),
            second_rank: peer,
            second: Box::new(sent),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_differing_message_names_both_ranks_and_descriptors() {
        let sent = Descriptor::p2p(0, OpKind::Send, DType::F32, 64, 1, 8);
        let expected = Descriptor::p2p(0, OpKind::Recv, DType::F32, 64, 0, 7);
        let e = check_message(1, expected, 0, sent).expect_err("tags differ");
        assert_eq!(
            e.to_string(),
            "rank 1 expected recv(tag 7, f32, len 64) from rank 0, rank 0 sent send(tag 8, f32, len 64)"
        );
        let same = Descriptor::p2p(0, OpKind::Recv, DType::F32, 64, 0, 8);
        assert!(check_message(1, same, 0, sent).is_ok());
    }

    #[test]
    fn peers_must_be_other_ranks_of_the_group() {
        let x = [1.0f32];
        let e = check_peers(&[P2pOp::send(&x, 2, 0)], 2, 4).expect_err("self");
        assert!(e.to_string().contains("peer 2 is this rank itself"), "{e}");
        let e = check_peers(&[P2pOp::send(&x, 1, 0), P2pOp::send(&x, 4, 0)], 2, 4)
            .expect_err("out of range");
        assert_eq!(
            e.to_string(),
            "send on rank 2: peer 4 is not a rank of a group of 4 (ranks 0..4)"
        );
    }
}
