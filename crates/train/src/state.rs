//! The trainer's checkpoint state as kiln-ckpt [`Stateful`] parts.
//!
//! | part | component | holds |
//! |------|---------|-------|
//! | `engine` | the `DataParallel` engine itself | fp32 master weights `param/<name>`, AdamW `exp_avg/<name>` and `exp_avg_sq/<name>`, the step count |
//! | `scaler` | the loss scaler itself | its `ScalerState` |
//! | `loader` | the `DataLoader` itself | its [`kiln_data::LoaderState`] (JSON), skip set included |
//! | `breaker` | the [`kiln_monitor::CircuitBreaker`] itself | its state, skipped sample windows included |
//! | `detectors` | the [`kiln_monitor::DetectorSet`] itself | the recent records its windows replay |
//! | `trainer` | [`TrainerProgress`] | step counters and the run hash |
//! | `rng` | [`kiln_ckpt::RngState`] | the seed (every random draw is keyed by it) |
//! | `drift` | the [`kiln_data::DriftMonitor`] itself | the token ids of its window |
//!
//! The `engine` part is kiln-parallel's [`kiln_parallel::DataParallel`] itself: every
//! parameter and its AdamW moments under their own names, with global shapes and each rank's
//! slice, so checkpoints reshard (see kiln-parallel's docs). Every other part is likewise the
//! component's own [`Stateful`] implementation; this module only adds the trainer's counters.

use kiln_ckpt::{StateDict, Stateful};
use serde::{Deserialize, Serialize};

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
    /// Samples trained on from each training source, over all data-parallel ranks (the
    /// realised mixture).
    #[serde(default)]
    pub source_samples: Vec<u64>,
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
