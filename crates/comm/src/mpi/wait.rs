//! Waiting for non-blocking MPI calls: polled to the collective's deadline, with the liveness
//! of peers on this host watched on the way.

use super::peers::Peers;
use super::raw::{self, Request};
use crate::communicator::OpKind;
use crate::error::{CommError, Result};
use std::time::{Duration, Instant};

/// How often a waiting rank looks at its peers' processes.
const LIVENESS_TICK: Duration = Duration::from_millis(50);

/// Polls requests to a deadline.
pub(super) struct Waiter<'a> {
    op: OpKind,
    rank: usize,
    timeout: Duration,
    start: Instant,
    /// The group's world ranks and the liveness watch, once the world is known.
    pub(super) watch: Option<(&'a [usize], &'a Peers)>,
    /// The group ranks to watch, when not all of them (the peers of point-to-point messages).
    pub(super) only: Option<Vec<usize>>,
}

impl<'a> Waiter<'a> {
    pub(super) fn new(op: OpKind, rank: usize, timeout: Duration, start: Instant) -> Self {
        Waiter {
            op,
            rank,
            timeout,
            start,
            watch: None,
            only: None,
        }
    }

    /// Waits for every request; `from[k]` names the group rank request `k` receives from (for
    /// the ranks a timeout reports missing). On error the requests are abandoned in flight.
    pub(super) fn wait(&self, reqs: &mut [Request], from: &[Option<usize>]) -> Result<()> {
        let begun = Instant::now();
        let mut last_look = begun;
        let mut spins = 0u32;
        loop {
            if raw::test_all(reqs)? {
                return Ok(());
            }
            let waited = self.start.elapsed();
            if waited >= self.timeout {
                let mut missing = Vec::new();
                for (req, src) in reqs.iter_mut().zip(from) {
                    if let Some(r) = src {
                        if !raw::test(req)? {
                            missing.push(*r);
                        }
                    }
                }
                return Err(CommError::Timeout {
                    op: self.op,
                    rank: self.rank,
                    waited,
                    missing,
                });
            }
            if last_look.elapsed() >= LIVENESS_TICK {
                last_look = Instant::now();
                if let Some((world_ranks, peers)) = self.watch {
                    let watched = |r: &usize| self.only.as_ref().is_none_or(|o| o.contains(r));
                    if let Some(gone) = (0..world_ranks.len())
                        .filter(watched)
                        .find(|&r| r != self.rank && !peers.alive(world_ranks[r]))
                    {
                        return Err(CommError::RankGone {
                            op: self.op,
                            rank: self.rank,
                            gone,
                            waited,
                        });
                    }
                }
            }
            spins += 1;
            if spins < 200 {
                std::hint::spin_loop();
            } else if begun.elapsed() < Duration::from_millis(10) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}
