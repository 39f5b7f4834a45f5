//! The trainer's checkpoint state as kiln-ckpt [`Stateful`] parts.
//!
//! | part | component | holds |
//! |------|---------|-------|
//! | `engine` | the `DataParallel` engine itself | fp32 master weights `param/<name>`, AdamW `exp_avg/<name>` and `exp_avg_sq/<name>`, the step count |
//! | `scaler` | the loss scaler itself | its `ScalerState` |
//! | `loader` | the `DataLoader` itself | its [`kiln_data::LoaderState`] (JSON), skip set included |
//! | `breaker` | the [`kiln_monitor::CircuitBreaker`] itself | its state, skipped sample windows included |
//! | `trainer` | [`TrainerProgress`] | step counters, the detectors' recent inputs, the run hash |
//! | `rng` | [`kiln_ckpt::RngState`] | the seed (every random draw is keyed by it) |
//!
//! The `engine` part is kiln-parallel's [`kiln_parallel::DataParallel`] itself: every
//! parameter and its AdamW moments under their own names, with global shapes and each rank's
//! slice, so checkpoints reshard (see kiln-parallel's docs). Every other part is likewise the
//! component's own [`Stateful`] implementation; this module only adds the trainer's counters.

use kiln_ckpt::{StateDict, Stateful};
use kiln_monitor::{ScalerEvent, StepMetrics};
use serde::{Deserialize, Serialize};

/// What the detectors saw of one step; replayed into fresh detectors on resume so their
/// rolling windows continue exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetectorInput {
    /// The step.
    pub step: u64,
    /// Its loss.
    pub loss: Option<f64>,
    /// Its gradient norm.
    pub grad_norm: Option<f64>,
    /// What the loss scaler did.
    pub scaler_event: Option<ScalerEvent>,
}

impl DetectorInput {
    /// The record of `m` the detectors need.
    pub fn of(m: &StepMetrics) -> Self {
        DetectorInput {
            step: m.step,
            loss: m.loss,
            grad_norm: m.grad_norm,
            scaler_event: m.scaler_event,
        }
    }

    /// Back to a step record.
    pub fn to_metrics(&self) -> StepMetrics {
        StepMetrics {
            step: self.step,
            loss: self.loss,
            grad_norm: self.grad_norm,
            scaler_event: self.scaler_event,
            ..StepMetrics::default()
        }
    }
}

/// The trainer's own counters, as the `trainer` part (metadata `progress`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerProgress {
    /// Steps completed (a skipped step counts).
    pub step: u64,
    /// Optimizer steps taken (the learning-rate schedule's position).
    pub optimizer_steps: u64,
    /// Steps whose update was not applied (loss-scaler overflows, skipped batches).
    pub skipped_steps: u64,
    /// Tokens trained on, over all data-parallel ranks.
    pub tokens_seen: u64,
    /// Samples trained on, over all data-parallel ranks.
    pub samples_seen: u64,
    /// [`crate::RunConfig::trajectory_hash`] of the run that saved it.
    pub run_hash: String,
    /// The detectors' recent inputs, oldest first.
    pub detector_log: Vec<DetectorInput>,
}

impl Stateful for TrainerProgress {
    fn state(&self) -> kiln_state::Result<StateDict> {
        let mut sd = StateDict::new();
        sd.set_meta("progress", self)?;
        Ok(sd)
    }

    fn load_state(&mut self, state: StateDict) -> kiln_state::Result<()> {
        *self = state.meta("progress")?;
        Ok(())
    }
}
