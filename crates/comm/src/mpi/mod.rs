//! `MpiComm`: one rank per process over MPI (Open MPI or MPICH through the `mpi` crate), with
//! the same contract as [`crate::ThreadComm`]: bitwise the same results, timeouts on every
//! wait, and mismatched calls reported as [`CommError::Mismatch`].
//!
//! # How a collective runs
//! 1. **Agreement** (on by default, [`MpiCommConfig::check`]): every rank sends its call
//!    (descriptor, chunk length, dtype fault, split color and key: 80 bytes) to every other rank
//!    with `MPI_Isend`/`MPI_Irecv` and runs the same check as the thread backend. A mismatch is
//!    an error on every rank, before any data moves, and the communicator stays usable. It is
//!    also the barrier, and it tells who never arrived when a wait times out. Cost: `2(n-1)`
//!    messages of 80 bytes per rank and collective (see `bench_comm --backend mpi`).
//! 2. **Data**, through staging buffers the communicator owns (MPI never sees a caller's buffer,
//!    so a collective abandoned at its timeout cannot write into freed memory later):
//!    - all-reduce: an `MPI_Ialltoallv` sends rank `j` its chunk (per [`chunk_range`]) of every
//!      rank's buffer; each rank reduces its chunk in rank order 0, 1, ..., n-1 (f16 and bf16 in
//!      f32) with the thread backend's kernel; a second `MPI_Ialltoallv`, sending the reduced
//!      chunk to every peer, returns it to everyone (Open MPI's non-blocking all-gather cost
//!      twice as much on one host). Each rank sends and receives `2(n-1)/n` of the buffer, as
//!      in a ring all-reduce; the staging adds a copy in and a copy out of `(n-1)/n` of it.
//!    - reduce-scatter: the first all-to-all and the reduction; all-gather: the second
//!      all-to-all; broadcast: `MPI_Ibcast`.
//!    - Buffers move in rounds of at most [`MpiCommConfig::stage_bytes`] per rank (1 MiB), so
//!      the staging copies stay in the caches and MPI's `int` counts in range. On 2 processes
//!      of a 2-core host, a 64 MiB f32 all-reduce ran at 0.54-0.57x memcpy bandwidth and the
//!      thread backend at 0.69-0.93x in the same runs (`bench_comm --backend mpi`).
//! 3. **Waiting**: requests are polled with `MPI_Testall` up to the timeout (spinning, then
//!    yielding, then sleeping briefly, so oversubscribed ranks leave the cores to each other).
//!    Peers on the same host are watched through `/proc`: a peer process that exited fails the
//!    wait with [`CommError::RankGone`] within about 50 ms.
//!
//! Point-to-point messages (`send_buf`, `recv_buf`, `p2p_batch`) are in `mpi/p2p.rs`: an
//! `MPI_Isend` of an owned copy (eager at any size), a checked receive through staging.
//!
//! A collective that failed while requests were in flight (timeout, exited peer, MPI error)
//! leaves the communicator unusable: MPI cannot cancel a collective, so its staging memory is
//! leaked rather than freed under MPI's feet, and every later call returns the original error.
//! [`Mpi`]'s drop then skips `MPI_Finalize` (which could wait for the dead peer); the process
//! exits and the launcher tears the job down.

mod p2p;
mod peers;
mod raw;
mod runtime;
mod wait;

use crate::check::{as_seen_by, check_calls, split_members, Call};
use crate::communicator::{chunk_range, Communicator, Descriptor, OpKind};
use crate::elem::{reduce_bytes, Buf, BufMut, DType, ReduceOp};
use crate::error::{CommError, Result};
use crate::p2p::P2pOp;
use crate::wire::WIRE_WORDS;
use peers::Peers;
use raw::CommHandle;
use runtime::runtime;
pub use runtime::Mpi;
use std::ffi::c_int;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};
use wait::Waiter;

/// The tag of the agreement messages (data moves in collectives, which never match them).
const CALL_TAG: i32 = 0x6b6c;

