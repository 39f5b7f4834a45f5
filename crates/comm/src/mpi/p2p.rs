//! Point-to-point messages of [`MpiComm`].
//!
//! A send is two kinds of message to the peer: a header (the sender's descriptor: message
//! number, dtype, length, tag; 40 bytes) and the data, in pieces of at most 1 GiB (MPI counts
//! are C ints). Both go out with `MPI_Isend` from a copy the communicator owns, so the call
//! returns at once whatever the size (eager, even past MPI's own eager limit) and the caller's
//! buffer is free again; the copies are released as their sends complete, checked at every
//! later point-to-point call, and waited for when the communicator is dropped. A receive posts
//! `MPI_Irecv` for the header, compares it with what it expects, then receives the data (as
//! long as the sender said, so a mismatched message is consumed whole and the next receive
//! takes the next message) into staging memory and copies it out. Headers and data have tags of
//! their own, distinct from the agreement messages of the collectives (whose data moves in MPI
//! collectives, which never match point-to-point messages); MPI's non-overtaking rule keeps
//! each kind in order per pair, which makes the FIFO per ordered pair.
//!
//! Waits poll to the deadline and watch the peers' processes as the collectives do
//! ([`super::wait`]), restricted to the peers of the receives. A wait that fails leaves
//! requests in flight: as for the collectives, the communicator is unusable afterwards and its
//! staging memory is leaked, never freed under MPI's feet.

use super::raw::{self, Request};
use super::wait::Waiter;
use super::{MpiComm, State};
use crate::communicator::{Descriptor, OpKind};
use crate::error::{CommError, Result};
use crate::p2p::{check_message, check_peers, P2pOp};
use crate::wire::{p2p_from_header, p2p_header, HEADER_WORDS};
use std::ops::Range;
use std::time::{Duration, Instant};

/// The tag of headers.
const HEADER_TAG: i32 = 0x6b6d;
/// The tag of data pieces.
const DATA_TAG: i32 = 0x6b6e;
/// The largest piece of data one MPI message carries.
const PIECE: usize = 1 << 30;

/// A send whose MPI requests may still be in flight, with the memory they read.
#[derive(Debug)]
struct InFlight {
    reqs: Vec<Request>,
    peer: usize,
    _header: Box<[u64; HEADER_WORDS]>,
    _data: Vec<u64>,
}

// SAFETY: the requests are only tested or waited for under the communicator's state lock, and
// MPI (initialised with MPI_THREAD_MULTIPLE) allows that from any thread; the buffers are plain
// heap memory.
unsafe impl Send for InFlight {}

/// Point-to-point state of one communicator.
#[derive(Debug, Default)]
pub(super) struct P2pState {
    sends: Vec<InFlight>,
    /// Per peer, messages sent to it.
    sent: Vec<u64>,
    /// Per peer, messages received from it.
    received: Vec<u64>,
}

/// The byte ranges of the data pieces of a message of `nbytes` bytes (none when empty).
fn pieces(nbytes: usize) -> impl Iterator<Item = Range<usize>> {
    (0..nbytes.div_ceil(PIECE)).map(move |i| i * PIECE..((i + 1) * PIECE).min(nbytes))
}

/// 8-byte aligned zeroed memory for `nbytes` bytes.
fn words(nbytes: usize) -> Vec<u64> {
    vec![0u64; nbytes.div_ceil(8)]
}

/// Receive staging: written by MPI while requests are in flight, leaked if they never complete.
#[derive(Default)]
struct Staged {
    headers: Vec<u64>,
    data: Vec<Vec<u64>>,
}

