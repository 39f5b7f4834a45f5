//! The engine's configuration and what a step reports: [`Stage`], [`DataParallelConfig`],
//! [`StepReport`], [`StepPreview`].

use crate::error::{ParallelError, Result};
use crate::flat::DEFAULT_BUCKET_BYTES;
use kiln_memory::CheckpointPolicy;
use kiln_optim::OptimizerConfig;
use kiln_precision::ScaleEvent;

/// How model states are split over the data-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Plain data parallel: everything replicated.
    Replicated,
    /// ZeRO-1: optimizer states and fp32 master weights sharded.
    Zero1,
    /// ZeRO-2: also gradients.
    Zero2,
    /// ZeRO-3: also parameters.
    Zero3,
}

impl Stage {
    /// The ZeRO stage number (0 for replicated).
    pub fn number(self) -> u8 {
        match self {
            Stage::Replicated => 0,
            Stage::Zero1 => 1,
            Stage::Zero2 => 2,
            Stage::Zero3 => 3,
        }
    }

    /// The stage with this number.
    pub fn from_number(n: u8) -> Result<Self> {
        match n {
            0 => Ok(Stage::Replicated),
            1 => Ok(Stage::Zero1),
            2 => Ok(Stage::Zero2),
            3 => Ok(Stage::Zero3),
            _ => Err(ParallelError::Config(format!(
                "zero stage must be 0, 1, 2 or 3, got {n}"
            ))),
        }
    }

    pub(super) fn shards_grads(self) -> bool {
        matches!(self, Stage::Zero2 | Stage::Zero3)
    }
}

/// Options of [`DataParallel`](super::DataParallel).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DataParallelConfig {
    /// The sharding stage.
    pub stage: Stage,
    /// Bucket size in bytes (f32 elements x 4).
    pub bucket_bytes: usize,
    /// Communicate on a background thread while the backward continues (on by default).
    pub overlap: bool,
    /// Clip gradients to this global L2 norm.
    pub max_grad_norm: Option<f32>,
    /// The optimizer each shard runs ([`DataParallel::with_optimizer`](super::DataParallel::with_optimizer)
    /// plugs in one of your own instead).
    pub optimizer: OptimizerConfig,
    /// Also report the global parameter norm and the update-to-parameter norm ratio of every
    /// applied step ([`StepReport::param_norm`], [`StepReport::update_ratio`]): computed
    /// inside the update, unit by unit, at the cost of two collectives (off by default).
    pub update_norms: bool,
    /// Activation checkpointing.
    pub checkpoint: CheckpointPolicy,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        Self {
            stage: Stage::Replicated,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            overlap: true,
            max_grad_norm: None,
            optimizer: OptimizerConfig::default(),
            update_norms: false,
            checkpoint: CheckpointPolicy::None,
        }
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Mean loss over the micro-batches and the data-parallel group (unscaled).
    pub loss: f32,
    /// Global gradient L2 norm before clipping (unscaled); `None` when the step was skipped.
    pub grad_norm: Option<f64>,
    /// Whether clipping scaled the gradients.
    pub clipped: bool,
    /// What the loss scaler did; [`ScaleEvent::skipped_step`] tells a skipped step.
    pub scale_event: ScaleEvent,
    /// The loss scale used for this step.
    pub loss_scale: f32,
    /// Seconds spent in forward and backward (including overlapped communication).
    pub compute_s: f64,
    /// Of `compute_s`, the seconds in the forward passes (recomputation counts as backward).
    pub forward_s: f64,
    /// Seconds waiting for communication after the backward finished.
    pub comm_wait_s: f64,
    /// Seconds in unscale, clipping, optimizer and parameter gathering.
    pub optim_s: f64,
    /// Global L2 norm of the parameters after the update (with
    /// [`DataParallelConfig::update_norms`], applied steps only).
    pub param_norm: Option<f64>,
    /// Global L2 norm of the update divided by [`StepReport::param_norm`].
    pub update_ratio: Option<f64>,
}

/// What [`DataParallel::backward`](super::DataParallel::backward) computed, before the update
/// is applied or discarded (the gate of
/// [`DataParallel::step_gated`](super::DataParallel::step_gated) sees it). The values are the
/// same on every rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepPreview {
    /// Mean loss over the micro-batches and the data-parallel group (unscaled).
    pub loss: f32,
    /// Global gradient L2 norm before clipping (unscaled); `None` when the gradients hold
    /// inf or NaN.
    pub grad_norm: Option<f64>,
    /// Some gradient on some rank was inf or NaN: the step cannot be applied.
    pub found_inf: bool,
    /// The loss scale used for this step.
    pub loss_scale: f32,
    /// What the loss scaler did.
    pub scale_event: ScaleEvent,
    /// Seconds spent in forward and backward so far.
    pub compute_s: f64,
    /// Of `compute_s`, the seconds in the forward passes (recomputation counts as backward).
    pub forward_s: f64,
    /// Seconds spent waiting for communication after the backward so far.
    pub comm_wait_s: f64,
}
