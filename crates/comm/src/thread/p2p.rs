//! Point-to-point messages of [`ThreadComm`]: every rank of a group has a mailbox with one FIFO
//! per source rank. A send copies the data into the destination's FIFO and returns (eager); a
//! receive takes the front of its FIFO for the peer, waiting on the mailbox's condition
//! variable, and checks it against what it expects. A peer that has exited (see the module docs
//! of `thread`) fails a send at once and a receive once its FIFO is empty.

use super::{Group, ThreadComm, LIVENESS_TICK};
use crate::communicator::{Descriptor, OpKind};
use crate::error::{CommError, Result};
use crate::p2p::{check_message, check_peers, P2pOp};
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// A message in flight: what the sender presented and a copy of its data.
#[derive(Debug)]
struct Message {
    sent: Descriptor,
    data: Vec<u8>,
}

#[derive(Debug, Default)]
struct Fifos {
    /// Per source rank, its messages not yet received, oldest first.
    queues: Vec<VecDeque<Message>>,
    /// Per source rank, how many messages it has sent here.
    sent: Vec<u64>,
    /// Per source rank, how many of its messages have been received.
    received: Vec<u64>,
}

/// The messages sent to one rank of a group.
#[derive(Debug)]
pub(super) struct Mailbox {
    fifos: Mutex<Fifos>,
    cv: Condvar,
}

impl Mailbox {
    pub(super) fn new(world: usize) -> Mailbox {
        Mailbox {
            fifos: Mutex::new(Fifos {
                queues: (0..world).map(|_| VecDeque::new()).collect(),
                sent: vec![0; world],
                received: vec![0; world],
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Fifos> {
        // the FIFOs are consistent between statements; a panicking thread cannot tear them
        self.fifos.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ThreadComm {
    /// Runs a batch: every send first (they never wait), then every receive in list order.
    pub(super) fn run_p2p(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        let g = &*self.group;
        let me = self.rank;
        check_peers(ops, me, g.size())?;
        let start = Instant::now();
        for op in ops.iter() {
            if let P2pOp::Send { buf, peer, .. } = op {
                self.post(g, op, buf.as_bytes(), *peer)?;
            }
        }
        for op in ops.iter_mut() {
            let desc = op.descriptor(0);
            if let P2pOp::Recv { buf, peer, .. } = op {
                self.take(g, desc, buf.as_bytes_mut(), *peer, start)?;
            }
        }
        Ok(())
    }

    /// Copies a send into `peer`'s mailbox.
    fn post(&self, g: &Group, op: &P2pOp<'_>, bytes: &[u8], peer: usize) -> Result<()> {
        let me = self.rank;
        if g.departed(peer).is_some() {
            return Err(CommError::RankGone {
                op: OpKind::Send,
                rank: me,
                gone: peer,
                waited: std::time::Duration::ZERO,
            });
        }
        let mailbox = &g.mailboxes[peer];
        let mut f = mailbox.lock();
        let seq = f.sent[me];
        f.sent[me] += 1;
        f.queues[me].push_back(Message {
            sent: op.descriptor(seq),
            data: bytes.to_vec(),
        });
        drop(f);
        mailbox.cv.notify_all();
        Ok(())
    }

    /// Takes the next message from `peer` into `out`, checked against `expected`.
    fn take(
        &self,
        g: &Group,
        mut expected: Descriptor,
        out: &mut [u8],
        peer: usize,
        start: Instant,
    ) -> Result<()> {
        let me = self.rank;
        let mailbox = &g.mailboxes[me];
        let mut f = mailbox.lock();
        loop {
            if let Some(msg) = f.queues[peer].pop_front() {
                expected.seq = f.received[peer];
                f.received[peer] += 1;
                drop(f);
                check_message(me, expected, peer, msg.sent)?;
                out.copy_from_slice(&msg.data);
                return Ok(());
            }
            let waited = start.elapsed();
            if g.departed(peer).is_some() {
                return Err(CommError::RankGone {
                    op: OpKind::Recv,
                    rank: me,
                    gone: peer,
                    waited,
                });
            }
            if waited >= self.timeout {
                return Err(CommError::Timeout {
                    op: OpKind::Recv,
                    rank: me,
                    waited,
                    missing: vec![peer],
                });
            }
            let tick = LIVENESS_TICK.min(self.timeout - waited);
            f = mailbox
                .cv
                .wait_timeout(f, tick)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
