//! `ThreadComm`: the ranks of a group are threads of one process and exchange data through
//! shared memory.
//!
//! # How a collective runs
//! Each collective is a *round* of the group. A rank entering a round publishes its
//! [`Descriptor`] and raw pointers to its buffers in its slot, under the group's mutex. The last
//! rank to arrive checks all descriptors (mismatch, lengths, root) and opens the round. Then every
//! rank works, without the lock, on its own part: for all-reduce, rank `r` reduces chunk `r` of the
//! logical buffer (per [`chunk_range`]) across all ranks' buffers in rank order and writes the
//! result into chunk `r` of every rank's buffer; chunks are disjoint, so no two threads touch the
//! same bytes, and the accumulation order does not depend on thread timing. Finally every rank
//! waits until all ranks have finished their part, so no buffer is released while another rank
//! still reads or writes it.
//!
//! # Faults
//! While waiting for the others to arrive, a rank gives up after the timeout
//! ([`CommError::Timeout`]) or as soon as a missing rank's thread has exited
//! ([`CommError::RankGone`]); it withdraws its slot under the lock before returning, so its
//! buffers are never touched after it leaves. Once a round is open, the remaining work is bounded
//! memory copying, and a drop guard marks a rank's part finished even if it unwinds.
//!
//! # Point-to-point
//! Sends and receives do not take part in rounds: see `thread/p2p.rs` (a mailbox per rank with
//! one FIFO per source).

mod p2p;
mod spawn;

use crate::check::{as_seen_by, check_calls, split_members, Call};
use crate::communicator::{chunk_range, Communicator, Descriptor, OpKind};
use crate::elem::{reduce_bytes, Buf, BufMut, DType, ReduceOp};
use crate::error::{CommError, Result};
use crate::p2p::P2pOp;
use p2p::Mailbox;
pub use spawn::{spawn, spawn_with, RankError, RankFailure};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Default time a blocking call waits for the other ranks (as `torch.distributed`'s default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// How often a waiting rank re-checks whether a missing rank has exited.
const LIVENESS_TICK: Duration = Duration::from_millis(10);

/// Options of a [`ThreadComm`] group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadCommConfig {
    /// How long a blocking call waits for the other ranks (default 300 s).
    pub timeout: Duration,
}

impl Default for ThreadCommConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl ThreadCommConfig {
    /// The default configuration with another timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self { timeout }
    }
}

/// Liveness of the world's ranks, shared by every group split from the same world.
#[derive(Debug)]
struct Liveness {
    /// Per world rank: 0 while it lives, else its place in the order of departures (1 for the
    /// first rank to leave), so that a waiting rank names the root cause, not a rank that left
    /// because of it.
    departed: Vec<AtomicU64>,
    departures: AtomicU64,
}

/// Held by every handle of one world rank; the rank counts as exited when the last one drops
/// (its thread returned, panicked, or dropped all its communicators).
#[derive(Debug)]
struct RankToken {
    world_rank: usize,
    liveness: Arc<Liveness>,
}

impl Drop for RankToken {
    fn drop(&mut self) {
        if let Some(flag) = self.liveness.departed.get(self.world_rank) {
            let order = self.liveness.departures.fetch_add(1, Ordering::SeqCst) + 1;
            flag.store(order, Ordering::SeqCst);
        }
    }
}

/// A buffer's address and length as published by its owner for one round.
#[derive(Debug, Clone, Copy)]
struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `RawBuf` is only dereferenced during an open round, while its owner is blocked inside
// the same collective (it cannot return before every rank has finished its part), and each byte
// is accessed by at most one thread at a time per the chunk partition described in the module
// docs. Sending the address to another thread is therefore sound.
unsafe impl Send for RawBuf {}

