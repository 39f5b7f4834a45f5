//! Running a trainer on `dp * tp` thread ranks of one process.

use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::trainer::{TrainSummary, Trainer};
use kiln_comm::{spawn_with, CommError, RankFailure, ThreadComm, ThreadCommConfig};

/// What the per-rank closure of [`run_threads_with`] gets.
#[derive(Debug)]
pub struct RankContext<'a> {
    /// This rank's world communicator.
    pub comm: ThreadComm,
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
