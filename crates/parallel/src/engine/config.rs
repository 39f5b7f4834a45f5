//! The engine's configuration and what a step reports: [`DataParallelConfig`],
//! [`StepReport`], [`StepPreview`].

use crate::flat::DEFAULT_BUCKET_BYTES;
use kiln_memory::RecomputePolicy;
use kiln_optim::OptimizerConfig;
use kiln_precision::ScaleEvent;
use kiln_state::ZeroStage;

/// Options of [`DataParallel`](super::DataParallel).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DataParallelConfig {
    /// The sharding stage.
    pub stage: ZeroStage,
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
    /// Activation recomputation.
    pub recompute: RecomputePolicy,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        Self {
            stage: ZeroStage::Replicated,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            overlap: true,
            max_grad_norm: None,
            optimizer: OptimizerConfig::default(),
            update_norms: false,
            recompute: RecomputePolicy::None,
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