impl RawBuf {
    const EMPTY: RawBuf = RawBuf {
        ptr: std::ptr::null_mut(),
        len: 0,
    };
    fn of(b: &Buf<'_>) -> Self {
        let bytes = b.as_bytes();
        RawBuf {
            ptr: bytes.as_ptr().cast_mut(),
            len: b.len(),
        }
    }
    fn of_mut(b: &mut BufMut<'_>) -> Self {
        let len = b.len();
        RawBuf {
            ptr: b.as_bytes_mut().as_mut_ptr(),
            len,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    desc: Descriptor,
    input: RawBuf,
    output: RawBuf,
    split: (u32, u32),
    /// A fault found by this rank in its own arguments, reported to every rank.
    local_error: Option<LocalFault>,
}

#[derive(Debug, Clone, Copy)]
enum LocalFault {
    Dtype { input: DType, output: DType },
}

#[derive(Debug)]
struct RoundState {
    /// The round being gathered or run.
    round: u64,
    /// Rounds fully completed (round `r` is complete once `completed > r`).
    completed: u64,
    arrived: usize,
    slots: Vec<Option<Slot>>,
    running: bool,
    done: usize,
    /// The decision of the last arriver: `None` to proceed, or the error every rank returns.
    verdict: Option<CommError>,
    /// Results of a split, per rank of this group.
    split_out: Vec<Option<(Arc<Group>, usize)>>,
}

#[derive(Debug)]
struct Group {
    /// Group rank to world rank.
    world_ranks: Vec<usize>,
    liveness: Arc<Liveness>,
    state: Mutex<RoundState>,
    cv: Condvar,
    /// Per group rank, the point-to-point messages sent to it.
    mailboxes: Vec<Mailbox>,
}

impl Group {
    fn new(world_ranks: Vec<usize>, liveness: Arc<Liveness>) -> Arc<Self> {
        let n = world_ranks.len();
        Arc::new(Group {
            world_ranks,
            liveness,
            state: Mutex::new(RoundState {
                round: 0,
                completed: 0,
                arrived: 0,
                slots: vec![None; n],
                running: false,
                done: 0,
                verdict: None,
                split_out: vec![None; n],
            }),
            cv: Condvar::new(),
            mailboxes: (0..n).map(|_| Mailbox::new(n)).collect(),
        })
    }

    fn size(&self) -> usize {
        self.world_ranks.len()
    }

    fn lock(&self) -> MutexGuard<'_, RoundState> {
        // A panic while holding this lock cannot leave the state half-updated in a way that
        // matters more than the panic itself; keep serving the other ranks.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When group rank `group_rank` left, in the order of departures (`None`: alive).
    fn departed(&self, group_rank: usize) -> Option<u64> {
        self.world_ranks
            .get(group_rank)
            .and_then(|w| self.liveness.departed.get(*w))
            .map(|f| f.load(Ordering::SeqCst))
            .filter(|&o| o > 0)
    }
}

/// One rank's handle on a group of thread ranks. See the module docs for the protocol.
///
/// Create a whole group with [`spawn`] (one thread per rank) or [`ThreadComm::group`] (you run
/// the threads).
#[derive(Debug)]
pub struct ThreadComm {
    group: Arc<Group>,
    rank: usize,
    seq: AtomicU64,
    last: Mutex<Option<Descriptor>>,
    timeout: Duration,
    token: Arc<RankToken>,
}

impl ThreadComm {
    /// Creates the handles of a new group of `world` ranks, one per rank, to be moved into one
    /// thread each. A rank counts as exited once its handle (and every communicator split from
    /// it) is dropped.
    pub fn group(world: usize, config: ThreadCommConfig) -> Result<Vec<ThreadComm>> {
        if world == 0 {
            return Err(CommError::Config(
                "world size must be at least 1, got 0".into(),
            ));
        }
        let liveness = Arc::new(Liveness {
            departed: (0..world).map(|_| AtomicU64::new(0)).collect(),
            departures: AtomicU64::new(0),
        });
        let group = Group::new((0..world).collect(), liveness.clone());
        Ok((0..world)
            .map(|rank| ThreadComm {
                group: group.clone(),
                rank,
                seq: AtomicU64::new(0),
                last: Mutex::new(None),
                timeout: config.timeout,
                token: Arc::new(RankToken {
                    world_rank: rank,
                    liveness: liveness.clone(),
                }),
            })
            .collect())
    }

    fn descriptor(
        &self,
        op: OpKind,
        dtype: Option<DType>,
        len: usize,
        reduce: Option<ReduceOp>,
        root: Option<usize>,
    ) -> Descriptor {
        Descriptor::new(
            self.seq.load(Ordering::SeqCst),
            op,
            dtype,
            len,
            reduce,
            root,
        )
    }

    /// Runs one round: publish, wait for all, check, work, wait until all finished.
    fn round(&self, slot: Slot) -> Result<Option<(Arc<Group>, usize)>> {
        let g = &*self.group;
        let n = g.size();
        let me = self.rank;
        let op = slot.desc.op;
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(slot.desc);
        let start = Instant::now();

        let mut st = g.lock();
        if st.slots[me].is_some() || st.running {
            return Err(CommError::Config(format!(
                "rank {me} entered {op} while another collective of this communicator was in \
                 flight (one communicator is used from two threads at once)"
            )));
        }
        let round = st.round;
        st.slots[me] = Some(slot);
        st.arrived += 1;
        if st.arrived == n {
            let slots: Vec<Slot> = st.slots.iter().flatten().copied().collect();
            st.verdict = check_round(&slots);
            if st.verdict.is_none() && op == OpKind::Split {
                st.split_out = plan_split(g, &slots);
            }
            st.running = true;
            st.done = 0;
            g.cv.notify_all();
        } else {
            loop {
                if st.running && st.round == round {
                    break;
                }
                let waited = start.elapsed();
                if waited >= self.timeout {
                    st.slots[me] = None;
                    st.arrived -= 1;
                    let missing = (0..n)
                        .filter(|&r| st.slots[r].is_none() && r != me)
                        .collect();
                    return Err(CommError::Timeout {
                        op,
                        rank: me,
                        waited,
                        missing,
                    });
                }
                let first_gone = (0..n)
                    .filter(|&r| st.slots[r].is_none())
                    .filter_map(|r| g.departed(r).map(|order| (order, r)))
                    .min();
                if let Some((_, gone)) = first_gone {
                    st.slots[me] = None;
                    st.arrived -= 1;
                    return Err(CommError::RankGone {
                        op,
                        rank: me,
                        gone,
                        waited,
                    });
                }
                let tick = LIVENESS_TICK.min(self.timeout - waited);
                st =
                    g.cv.wait_timeout(st, tick)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
            }
        }

        // The round is open: take what we need and work without the lock.
        let slots: Vec<Slot> = st.slots.iter().flatten().copied().collect();
        let verdict = st.verdict.clone();
        let split = st.split_out[me].take();
        drop(st);

        {
            let _finish = FinishGuard { group: g, round };
            if verdict.is_none() && slots.len() == n {
                // SAFETY: the round is open, so every rank published valid buffers matching the
                // checked descriptors and stays inside this collective until all ranks have
                // dropped their `FinishGuard`; `work` touches only this rank's part.
                unsafe { work(&slots, me, n) };
            }
        }

        let mut st = g.lock();
        while st.completed <= round {
            st = g.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        drop(st);
        self.seq.fetch_add(1, Ordering::SeqCst);
        match verdict {
            None => Ok(split),
            Some(e) => Err(as_seen_by(e, me)),
        }
    }
}

/// Marks this rank's part of a round finished, also when unwinding.
struct FinishGuard<'a> {
    group: &'a Group,
    round: u64,
}

impl Drop for FinishGuard<'_> {
    fn drop(&mut self) {
        let g = self.group;
        let mut st = g.lock();
        st.done += 1;
        if st.done == g.size() && st.round == self.round {
            let n = g.size();
            st.completed = self.round + 1;
            st.round = self.round + 1;
            st.arrived = 0;
            st.running = false;
            st.done = 0;
            st.verdict = None;
            st.slots = vec![None; n];
            g.cv.notify_all();
        }
    }
}

/// Checks all descriptors of a round; the error every rank will return, if any.
fn check_round(slots: &[Slot]) -> Option<CommError> {
    let calls: Vec<Call> = slots
        .iter()
        .map(|s| Call {
            desc: s.desc,
            chunk_len: match s.desc.op {
                OpKind::ReduceScatter => s.output.len,
                OpKind::AllGather => s.input.len,
                _ => 0,
            },
            dtype_fault: s
                .local_error
                .map(|LocalFault::Dtype { input, output }| (input, output)),
            split: s.split,
        })
        .collect();
    check_calls(&calls)
}

/// Builds the sub-groups of a split: same color together, ordered by (key, rank).
fn plan_split(g: &Group, slots: &[Slot]) -> Vec<Option<(Arc<Group>, usize)>> {
    let splits: Vec<(u32, u32)> = slots.iter().map(|s| s.split).collect();
    let mut made: Vec<(Vec<usize>, Arc<Group>)> = Vec::new();
    split_members(&splits)
        .into_iter()
        .map(|(members, new_rank)| {
            let group = match made.iter().find(|(m, _)| *m == members) {
                Some((_, g)) => g.clone(),
                None => {
                    let world_ranks = members.iter().map(|&r| g.world_ranks[r]).collect();
                    let sub = Group::new(world_ranks, g.liveness.clone());
                    made.push((members, sub.clone()));
                    sub
                }
            };
            Some((group, new_rank))
        })
        .collect()
}

/// This rank's part of an open round.
///
/// # Safety
/// `slots` are the published slots of an open round whose descriptors passed [`check_round`],
/// and every owner stays in the collective until all parts are finished.
unsafe fn work(slots: &[Slot], me: usize, n: usize) {
    let desc = slots[me].desc;
    let Some(dtype) = desc.dtype else { return };
    match desc.op {
        OpKind::AllReduce => {
            let op = desc.reduce.unwrap_or(ReduceOp::Sum);
            // SAFETY: forwarded from the caller.
            unsafe { all_reduce_part(dtype, slots, me, n, op) }
        }
        OpKind::ReduceScatter => {
            let op = desc.reduce.unwrap_or(ReduceOp::Sum);
            // SAFETY: forwarded from the caller.
            unsafe { reduce_scatter_part(dtype, slots, me, n, op) }
        }
        OpKind::AllGather => {
            let esz = dtype.size_in_bytes();
            for (j, s) in slots.iter().enumerate() {
                let dst = chunk_range(desc.len, n, j);
                // SAFETY: rank j's input has `dst.len()` elements (checked); this rank's output
                // has `desc.len` elements and only this rank writes it.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        s.input.ptr,
                        slots[me].output.ptr.add(dst.start * esz),
                        dst.len() * esz,
                    )
                };
            }
        }
        OpKind::Broadcast => {
            let root = desc.root.unwrap_or(0);
            if root != me {
                let bytes = desc.len * dtype.size_in_bytes();
                // SAFETY: root's buffer and ours both hold `desc.len` elements; root only reads
                // during the round and only this rank writes its own buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        slots[root].output.ptr,
                        slots[me].output.ptr,
                        bytes,
                    )
                };
            }
        }
        OpKind::Barrier | OpKind::Split | OpKind::Send | OpKind::Recv => {}
    }
}