/// Options of an [`MpiComm`] (inherited by the communicators split from it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpiCommConfig {
    /// How long a blocking call waits for the other ranks (default 300 s).
    pub timeout: Duration,
    /// Exchange and check every call before moving data (default on): mismatched calls become
    /// [`CommError::Mismatch`] and timeouts name the ranks that never arrived. Off, a
    /// mismatched call is undefined behaviour of MPI (usually a truncation error or a hang
    /// until the timeout).
    pub check: bool,
    /// The most bytes a rank sends per round of a large collective (default 1 MiB); the
    /// staging memory of a communicator is about four times this. Rounds that fit the caches
    /// keep the staging copies out of main memory: on 2 processes of one host, a 64 MiB
    /// all-reduce ran at 0.48-0.54x memcpy with 1 MiB rounds against 0.23-0.29x with 32 MiB
    /// (`bench_comm --backend mpi --stage-kib N`).
    pub stage_bytes: usize,
}

impl Default for MpiCommConfig {
    fn default() -> Self {
        MpiCommConfig {
            timeout: crate::DEFAULT_TIMEOUT,
            check: true,
            stage_bytes: 1 << 20,
        }
    }
}

impl MpiCommConfig {
    /// The default configuration with another timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        MpiCommConfig {
            timeout,
            ..Self::default()
        }
    }
}

/// Buffers MPI reads and writes during a collective; heap memory owned by the communicator.
#[derive(Debug, Default)]
struct Staging {
    send: Vec<u64>,
    recv: Vec<u64>,
    gsend: Vec<u64>,
    gather: Vec<u64>,
    counts: Vec<c_int>,
    calls_out: Vec<u64>,
    calls_in: Vec<u64>,
}

/// The first `nbytes` bytes of `v`, grown as needed (8-byte aligned, so any element type fits).
fn bytes(v: &mut Vec<u64>, nbytes: usize) -> &mut [u8] {
    let words = nbytes.div_ceil(8);
    if v.len() < words {
        v.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut(v.as_mut_slice())[..nbytes]
}

#[derive(Debug, Default)]
pub(super) struct State {
    stage: Staging,
    /// The failure that left operations in flight; every later call returns it.
    broken: Option<CommError>,
    /// Point-to-point messages: sends in flight and message counts per peer.
    p2p: p2p::P2pState,
}

/// One rank's handle on a group of MPI processes. See the module docs for the protocol.
///
/// Create the world's with [`Mpi::world`] and groups with [`Communicator::split`]
/// (`MPI_Comm_split`). Each communicator runs one collective (or point-to-point batch) at a
/// time; use one per thread
/// (split it) for concurrent work, as kiln's data-parallel engine and checkpoint writer do.
#[derive(Debug)]
pub struct MpiComm {
    pub(super) handle: CommHandle,
    pub(super) rank: usize,
    pub(super) size: usize,
    /// Group rank to world rank.
    pub(super) world_ranks: Vec<usize>,
    pub(super) peers: Arc<Peers>,
    pub(super) config: MpiCommConfig,
    pub(super) seq: AtomicU64,
    pub(super) last: Mutex<Option<Descriptor>>,
    pub(super) state: Mutex<State>,
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // sends still in flight complete first (their receivers may not have posted yet)
        let flushed = self.flush_sends();
        let broken = self.state.get_mut().map_or(true, |s| s.broken.is_some());
        if flushed && !broken && !runtime().finalized {
            // a failing free leaves a handle behind, which MPI_Finalize cleans up
            let _ = self.handle.free();
        }
    }
}

/// Sub-range `i` of `k` of rank `j`'s chunk of a `len`-element buffer over `n` ranks.
fn sub(len: usize, n: usize, j: usize, k: usize, i: usize) -> Range<usize> {
    let c = chunk_range(len, n, j);
    let s = chunk_range(c.len(), k, i);
    c.start + s.start..c.start + s.end
}

