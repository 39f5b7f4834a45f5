//! Running a trainer on `dp * tp` ranks: thread ranks of this process, or one rank per process
//! under an MPI launcher.

use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::trainer::{TrainSummary, Trainer};
use kiln_comm::{
    spawn_with, Backend, CommError, Communicator, RankFailure, ThreadComm, ThreadCommConfig,
};
use kiln_launch::init_from_env;

/// What the per-rank closure of [`run_threads_with`] (a [`ThreadComm`]) and [`run_with`] (a
/// `Box<dyn Communicator>` of the configured backend) gets.
#[derive(Debug)]
pub struct RankContext<'a, C = ThreadComm> {
    /// This rank's world communicator.
    pub comm: C,
    /// The global rank.
    pub rank: usize,
    /// The run configuration.
    pub config: &'a RunConfig,
}

/// A rank's failure, carried through [`kiln_comm::spawn_with`].
#[derive(Debug)]
struct RankErr(Box<TrainError>);

impl std::fmt::Display for RankErr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<CommError> for RankErr {
    fn from(e: CommError) -> Self {
        RankErr(Box::new(e.into()))
    }
}

/// Gives each thread rank one op thread when the ranks are at least as many as the cores, and
/// says whether the ranks' ops run that way. Call it first in `main`, before any tensor op and
/// before any other thread exists (it may set an environment variable).
///
/// candle runs every parallel CPU op (kiln's kernels too) on one process-wide worker pool
/// behind one lock, sized at its first use from `CANDLE_NUM_THREADS` (else one thread per
/// core). Thread ranks that outnumber the cores then queue for that lock while the pool's
/// workers spin on the cores the ranks need: on 2 cores the 4 thread ranks of `train_gpt`
/// trained at 1,137 tokens/s through the pool and at 2,007 with one op thread per rank. So
/// when `config` runs `dp * tp > 1` thread ranks on at most that many cores and
/// `CANDLE_NUM_THREADS` is unset, this sets it to 1: the pool gets no worker, and each rank's
/// ops run on the rank's own thread. Returns `true` when the pool has no worker (also when the
/// variable was already 1), `false` when the pool runs workers (one rank, fewer ranks than
/// cores, MPI, a variable set otherwise, or a pool already started).
pub fn one_op_thread_per_rank(config: &RunConfig) -> bool {
    let world = config.parallel.world();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if config.parallel.backend == Backend::Thread
        && world > 1
        && world >= cores
        && std::env::var_os("CANDLE_NUM_THREADS").is_none()
    {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    candle_core::utils::barrier_pool().n_workers() == 0
}

/// Runs `f` on `config.parallel.dp * config.parallel.tp` thread ranks and returns every
/// rank's result in rank order, or the error of the rank that failed first (as it returned it,
/// so a caller can match on it; a panic becomes [`TrainError::Rank`]).
pub fn run_threads_with<R, F>(config: &RunConfig, f: F) -> Result<Vec<R>>
where
    F: Fn(RankContext<'_>) -> Result<R> + Sync,
    R: Send,
{
    let world = config.parallel.world();
    if world == 0 {
        return Err(TrainError::config(
            "RunConfig.parallel",
            "dp x tp must be at least 1",
        ));
    }
    let tc = ThreadCommConfig::default();
    spawn_with(tc, world, |comm: ThreadComm| {
        let rank = kiln_comm::Communicator::rank(&comm);
        f(RankContext { comm, rank, config }).map_err(|e| RankErr(Box::new(e)))
    })
    .map_err(|e| match e.failure {
        RankFailure::Error(RankErr(inner)) => *inner,
        RankFailure::Panicked(m) => TrainError::Rank {
            rank: e.rank,
            message: format!("panicked: {m}"),
        },
    })
}

/// Runs `f` on the ranks of `config` that live in this process, with the configured backend
/// (`config.parallel.backend`), and returns their results as `(rank, result)` in rank order:
/// - `thread`: all `dp * tp` ranks, one thread each ([`run_threads_with`]);
/// - `mpi`: this process's one rank, after [`init_from_env`] (run under
///   `mpirun -np <dp*tp>`); MPI is finalised when `f` has returned. On a CUDA device the
///   launcher's local rank is added to the configured GPU ordinal (one process per GPU).
///
/// Printing and other once-per-job work belongs to whichever process gets rank 0's result.
pub fn run_with<R, F>(config: &RunConfig, f: F) -> Result<Vec<(usize, R)>>
where
    F: Fn(RankContext<'_, Box<dyn Communicator>>) -> Result<R> + Sync,
    R: Send,
{
    match config.parallel.backend {
        Backend::Thread => {
            let out = run_threads_with(config, |ctx| {
                f(RankContext {
                    comm: Box::new(ctx.comm),
                    rank: ctx.rank,
                    config: ctx.config,
                })
            })?;
            Ok(out.into_iter().enumerate().collect())
        }
        backend => {
            let launched = init_from_env(backend)?;
            let world = launched.comm.world_size();
            if world != config.parallel.world() {
                return Err(TrainError::config(
                    "RunConfig.parallel",
                    format!(
                        "dp ({}) x tp ({}) = {} ranks, but the launcher started {world} \
                         processes (mpirun -np {})",
                        config.parallel.dp,
                        config.parallel.tp,
                        config.parallel.world(),
                        config.parallel.world()
                    ),
                ));
            }
            let rank = launched.comm.rank();
            // one process per GPU: the local rank picks this process's device
            let mut own = config.clone();
            own.device = config.device.offset(launched.env.local_rank);
            let out = f(RankContext {
                comm: launched.comm,
                rank,
                config: &own,
            });
            match out {
                // the runtime (MPI) is finalised on return, after this rank's communicators
                Ok(r) => Ok(vec![(rank, r)]),
                Err(e) => {
                    // the other ranks may wait for this one in a collective: do not wait for
                    // them in MPI_Finalize; exiting with the error ends the job
                    launched.runtime.abandon();
                    Err(e)
                }
            }
        }
    }
}

/// Trains `config` with the default [`Trainer`] on `dp * tp` thread ranks and returns rank 0's
/// summary.
///
/// ```no_run
/// let mut cfg = kiln_train::RunConfig::preset("train_gpt")?;
/// cfg.apply_overrides(&[("steps", "30")])?;
/// let summary = kiln_train::run_threads(&cfg)?;
/// println!("loss {:?}, {:.0} tokens/s, outputs {:?}", summary.final_loss, summary.tokens_per_s, summary.outputs);
/// # Ok::<(), kiln_train::TrainError>(())
/// ```
pub fn run_threads(config: &RunConfig) -> Result<TrainSummary> {
    let mut all = run_threads_with(config, |ctx| {
        Trainer::builder(ctx.config.clone()).build(ctx.comm)?.run()
    })?;
    if all.is_empty() {
        return Err(TrainError::Rank {
            rank: 0,
            message: "no rank ran".into(),
        });
    }
    Ok(all.swap_remove(0))
}
