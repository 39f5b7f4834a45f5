//! The agreement check every backend runs before a collective moves data: all ranks called the
//! same collective with the same arguments, and each rank's buffers fit the chunking rule.

use crate::communicator::{chunk_range, Descriptor, OpKind};
use crate::elem::DType;
use crate::error::CommError;

/// What one rank brings to a collective: its descriptor and what only it can know about its own
/// buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Call {
    /// The descriptor, equal on every rank when the call is well-formed.
    pub desc: Descriptor,
    /// The length of this rank's chunk buffer: the reduce-scatter output or the all-gather
    /// input (0 for the other collectives).
    pub chunk_len: usize,
    /// Input and output dtypes when they differ on this rank.
    pub dtype_fault: Option<(DType, DType)>,
    /// `(color, key)` of a split.
    pub split: (u32, u32),
}

/// Checks the calls of all ranks of a group (index = group rank); the error every rank returns,
/// if any. Mismatches are reported from rank 0's point of view (`rank: 0`); callers put their
/// own rank in.
pub(crate) fn check_calls(calls: &[Call]) -> Option<CommError> {
    let n = calls.len();
    let first = calls.first()?.desc;
    if let Some((k, c)) = calls
        .iter()
        .enumerate()
        .find(|(_, c)| !c.desc.matches(&first))
    {
        return Some(CommError::Mismatch {
            rank: 0,
            first_rank: 0,
            first: Box::new(first),
            second_rank: k,
            second: Box::new(c.desc),
        });
    }
    for (r, c) in calls.iter().enumerate() {
        if let Some((input, output)) = c.dtype_fault {
            return Some(CommError::DtypeMismatch {
                op: first.op,
                rank: r,
                input,
                output,
            });
        }
        let what = match first.op {
            OpKind::ReduceScatter => "output",
            OpKind::AllGather => "input",
            _ => continue,
        };
        let expected = chunk_range(first.len, n, r).len();
        if c.chunk_len != expected {
            return Some(CommError::BadLength {
                op: first.op,
                rank: r,
                what,
                expected,
                got: c.chunk_len,
            });
        }
    }
    if let Some(root) = first.root.filter(|&root| root >= n) {
        return Some(CommError::BadRoot {
            op: first.op,
            root,
            world: n,
        });
    }
    None
}

/// The verdict of [`check_calls`] as rank `me` reports it.
pub(crate) fn as_seen_by(verdict: CommError, me: usize) -> CommError {
    match verdict {
        CommError::Mismatch {
            first_rank,
            first,
            second_rank,
            second,
            ..
        } => CommError::Mismatch {
            rank: me,
            first_rank,
            first,
            second_rank,
            second,
        },
        e => e,
    }
}

/// The members of each new group of a split, ordered by `(key, rank)` as `MPI_Comm_split`
/// orders them: for each rank of the old group, its new group (as old-group ranks) and its rank
/// in it.
pub(crate) fn split_members(splits: &[(u32, u32)]) -> Vec<(Vec<usize>, usize)> {
    splits
        .iter()
        .enumerate()
        .map(|(me, &(color, _))| {
            let mut members: Vec<usize> = (0..splits.len())
                .filter(|&r| splits[r].0 == color)
                .collect();
            members.sort_by_key(|&r| (splits[r].1, r));
            let new_rank = members.iter().position(|&r| r == me).unwrap_or(0);
            (members, new_rank)
        })
        .collect()
}

/// A bf16 max call of collective 4, for the unit tests of this module and the wire form.
#[cfg(test)]
pub(crate) fn test_call(op: OpKind, len: usize, chunk_len: usize) -> Call {
    Call {
        desc: Descriptor::new(
            4,
            op,
            Some(DType::BF16),
            len,
            Some(crate::ReduceOp::Max),
            None,
        ),
        chunk_len,
        dtype_fault: None,
        split: (0, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(op: OpKind, len: usize, chunk_len: usize) -> Call {
        test_call(op, len, chunk_len)
    }

    #[test]
    fn the_first_differing_rank_and_bad_chunks_are_named() {
        let ok = [call(OpKind::AllGather, 7, 4), call(OpKind::AllGather, 7, 3)];
        assert!(check_calls(&ok[..1]).is_some()); // world 1 needs the whole 7
        assert!(check_calls(&ok).is_none());
        let mut calls = [
            call(OpKind::AllReduce, 7, 0),
            call(OpKind::AllReduce, 7, 0),
            call(OpKind::AllReduce, 8, 0),
        ];
        match check_calls(&calls) {
            Some(CommError::Mismatch { second_rank, .. }) => assert_eq!(second_rank, 2),
            other => panic!("expected a mismatch, got {other:?}"),
        }
        calls[2].desc.len = 7;
        calls[1].dtype_fault = Some((DType::F32, DType::F16));
        assert!(matches!(
            check_calls(&calls),
            Some(CommError::DtypeMismatch { rank: 1, .. })
        ));
    }

    #[test]
    fn split_orders_by_key_then_rank() {
        let s = split_members(&[(0, 5), (1, 0), (0, 1), (0, 1)]);
        assert_eq!(s[0], (vec![2, 3, 0], 2));
        assert_eq!(s[1], (vec![1], 0));
        assert_eq!(s[3], (vec![2, 3, 0], 1));
    }
}