/// How many rounds move a `len`-element buffer when a rank moves at most `stage_bytes` a round.
fn rounds(len: usize, n: usize, esz: usize, stage_bytes: usize) -> usize {
    let largest = chunk_range(len, n, 0).len();
    let per_round = (stage_bytes / (n * esz).max(1)).max(1);
    largest.div_ceil(per_round).max(1)
}

fn byte_range(r: &Range<usize>, esz: usize) -> Range<usize> {
    r.start * esz..r.end * esz
}

fn count(bytes: usize) -> Result<c_int> {
    c_int::try_from(bytes).map_err(|_| raw::err("counts", format_args!("{bytes} bytes")))
}

impl MpiComm {
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

    /// Runs one collective: agreement, then `data` (skipped when the check fails).
    fn run<T>(
        &self,
        call: Call,
        data: impl FnOnce(&Waiter<'_>, &mut Staging, &[Call]) -> Result<T>,
    ) -> Result<T> {
        let op = call.desc.op;
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(call.desc);
        let mut state = self.enter(op)?;
        let mut waiter = Waiter::new(op, self.rank, self.config.timeout, Instant::now());
        waiter.watch = Some((&self.world_ranks, &self.peers));
        let st = &mut *state;
        let outcome = self.agree(&waiter, &mut st.stage, call).and_then(|calls| {
            if let Some(verdict) = calls.as_deref().and_then(check_calls) {
                return Ok(Err(as_seen_by(verdict, self.rank)));
            }
            let calls = calls.unwrap_or_default();
            data(&waiter, &mut st.stage, &calls).map(Ok)
        });
        match outcome {
            Ok(result) => {
                self.seq.fetch_add(1, Ordering::SeqCst);
                result
            }
            Err(e) => {
                // requests may be in flight on the staging memory: leak it, never free it
                std::mem::forget(std::mem::take(&mut st.stage));
                st.broken = Some(e.clone());
                runtime().broken = true;
                Err(e)
            }
        }
    }

    /// The communicator's state for one operation, unless another is in flight, an earlier
    /// failure left it unusable, or MPI is finalised.
    fn enter(&self, op: OpKind) -> Result<MutexGuard<'_, State>> {
        let state = match self.state.try_lock() {
            Ok(s) => s,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return Err(CommError::Config(format!(
                    "rank {} entered {op} while another collective of this communicator was in \
                     flight (one communicator is used from two threads at once)",
                    self.rank
                )))
            }
        };
        if let Some(e) = &state.broken {
            return Err(raw::err(
                op.name(),
                format_args!("communicator unusable after an earlier failure: {e}"),
            ));
        }
        if runtime().finalized {
            return Err(raw::err(op.name(), "MPI is finalised"));
        }
        Ok(state)
    }

    /// Exchanges every rank's call (when checking, and always for a split).
    fn agree(
        &self,
        waiter: &Waiter<'_>,
        stage: &mut Staging,
        call: Call,
    ) -> Result<Option<Vec<Call>>> {
        if !self.config.check && call.desc.op != OpKind::Split {
            return Ok(None);
        }
        let (n, me) = (self.size, self.rank);
        let msg = WIRE_WORDS * 8;
        bytes(&mut stage.calls_out, msg).copy_from_slice(bytemuck::cast_slice(&call.to_wire()));
        let inbox = bytes(&mut stage.calls_in, n * msg).as_mut_ptr();
        let outbox = stage.calls_out.as_ptr().cast::<u8>();
        let mut reqs = Vec::with_capacity(2 * n);
        let mut from = Vec::with_capacity(2 * n);
        for r in (0..n).filter(|&r| r != me) {
            // SAFETY: the staging buffers are heap memory that outlives the requests (leaked if
            // they never complete); each receive has its own 80-byte slot.
            reqs.push(unsafe { self.handle.irecv(inbox.add(r * msg), msg, r, CALL_TAG)? });
            from.push(Some(r));
        }
        for r in (0..n).filter(|&r| r != me) {
            // SAFETY: as above; the outbox is only read.
            reqs.push(unsafe { self.handle.isend(outbox, msg, r, CALL_TAG)? });
            from.push(None);
        }
        waiter.wait(&mut reqs, &from)?;
        let words: &[u64] = &stage.calls_in[..n * WIRE_WORDS];
        let mut calls = Vec::with_capacity(n);
        for r in 0..n {
            if r == me {
                calls.push(call);
                continue;
            }
            let mut w = [0u64; WIRE_WORDS];
            w.copy_from_slice(&words[r * WIRE_WORDS..(r + 1) * WIRE_WORDS]);
            calls.push(Call::from_wire(&w).ok_or_else(|| {
                raw::err(
                    call.desc.op.name(),
                    format_args!("rank {r} sent a call that is not kiln's (another library's message on this communicator?)"),
                )
            })?);
        }
        Ok(Some(calls))
    }

    /// Rounds of all-reduce (`output = Some`) or reduce-scatter into `out` (this rank's chunk).
    #[allow(clippy::too_many_arguments)]
    fn reduce_rounds(
        &self,
        w: &Waiter<'_>,
        st: &mut Staging,
        dtype: DType,
        op: ReduceOp,
        input: *const u8,
        len: usize,
        out: *mut u8,
        gather_back: bool,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let esz = dtype.size_in_bytes();
        if n == 1 {
            // SAFETY: one source and one destination of `len` elements (the same buffer for
            // all-reduce, which the kernel allows); the thread backend runs the same kernel.
            unsafe { reduce_bytes(dtype, &[input], &[out], len, op) };
            return Ok(());
        }
        let k = rounds(len, n, esz, self.config.stage_bytes);
        let my_chunk = chunk_range(len, n, me);
        for i in 0..k {
            let subs: Vec<Range<usize>> = (0..n).map(|j| sub(len, n, j, k, i)).collect();
            let mine = subs[me].clone();
            let m = mine.len();
            // 1. every rank's sub-chunk of our buffer to its owner
            let total: usize = (0..n)
                .filter(|&j| j != me)
                .map(|j| subs[j].len() * esz)
                .sum();
            let send = bytes(&mut st.send, total);
            let mut counts = vec![0 as c_int; 4 * n];
            let mut off = 0;
            for j in (0..n).filter(|&j| j != me) {
                let b = byte_range(&subs[j], esz);
                let nb = b.len();
                // SAFETY: `input` holds `len` elements (checked by the caller) and MPI never
                // writes it; `b` lies within it.
                let src = unsafe { std::slice::from_raw_parts(input.add(b.start), nb) };
                send[off..off + nb].copy_from_slice(src);
                counts[j] = count(nb)?;
                counts[n + j] = count(off)?;
                off += nb;
            }
            for j in (0..n).filter(|&j| j != me) {
                counts[2 * n + j] = count(m * esz)?;
                counts[3 * n + j] = count(j * m * esz)?;
            }
            st.counts.clear();
            st.counts.extend_from_slice(&counts);
            let recv = bytes(&mut st.recv, n * m * esz).as_mut_ptr();
            let c = st.counts.as_ptr();
            // SAFETY: staging buffers and counts are heap memory owned by the communicator
            // that outlive the request (leaked if it never completes); counts fit the buffers.
            let mut req = [unsafe {
                self.handle.ialltoallv(
                    st.send.as_ptr().cast(),
                    c,
                    c.add(n),
                    recv,
                    c.add(2 * n),
                    c.add(3 * n),
                )?
            }];
            w.wait(&mut req, &[])?;
            // 2. reduce our sub-chunk in rank order
            let gsend = bytes(&mut st.gsend, m * esz).as_mut_ptr();
            let srcs: Vec<*const u8> = (0..n)
                .map(|j| {
                    if j == me {
                        // SAFETY: `mine` lies within the input.
                        unsafe { input.add(mine.start * esz) }
                    } else {
                        // SAFETY: slot `j` of the receive buffer holds `m` elements.
                        unsafe { recv.add(j * m * esz).cast_const() }
                    }
                })
                .collect();
            // SAFETY: `out` holds this rank's chunk (reduce-scatter) or the whole buffer
            // (all-reduce); either way the sub-chunk's place in it is in bounds.
            let dst = unsafe {
                if gather_back {
                    out.add(mine.start * esz)
                } else {
                    out.add((mine.start - my_chunk.start) * esz)
                }
            };
            let dsts = if gather_back {
                vec![dst, gsend]
            } else {
                vec![dst]
            };
            // SAFETY: every source holds `m` elements of `dtype` and is 8-byte aligned
            // (staging) or aligned for `dtype` (the caller's slice); the destinations are
            // ours alone (an all-reduce source aliases its destination exactly, which the
            // kernel allows).
            unsafe { reduce_bytes(dtype, &srcs, &dsts, m, op) };
            if !gather_back {
                continue;
            }
            // 3. the reduced sub-chunks back to everyone
            self.gather_round(w, st, &subs, esz, out, false)?;
        }
        Ok(())
    }

    /// Every rank's `gsend` (its sub-chunk `subs[rank]`) into `out` at `subs`
    /// (this rank's own only with `copy_mine`):
    /// an all-gather, run as an `MPI_Ialltoallv` that sends the same buffer to every peer
    /// (Open MPI's non-blocking all-gather costs twice as much on one host, measured by
    /// `bench_comm --backend mpi`).
    fn gather_round(
        &self,
        w: &Waiter<'_>,
        st: &mut Staging,
        subs: &[Range<usize>],
        esz: usize,
        out: *mut u8,
        copy_mine: bool,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let m = subs[me].len();
        let mut counts = vec![0 as c_int; 4 * n];
        let mut off = 0;
        for (j, r) in subs.iter().enumerate().filter(|&(j, _)| j != me) {
            counts[j] = count(m * esz)?;
            counts[2 * n + j] = count(r.len() * esz)?;
            counts[3 * n + j] = count(off)?;
            off += r.len() * esz;
        }
        st.counts.clear();
        st.counts.extend_from_slice(&counts);
        let gather = bytes(&mut st.gather, off).as_mut_ptr();
        let c = st.counts.as_ptr();
        // SAFETY: staging buffers and counts are heap memory owned by the communicator that
        // outlive the request (leaked if it never completes); every send reads the same `m`
        // elements of `gsend` (overlapping sends are allowed), every receive has its own slot.
        let mut req = [unsafe {
            self.handle.ialltoallv(
                st.gsend.as_ptr().cast(),
                c,
                c.add(n),
                gather,
                c.add(2 * n),
                c.add(3 * n),
            )?
        }];
        w.wait(&mut req, &[])?;
        let mut off = 0;
        for (j, r) in subs.iter().enumerate() {
            let b = byte_range(r, esz);
            // SAFETY: `out` holds the whole buffer and `b` lies within it; the gather buffer
            // holds every other rank's sub-chunk in rank order, `gsend` this rank's.
            unsafe {
                if j == me && copy_mine {
                    let src = st.gsend.as_ptr().cast::<u8>();
                    std::ptr::copy_nonoverlapping(src, out.add(b.start), b.len());
                } else if j != me {
                    std::ptr::copy_nonoverlapping(gather.add(off), out.add(b.start), b.len());
                    off += b.len();
                }
            }
        }
        Ok(())
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn timeout(&self) -> Duration {
        self.config.timeout
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn last_collective(&self) -> Option<Descriptor> {
        *self.last.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn all_reduce_buf(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let dtype = buf.dtype();
        let len = buf.len();
        let desc = self.descriptor(OpKind::AllReduce, Some(dtype), len, Some(op), None);
        let call = Call {
            desc,
            chunk_len: 0,
            dtype_fault: None,
            split: (0, 0),
        };
        let ptr = buf.as_bytes_mut().as_mut_ptr();
        self.run(call, |w, st, _| {
            if len == 0 {
                return Ok(());
            }
            self.reduce_rounds(w, st, dtype, op, ptr, len, ptr, true)
        })
    }

    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        mut output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let dtype = input.dtype();
        let len = input.len();
        let desc = self.descriptor(OpKind::ReduceScatter, Some(dtype), len, Some(op), None);
        let dtype_fault = (dtype != output.dtype()).then_some((dtype, output.dtype()));
        let call = Call {
            desc,
            chunk_len: output.len(),
            dtype_fault,
            split: (0, 0),
        };
        let expected = chunk_range(len, self.size, self.rank).len();
        let (inp, out) = (
            input.as_bytes().as_ptr(),
            output.as_bytes_mut().as_mut_ptr(),
        );
        let out_len = output.len();
        if !self.config.check {
            // unchecked, a wrong local buffer is still refused before MPI sees the call
            local_chunk_ok(
                OpKind::ReduceScatter,
                self.rank,
                "output",
                expected,
                out_len,
                dtype_fault,
            )?;
        }
        self.run(call, |w, st, _| {
            if len == 0 {
                return Ok(());
            }
            self.reduce_rounds(w, st, dtype, op, inp, len, out, false)
        })
    }

    fn all_gather_buf(&self, input: Buf<'_>, mut output: BufMut<'_>) -> Result<()> {
        let dtype = output.dtype();
        let len = output.len();
        let desc = self.descriptor(OpKind::AllGather, Some(dtype), len, None, None);
        let dtype_fault = (input.dtype() != dtype).then_some((input.dtype(), dtype));
        let in_len = input.len();
        let call = Call {
            desc,
            chunk_len: in_len,
            dtype_fault,
            split: (0, 0),
        };
        let (n, me) = (self.size, self.rank);
        let expected = chunk_range(len, n, me).len();
        let inp = input.as_bytes();
        let out = output.as_bytes_mut().as_mut_ptr();
        if !self.config.check {
            local_chunk_ok(
                OpKind::AllGather,
                me,
                "input",
                expected,
                in_len,
                dtype_fault,
            )?;
        }
        self.run(call, |w, st, _| {
            let esz = dtype.size_in_bytes();
            let k = rounds(len, n, esz, self.config.stage_bytes);
            let my_start = chunk_range(len, n, me).start;
            for i in 0..k {
                let subs: Vec<Range<usize>> = (0..n).map(|j| sub(len, n, j, k, i)).collect();
                let mine = &subs[me];
                let m = mine.len();
                let from = byte_range(&(mine.start - my_start..mine.end - my_start), esz);
                bytes(&mut st.gsend, m * esz).copy_from_slice(&inp[from]);
                if n == 1 {
                    // SAFETY: the output holds the whole buffer; `gsend` holds `m` elements.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            st.gsend.as_ptr().cast::<u8>(),
                            out.add(mine.start * esz),
                            m * esz,
                        )
                    };
                    continue;
                }
                self.gather_round(w, st, &subs, esz, out, true)?;
            }
            Ok(())
        })
    }

    fn broadcast_buf(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        let dtype = buf.dtype();
        let len = buf.len();
        let desc = self.descriptor(OpKind::Broadcast, Some(dtype), len, None, Some(root));
        let call = Call {
            desc,
            chunk_len: 0,
            dtype_fault: None,
            split: (0, 0),
        };
        let n = self.size;
        let me = self.rank;
        let data = buf.as_bytes_mut();
        if root >= n {
            // checked, every rank reports it through the agreement; unchecked, before MPI
            if !self.config.check {
                return Err(CommError::BadRoot {
                    op: OpKind::Broadcast,
                    root,
                    world: n,
                });
            }
        }
        self.run(call, |w, st, _| {
            if n == 1 {
                return Ok(());
            }
            let piece = self.config.stage_bytes.max(1);
            let mut off = 0;
            while off < data.len() {
                let nb = piece.min(data.len() - off);
                let stage = bytes(&mut st.send, nb);
                if me == root {
                    stage.copy_from_slice(&data[off..off + nb]);
                }
                let p = stage.as_mut_ptr();
                // SAFETY: staging memory that outlives the request.
                let mut req = [unsafe { self.handle.ibcast(p, nb, root)? }];
                w.wait(&mut req, &[])?;
                if me != root {
                    data[off..off + nb].copy_from_slice(&bytes(&mut st.send, nb)[..]);
                }
                off += nb;
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<()> {
        let desc = self.descriptor(OpKind::Barrier, None, 0, None, None);
        let call = Call {
            desc,
            chunk_len: 0,
            dtype_fault: None,
            split: (0, 0),
        };
        self.run(call, |w, _, calls| {
            // the agreement exchange already waited for everyone
            if !calls.is_empty() || self.size == 1 {
                return Ok(());
            }
            let mut req = [self.handle.ibarrier()?];
            w.wait(&mut req, &[])
        })
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        let desc = self.descriptor(OpKind::Split, None, 0, None, None);
        let call = Call {
            desc,
            chunk_len: 0,
            dtype_fault: None,
            split: (color, key),
        };
        let sub = self.run(call, |_, _, calls| {
            let splits: Vec<(u32, u32)> = calls.iter().map(|c| c.split).collect();
            let (members, new_rank) = split_members(&splits)
                .into_iter()
                .nth(self.rank)
                .ok_or_else(|| raw::err("split", "no group for this rank"))?;
            // every rank has arrived (the exchange completed), so the blocking split returns
            let handle = self.handle.split(color, key)?;
            handle.errors_return()?;
            let (rank, size) = handle.rank_and_size()?;
            if (rank, size) != (new_rank, members.len()) {
                return Err(raw::err(
                    "MPI_Comm_split",
                    format_args!(
                        "MPI placed rank {} at {rank} of {size}, kiln's order says {new_rank} of {}",
                        self.rank,
                        members.len()
                    ),
                ));
            }
            Ok(MpiComm {
                handle,
                rank,
                size,
                world_ranks: members.iter().map(|&r| self.world_ranks[r]).collect(),
                peers: self.peers.clone(),
                config: self.config,
                seq: AtomicU64::new(0),
                last: Mutex::new(None),
                state: Mutex::new(State::default()),
            })
        })?;
        Ok(Box::new(sub))
    }

    fn p2p_batch(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        self.run_p2p(ops)
    }
}

/// Refuses a wrong local chunk buffer even when the agreement check is off.
fn local_chunk_ok(
    op: OpKind,
    rank: usize,
    what: &'static str,
    expected: usize,
    got: usize,
    dtype_fault: Option<(DType, DType)>,
) -> Result<()> {
    if let Some((input, output)) = dtype_fault {
        return Err(CommError::DtypeMismatch {
            op,
            rank,
            input,
            output,
        });
    }
    if expected != got {
        return Err(CommError::BadLength {
            op,
            rank,
            what,
            expected,
            got,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_cover_every_chunk_in_order() {
        for (len, n, esz, stage) in [
            (10usize, 3usize, 4usize, 8usize),
            (1 << 20, 4, 2, 1 << 16),
            (7, 2, 8, 1 << 30),
            (0, 2, 4, 64),
        ] {
            let k = rounds(len, n, esz, stage);
            for j in 0..n {
                let mut next = chunk_range(len, n, j).start;
                for i in 0..k {
                    let s = sub(len, n, j, k, i);
                    assert_eq!(s.start, next);
                    assert!(s.len() * esz * n <= stage.max(n * esz) || s.len() <= 1);
                    next = s.end;
                }
                assert_eq!(next, chunk_range(len, n, j).end);
            }
        }
    }
}
