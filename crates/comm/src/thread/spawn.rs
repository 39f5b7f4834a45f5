//! Running a closure on every rank of a [`ThreadComm`] group, one thread each ([`spawn`]), and
//! the first failure of such a run ([`RankError`]).

use super::{ThreadComm, ThreadCommConfig};
use crate::error::CommError;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Why a rank of [`spawn`] failed.
#[derive(Debug)]
pub enum RankFailure<E> {
    /// The closure returned an error.
    Error(E),
    /// The closure panicked, with this message.
    Panicked(String),
}

/// The first rank (in time) whose closure failed under [`spawn`].
#[derive(Debug, thiserror::Error)]
#[error("rank {rank} failed: {}{}", match .failure { RankFailure::Error(e) => e.to_string(), RankFailure::Panicked(m) => format!("panicked: {m}") }, if .also_failed.is_empty() { String::new() } else { format!(" (then ranks {:?} failed too)", .also_failed) })]
pub struct RankError<E: std::fmt::Display + std::fmt::Debug> {
    /// The rank that failed first.
    pub rank: usize,
    /// What happened.
    pub failure: RankFailure<E>,
    /// Ranks that failed after it, in the order they failed (often as a consequence).
    pub also_failed: Vec<usize>,
}

impl<E: std::fmt::Display + std::fmt::Debug> RankError<E> {
    /// The error returned by the first failing rank, if it returned one rather than panicking.
    pub fn error(&self) -> Option<&E> {
        match &self.failure {
            RankFailure::Error(e) => Some(e),
            RankFailure::Panicked(_) => None,
        }
    }
}

/// Runs `f` on `world` ranks, one thread each, with the default configuration, and returns every
/// rank's result in rank order, or the first failure in time (see [`RankError`]).
///
/// ```
/// use kiln_comm::{spawn, CommExt, Communicator, ReduceOp};
/// let sums = spawn(3, |comm| {
///     let mut v = [comm.rank() as f32, 1.0];
///     comm.all_reduce(&mut v, ReduceOp::Sum)?;
///     Ok::<_, kiln_comm::CommError>(v)
/// })?;
/// assert_eq!(sums, vec![[3.0, 3.0]; 3]);
/// # Ok::<(), kiln_comm::RankError<kiln_comm::CommError>>(())
/// ```
pub fn spawn<R, E, F>(world: usize, f: F) -> std::result::Result<Vec<R>, RankError<E>>
where
    F: Fn(ThreadComm) -> std::result::Result<R, E> + Sync,
    R: Send,
    E: Send + std::fmt::Display + std::fmt::Debug,
    E: From<CommError>,
{
    spawn_with(ThreadCommConfig::default(), world, f)
}

/// [`spawn`] with a configuration (for example a short timeout in tests).
pub fn spawn_with<R, E, F>(
    config: ThreadCommConfig,
    world: usize,
    f: F,
) -> std::result::Result<Vec<R>, RankError<E>>
where
    F: Fn(ThreadComm) -> std::result::Result<R, E> + Sync,
    R: Send,
    E: Send + std::fmt::Display + std::fmt::Debug,
    E: From<CommError>,
{
    let comms = match ThreadComm::group(world, config) {
        Ok(c) => c,
        Err(e) => {
            return Err(RankError {
                rank: 0,
                failure: RankFailure::Error(E::from(e)),
                also_failed: Vec::new(),
            })
        }
    };
    let order = AtomicUsize::new(0);
    let f = &f;
    let order = &order;
    let outcomes: Vec<(usize, std::result::Result<R, RankFailure<E>>)> =
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    std::thread::Builder::new()
                        .name(format!("kiln-rank-{rank}"))
                        .spawn_scoped(scope, move || {
                            let out = match catch_unwind(AssertUnwindSafe(|| f(comm))) {
                                Ok(Ok(r)) => Ok(r),
                                Ok(Err(e)) => Err(RankFailure::Error(e)),
                                Err(p) => Err(RankFailure::Panicked(kiln_state::panic_message(
                                    p.as_ref(),
                                ))),
                            };
                            (order.fetch_add(1, Ordering::SeqCst), out)
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| match h {
                    Ok(h) => h.join().unwrap_or_else(|p| {
                        (
                            usize::MAX,
                            Err(RankFailure::Panicked(kiln_state::panic_message(p.as_ref()))),
                        )
                    }),
                    Err(e) => (
                        usize::MAX,
                        Err(RankFailure::Error(E::from(CommError::Config(format!(
                            "could not start the thread of rank {rank}: {e}"
                        ))))),
                    ),
                })
                .collect()
        });
    let mut failures: Vec<(usize, usize, RankFailure<E>)> = Vec::new();
    let mut results = Vec::with_capacity(world);
    for (rank, (when, out)) in outcomes.into_iter().enumerate() {
        match out {
            Ok(r) => results.push(r),
            Err(e) => failures.push((when, rank, e)),
        }
    }
    failures.sort_by_key(|(when, rank, _)| (*when, *rank));
    let mut failures = failures.into_iter();
    match failures.next() {
        None => Ok(results),
        Some((_, rank, failure)) => Err(RankError {
            rank,
            failure,
            also_failed: failures.map(|(_, r, _)| r).collect(),
        }),
    }
}