/// # Safety
/// See [`work`]; every slot's `output` holds `len` elements of `dtype`.
unsafe fn all_reduce_part(dtype: DType, slots: &[Slot], me: usize, n: usize, op: ReduceOp) {
    if n == 1 {
        // every reduction of one buffer is that buffer, in place
        return;
    }
    let range = chunk_range(slots[me].desc.len, n, me);
    let off = range.start * dtype.size_in_bytes();
    let ptrs: Vec<*mut u8> = slots
        .iter()
        // SAFETY: `range` lies within every rank's buffer of `len` elements.
        .map(|s| unsafe { s.output.ptr.add(off) })
        .collect();
    let srcs: Vec<*const u8> = ptrs.iter().map(|p| p.cast_const()).collect();
    // SAFETY: chunk `me` of every buffer is touched by this rank only during the round.
    unsafe { reduce_bytes(dtype, &srcs, &ptrs, range.len(), op) };
}

/// # Safety
/// See [`work`]; every slot's `input` holds `len` elements of `dtype`, ours `output` our chunk.
unsafe fn reduce_scatter_part(dtype: DType, slots: &[Slot], me: usize, n: usize, op: ReduceOp) {
    let range = chunk_range(slots[me].desc.len, n, me);
    let off = range.start * dtype.size_in_bytes();
    let srcs: Vec<*const u8> = slots
        .iter()
        // SAFETY: `range` lies within every rank's input of `len` elements.
        .map(|s| unsafe { s.input.ptr.cast_const().add(off) })
        .collect();
    let dst = [slots[me].output.ptr];
    // SAFETY: inputs are only read during the round; our output is written only by us.
    unsafe { reduce_bytes(dtype, &srcs, &dst, range.len(), op) };
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.size()
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn backend(&self) -> &'static str {
        "thread"
    }

    fn last_collective(&self) -> Option<Descriptor> {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn all_reduce_buf(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let desc = self.descriptor(
            OpKind::AllReduce,
            Some(buf.dtype()),
            buf.len(),
            Some(op),
            None,
        );
        let out = RawBuf::of_mut(&mut buf);
        self.round(Slot {
            desc,
            input: out,
            output: out,
            split: (0, 0),
            local_error: None,
        })
        .map(|_| ())
    }

    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        mut output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let desc = self.descriptor(
            OpKind::ReduceScatter,
            Some(input.dtype()),
            input.len(),
            Some(op),
            None,
        );
        let local_error = (input.dtype() != output.dtype()).then_some(LocalFault::Dtype {
            input: input.dtype(),
            output: output.dtype(),
        });
        self.round(Slot {
            desc,
            input: RawBuf::of(&input),
            output: RawBuf::of_mut(&mut output),
            split: (0, 0),
            local_error,
        })
        .map(|_| ())
    }

    fn all_gather_buf(&self, input: Buf<'_>, mut output: BufMut<'_>) -> Result<()> {
        let desc = self.descriptor(
            OpKind::AllGather,
            Some(output.dtype()),
            output.len(),
            None,
            None,
        );
        let local_error = (input.dtype() != output.dtype()).then_some(LocalFault::Dtype {
            input: input.dtype(),
            output: output.dtype(),
        });
        self.round(Slot {
            desc,
            input: RawBuf::of(&input),
            output: RawBuf::of_mut(&mut output),
            split: (0, 0),
            local_error,
        })
        .map(|_| ())
    }

    fn broadcast_buf(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        let desc = self.descriptor(
            OpKind::Broadcast,
            Some(buf.dtype()),
            buf.len(),
            None,
            Some(root),
        );
        let out = RawBuf::of_mut(&mut buf);
        self.round(Slot {
            desc,
            input: out,
            output: out,
            split: (0, 0),
            local_error: None,
        })
        .map(|_| ())
    }

    fn barrier(&self) -> Result<()> {
        let desc = self.descriptor(OpKind::Barrier, None, 0, None, None);
        self.round(Slot {
            desc,
            input: RawBuf::EMPTY,
            output: RawBuf::EMPTY,
            split: (0, 0),
            local_error: None,
        })
        .map(|_| ())
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        let desc = self.descriptor(OpKind::Split, None, 0, None, None);
        let out = self.round(Slot {
            desc,
            input: RawBuf::EMPTY,
            output: RawBuf::EMPTY,
            split: (color, key),
            local_error: None,
        })?;
        let (group, rank) = out.ok_or_else(|| {
            CommError::Config(format!("split on rank {} produced no group", self.rank))
        })?;
        Ok(Box::new(ThreadComm {
            group,
            rank,
            seq: AtomicU64::new(0),
            last: Mutex::new(None),
            timeout: self.timeout,
            token: self.token.clone(),
        }))
    }

    fn p2p_batch(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        self.run_p2p(ops)
    }
}