impl MpiComm {
    /// Runs a batch: every send is posted (and returns), then every receive's header is posted,
    /// then, once all headers are in, every receive's data.
    pub(super) fn run_p2p(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        check_peers(ops, self.rank, self.size)?;
        let any_recv = ops.iter().any(|o| o.op() == OpKind::Recv);
        let op = if any_recv { OpKind::Recv } else { OpKind::Send };
        let mut guard = self.enter(op)?;
        let st = &mut *guard;
        let start = Instant::now();
        st.p2p.sent.resize(self.size, 0);
        st.p2p.received.resize(self.size, 0);
        let mut staged = Staged::default();
        let outcome = self
            .post_sends(st, ops)
            .and_then(|()| self.receive(st, ops, &mut staged, start));
        match outcome {
            Ok(mismatch) => mismatch.map_or(Ok(()), Err),
            Err(e) => {
                // requests may be in flight on the staging memory: leak it, never free it
                std::mem::forget(staged);
                st.broken = Some(e.clone());
                super::runtime().broken = true;
                Err(e)
            }
        }
    }

    fn post_sends(&self, st: &mut State, ops: &[P2pOp<'_>]) -> Result<()> {
        // release the copies of sends that have completed
        for f in &mut st.p2p.sends {
            if raw::test_all(&mut f.reqs)? {
                f.reqs.clear();
            }
        }
        st.p2p.sends.retain(|f| !f.reqs.is_empty());
        for op in ops {
            let P2pOp::Send { buf, peer, .. } = op else {
                continue;
            };
            let peer = *peer;
            if !self.peers.alive(self.world_ranks[peer]) {
                return Err(CommError::RankGone {
                    op: OpKind::Send,
                    rank: self.rank,
                    gone: peer,
                    waited: Duration::ZERO,
                });
            }
            let src = buf.as_bytes();
            let mut data = words(src.len());
            bytemuck::cast_slice_mut::<u64, u8>(&mut data)[..src.len()].copy_from_slice(src);
            let header = Box::new(p2p_header(&op.descriptor(st.p2p.sent[peer])));
            st.p2p.sent[peer] += 1;
            let (h, d) = (header.as_ptr().cast::<u8>(), data.as_ptr().cast::<u8>());
            // kept before anything is posted, so that the memory outlives every request
            st.p2p.sends.push(InFlight {
                reqs: Vec::new(),
                peer,
                _header: header,
                _data: data,
            });
            let reqs = match st.p2p.sends.last_mut() {
                Some(f) => &mut f.reqs,
                None => continue,
            };
            // SAFETY: the header and data are heap memory owned by the in-flight entry, which
            // is dropped only after its requests complete (or leaked).
            reqs.push(unsafe { self.handle.isend(h, HEADER_WORDS * 8, peer, HEADER_TAG)? });
            for r in pieces(src.len()) {
                // SAFETY: as above; `r` lies within the data.
                reqs.push(unsafe { self.handle.isend(d.add(r.start), r.len(), peer, DATA_TAG)? });
            }
        }
        Ok(())
    }

    /// Every receive of the batch; `Ok(Some(e))` is the first mismatch (every message was
    /// still consumed, and the others delivered).
    fn receive(
        &self,
        st: &mut State,
        ops: &mut [P2pOp<'_>],
        staged: &mut Staged,
        start: Instant,
    ) -> Result<Option<CommError>> {
        let recvs: Vec<usize> = (0..ops.len())
            .filter(|&i| ops[i].op() == OpKind::Recv)
            .collect();
        if recvs.is_empty() {
            return Ok(None);
        }
        let from: Vec<usize> = recvs.iter().map(|&i| ops[i].peer()).collect();
        let mut waiter = Waiter::new(OpKind::Recv, self.rank, self.config.timeout, start);
        waiter.watch = Some((&self.world_ranks, &self.peers));
        waiter.only = Some(from.clone());
        // 1. the headers
        staged.headers = vec![0u64; HEADER_WORDS * recvs.len()];
        let hp = staged.headers.as_mut_ptr();
        let mut reqs = Vec::with_capacity(recvs.len());
        for (j, &p) in from.iter().enumerate() {
            // SAFETY: staging memory that outlives the request (leaked if it never completes);
            // each header has its own slot.
            let slot = unsafe { hp.add(j * HEADER_WORDS).cast::<u8>() };
            // SAFETY: as above.
            reqs.push(unsafe { self.handle.irecv(slot, HEADER_WORDS * 8, p, HEADER_TAG)? });
        }
        let sources: Vec<Option<usize>> = from.iter().map(|&p| Some(p)).collect();
        waiter.wait(&mut reqs, &sources)?;
        let mut sent: Vec<Descriptor> = Vec::with_capacity(recvs.len());
        for (j, &p) in from.iter().enumerate() {
            let w = &staged.headers[j * HEADER_WORDS..(j + 1) * HEADER_WORDS];
            let d = p2p_from_header(w, self.rank).ok_or_else(|| {
                raw::err(
                    "recv",
                    format_args!("rank {p} sent a message that is not kiln's (another library's message on this communicator?)"),
                )
            })?;
            sent.push(d);
        }
        // 2. the data, as long as each sender said
        let nbytes: Vec<usize> = sent
            .iter()
            .map(|d| {
                d.dtype
                    .map_or(0, |t| d.len.saturating_mul(t.size_in_bytes()))
            })
            .collect();
        staged.data = nbytes.iter().map(|&n| words(n)).collect();
        let mut reqs = Vec::new();
        let mut sources = Vec::new();
        for (j, &p) in from.iter().enumerate() {
            let base = staged.data[j].as_mut_ptr().cast::<u8>();
            for r in pieces(nbytes[j]) {
                // SAFETY: staging memory of `nbytes[j]` bytes that outlives the request; `r`
                // lies within it.
                reqs.push(unsafe { self.handle.irecv(base.add(r.start), r.len(), p, DATA_TAG)? });
                sources.push(Some(p));
            }
        }
        waiter.wait(&mut reqs, &sources)?;
        // 3. deliver in list order
        let mut first_mismatch = None;
        for (j, &i) in recvs.iter().enumerate() {
            let p = from[j];
            let expected = ops[i].descriptor(st.p2p.received[p]);
            st.p2p.received[p] += 1;
            if let Err(e) = check_message(self.rank, expected, p, sent[j]) {
                first_mismatch.get_or_insert(e);
                continue;
            }
            if let P2pOp::Recv { buf, .. } = &mut ops[i] {
                let out = buf.as_bytes_mut();
                let n = out.len();
                out.copy_from_slice(&bytemuck::cast_slice::<u64, u8>(&staged.data[j])[..n]);
            }
        }
        Ok(first_mismatch)
    }

    /// Waits for the sends still in flight (on drop); false when they could not complete, in
    /// which case their memory is leaked and MPI is left unfinalised.
    pub(super) fn flush_sends(&mut self) -> bool {
        let Ok(st) = self.state.get_mut() else {
            return false;
        };
        if st.p2p.sends.is_empty() {
            return true;
        }
        if st.broken.is_none() && !super::runtime().finalized {
            let mut peers: Vec<usize> = st.p2p.sends.iter().map(|f| f.peer).collect();
            peers.dedup();
            let mut w = Waiter::new(OpKind::Send, self.rank, self.config.timeout, Instant::now());
            w.watch = Some((&self.world_ranks, &self.peers));
            w.only = Some(peers);
            let mut reqs: Vec<Request> = st
                .p2p
                .sends
                .iter_mut()
                .flat_map(|f| std::mem::take(&mut f.reqs))
                .collect();
            if w.wait(&mut reqs, &[]).is_ok() {
                st.p2p.sends.clear();
                return true;
            }
        }
        std::mem::forget(std::mem::take(&mut st.p2p.sends));
        super::runtime().broken = true;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_a_message_exactly() {
        assert_eq!(pieces(0).count(), 0);
        assert_eq!(pieces(5).collect::<Vec<_>>(), vec![0..5]);
        let p: Vec<_> = pieces(2 * PIECE + 3).collect();
        assert_eq!(
            p,
            vec![0..PIECE, PIECE..2 * PIECE, 2 * PIECE..2 * PIECE + 3]
        );
    }
}
