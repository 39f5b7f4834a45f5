//! Combining one step's per-rank measurements across the ranks of a group.

use crate::metrics::StepMetrics;
use crate::Result;
use kiln_comm::{CommExt, Communicator};

/// What one rank measured on a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankStats {
    /// This rank's loss.
    pub loss: f64,
    /// This rank's step wall time, seconds.
    pub step_time_s: f64,
    /// Tokens this rank trained on in the step.
    pub tokens: u64,
    /// Samples this rank trained on in the step.
    pub samples: u64,
}

/// One step's measurements combined over all ranks.
///
/// Non-finite values propagate: a NaN loss on any rank makes `loss_mean`, `loss_min` and
/// `loss_max` NaN, so no rank's divergence is averaged away.
#[derive(Debug, Clone, PartialEq)]
pub struct RankSummary {
    /// Number of ranks.
    pub world_size: usize,
    /// Mean of the ranks' losses (each rank weighs the same, as in data parallel with equal
    /// per-rank batches).
    pub loss_mean: f64,
    /// Smallest rank loss.
    pub loss_min: f64,
    /// Largest rank loss.
    pub loss_max: f64,
    /// Mean rank step time, seconds.
    pub step_time_mean_s: f64,
    /// Fastest rank's step time, seconds.
    pub step_time_min_s: f64,
    /// Slowest rank's step time, seconds: the step's real duration.
    pub step_time_max_s: f64,
    /// The slowest rank (the lowest such rank on ties).
    pub straggler_rank: usize,
    /// Tokens over all ranks.
    pub tokens: u64,
    /// Samples over all ranks.
    pub samples: u64,
    /// Every rank's loss, in rank order.
    pub rank_loss: Vec<f64>,
    /// Every rank's step time in rank order, seconds.
    pub rank_step_time_s: Vec<f64>,
}

const FIELDS: usize = 4;

fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

impl RankSummary {
    /// Collective over `comm`: every rank passes its own stats and gets the same summary.
    ///
    /// One `all_gather` of four f64 per rank, so the straggler detector also gets every rank's
    /// step time; the combination is computed in rank order, hence bitwise identical on every
    /// rank and in every run.
    pub fn gather(comm: &dyn Communicator, local: &RankStats) -> Result<Self> {
        let world = comm.world_size();
        let mine = [
            local.loss,
            local.step_time_s,
            local.tokens as f64,
            local.samples as f64,
        ];
        let mut all = vec![0.0f64; world * FIELDS];
        comm.all_gather(&mine, &mut all)?;
        let ranks: Vec<RankStats> = all
            .chunks_exact(FIELDS)
            .map(|c| RankStats {
                loss: c[0],
                step_time_s: c[1],
                tokens: c[2] as u64,
                samples: c[3] as u64,
            })
            .collect();
        Ok(Self::from_ranks(&ranks))
    }

    /// Combines stats already collected in rank order (what [`RankSummary::gather`] computes
    /// after its collective). An empty slice gives NaN statistics and zero counts.
    pub fn from_ranks(ranks: &[RankStats]) -> Self {
        let n = ranks.len();
        let mut s = RankSummary {
            world_size: n,
            loss_mean: 0.0,
            loss_min: f64::INFINITY,
            loss_max: f64::NEG_INFINITY,
            step_time_mean_s: 0.0,
            step_time_min_s: f64::INFINITY,
            step_time_max_s: f64::NEG_INFINITY,
            straggler_rank: 0,
            tokens: 0,
            samples: 0,
            rank_loss: Vec::with_capacity(n),
            rank_step_time_s: Vec::with_capacity(n),
        };
        if n == 0 {
            s.loss_mean = f64::NAN;
            s.loss_min = f64::NAN;
            s.loss_max = f64::NAN;
            s.step_time_mean_s = f64::NAN;
            s.step_time_min_s = f64::NAN;
            s.step_time_max_s = f64::NAN;
            return s;
        }
        for (r, x) in ranks.iter().enumerate() {
            s.loss_mean += x.loss;
            s.loss_min = nan_min(s.loss_min, x.loss);
            s.loss_max = nan_max(s.loss_max, x.loss);
            s.step_time_mean_s += x.step_time_s;
            s.step_time_min_s = nan_min(s.step_time_min_s, x.step_time_s);
            if x.step_time_s > s.step_time_max_s {
                s.straggler_rank = r;
            }
            s.step_time_max_s = nan_max(s.step_time_max_s, x.step_time_s);
            s.tokens += x.tokens;
            s.samples += x.samples;
            s.rank_loss.push(x.loss);
            s.rank_step_time_s.push(x.step_time_s);
        }
        s.loss_mean /= n as f64;
        s.step_time_mean_s /= n as f64;
        s
    }

    /// Writes the summary into a step record: `loss` (the mean), `step_time_s` (the slowest
    /// rank), `step_time_min_s`, `step_time_max_s`, `straggler_rank`, `rank_step_time_s`, and
    /// `tokens_per_s` / `samples_per_s` over the slowest rank's time.
    pub fn apply(&self, m: &mut StepMetrics) {
        m.loss = Some(self.loss_mean);
        m.step_time_s = Some(self.step_time_max_s);
        m.step_time_min_s = Some(self.step_time_min_s);
        m.step_time_max_s = Some(self.step_time_max_s);
        m.straggler_rank = Some(self.straggler_rank as u64);
        m.rank_step_time_s.clone_from(&self.rank_step_time_s);
        m.set_throughput(self.tokens, self.samples, self.step_time_max_s);
    }
}
