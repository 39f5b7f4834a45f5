//! The [`LossScaler`] trait, the [`ScaleEvent`] that an update returns, the serialisable
//! [`ScalerState`], and the two fixed scalers ([`StaticLossScaler`], [`NoScaler`]).

use crate::check::{all_reduce_found_inf, unscale_and_check};
use crate::dynamic::DynamicScalerConfig;
use crate::error::{PrecisionError, Result};
use kiln_comm::Communicator;
use serde::{Deserialize, Serialize};

/// What [`LossScaler::update`] did at the end of a step.
///
/// Callers tell whether the optimizer step was skipped with [`ScaleEvent::skipped_step`]: both
/// [`ScaleEvent::Skipped`] and [`ScaleEvent::BackedOff`] mean the gradients held an inf or NaN,
/// so the optimizer must not have stepped and the LR schedule must not advance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ScaleEvent {
    /// Clean gradients, the step was taken, the scale is unchanged.
    Stepped,
    /// Clean gradients, the step was taken, and the scale grew (the growth interval was reached).
    Grew,
    /// Non-finite gradients: the step is skipped, the scale is unchanged (a fixed scaler, or an
    /// overflow absorbed by hysteresis).
    Skipped,
    /// Non-finite gradients: the step is skipped and the scale was reduced.
    BackedOff,
}

impl ScaleEvent {
    /// True when the optimizer step of this iteration was skipped (non-finite gradients).
    pub fn skipped_step(self) -> bool {
        matches!(self, ScaleEvent::Skipped | ScaleEvent::BackedOff)
    }

    /// True when the optimizer step was taken.
    pub fn stepped(self) -> bool {
        !self.skipped_step()
    }
}

/// The complete state of a loss scaler, for checkpoints (serde; JSON through `serde_json`).
/// A dynamic scaler's configuration is part of its state, as in torch's
/// `GradScaler.state_dict()`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum ScalerState {
    /// [`NoScaler`].
    None,
    /// [`StaticLossScaler`].
    Static {
        /// The fixed scale.
        scale: f32,
    },
    /// [`crate::DynamicLossScaler`].
    Dynamic {
        /// The current scale.
        scale: f32,
        /// Consecutive clean steps since the last overflow or growth.
        growth_tracker: u32,
        /// Overflows still tolerated before the next backoff.
        hysteresis_left: u32,
        /// The configuration.
        config: DynamicScalerConfig,
    },
}

impl ScalerState {
    /// The kind of scaler the state belongs to (`none`, `static`, `dynamic`).
    pub fn kind(&self) -> &'static str {
        match self {
            ScalerState::None => "none",
            ScalerState::Static { .. } => "static",
            ScalerState::Dynamic { .. } => "dynamic",
        }
    }

    /// The scale recorded in the state (1 for [`ScalerState::None`]).
    pub fn scale(&self) -> f32 {
        match self {
            ScalerState::None => 1.0,
            ScalerState::Static { scale } | ScalerState::Dynamic { scale, .. } => *scale,
        }
    }
}

/// Loss scaling for mixed-precision training.
///
/// One iteration, on every rank:
/// 1. backward on `loss * scale()` (see [`LossScaler::scale_loss`]);
/// 2. `found_inf = unscale_and_check_global(comm, grads)?` unscales the f32 gradients in place,
///    and agrees on the flag across ranks;
/// 3. step the optimizer only when `!found_inf`;
/// 4. `update(found_inf)?` adjusts the scale and returns a [`ScaleEvent`].
///
/// With several gradient buffers, call [`LossScaler::unscale_and_check`] on each, OR the
/// flags, then [`all_reduce_found_inf`] once.
pub trait LossScaler: Send + std::fmt::Debug {
    /// Short name (`none`, `static`, `dynamic`).
    fn kind(&self) -> &'static str;
    /// The current loss scale.
    fn scale(&self) -> f32;
    /// The factor that unscales gradients: `1 / scale`, computed in f64 and rounded once to f32
    /// (as torch does).
    fn inv_scale(&self) -> f32 {
        (1.0 / self.scale() as f64) as f32
    }
    /// The loss multiplied by the scale (for scalar losses; scale a loss tensor by
    /// [`LossScaler::scale`] directly).
    fn scale_loss(&self, loss: f32) -> f32 {
        loss * self.scale()
    }
    /// Unscales `grads` in place and returns true when any gradient is inf or NaN, in one pass
    /// ([`crate::unscale_and_check`]). Local to this rank.
    fn unscale_and_check(&self, grads: &mut [f32]) -> bool {
        unscale_and_check(grads, self.inv_scale())
    }
    /// [`LossScaler::unscale_and_check`] followed by an all-reduce of the flag with MAX: every
    /// rank returns the same answer, so all ranks skip or step together.
    fn unscale_and_check_global(&self, comm: &dyn Communicator, grads: &mut [f32]) -> Result<bool> {
        let local = self.unscale_and_check(grads);
        all_reduce_found_inf(comm, local)
    }
    /// Ends an iteration: `found_inf` must be the same on every rank (the global flag). Returns
    /// what happened to the step and the scale, or [`PrecisionError::ScaleUnderflow`].
    fn update(&mut self, found_inf: bool) -> Result<ScaleEvent>;
    /// The state to checkpoint.
    fn scaler_state(&self) -> ScalerState;
    /// Restores a state from [`LossScaler::scaler_state`]; a state of another kind of scaler is an
    /// error.
    fn load_scaler_state(&mut self, state: &ScalerState) -> Result<()>;
}

pub(crate) fn check_scale(name: &'static str, value: f32) -> Result<f32> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(PrecisionError::InvalidConfig {
            name,
            value: value as f64,
            reason: "must be finite and positive",
        })
    }
}

/// No loss scaling (scale 1), for f32 and bf16: still detects non-finite gradients, and
/// reports skipped steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoScaler;

impl LossScaler for NoScaler {
    fn kind(&self) -> &'static str {
        "none"
    }
    fn scale(&self) -> f32 {
        1.0
    }
    fn update(&mut self, found_inf: bool) -> Result<ScaleEvent> {
        Ok(if found_inf {
            ScaleEvent::Skipped
        } else {
            ScaleEvent::Stepped
        })
    }
    fn scaler_state(&self) -> ScalerState {
        ScalerState::None
    }
    fn load_scaler_state(&mut self, state: &ScalerState) -> Result<()> {
        match state {
            ScalerState::None => Ok(()),
            other => Err(PrecisionError::StateKind {
                expected: self.kind(),
                got: other.kind(),
            }),
        }
    }
}

/// A fixed loss scale: steps with non-finite gradients are skipped, the scale never changes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StaticLossScaler {
    scale: f32,
}

impl StaticLossScaler {
    /// A scaler with the fixed `scale` (finite and positive).
    pub fn new(scale: f32) -> Result<Self> {
        Ok(StaticLossScaler {
            scale: check_scale("scale", scale)?,
        })
    }
}

impl LossScaler for StaticLossScaler {
    fn kind(&self) -> &'static str {
        "static"
    }
    fn scale(&self) -> f32 {
        self.scale
    }
    fn update(&mut self, found_inf: bool) -> Result<ScaleEvent> {
        Ok(if found_inf {
            ScaleEvent::Skipped
        } else {
            ScaleEvent::Stepped
        })
    }
    fn scaler_state(&self) -> ScalerState {
        ScalerState::Static { scale: self.scale }
    }
    fn load_scaler_state(&mut self, state: &ScalerState) -> Result<()> {
        match state {
            ScalerState::Static { scale } => {
                self.scale = check_scale("scale", *scale)?;
                Ok(())
            }
            other => Err(PrecisionError::StateKind {
                expected: self.kind(),
                got: other.kind(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_scaler_skips_but_never_changes() {
        let mut s = StaticLossScaler::new(128.0).unwrap();
        let mut g = vec![256.0f32, -128.0, 1.0];
        assert!(!s.unscale_and_check(&mut g));
        assert_eq!(g, [2.0, -1.0, 0.0078125]);
        assert_eq!(s.scale_loss(0.5), 64.0);
        assert_eq!(s.update(true).unwrap(), ScaleEvent::Skipped);
        assert_eq!(s.update(false).unwrap(), ScaleEvent::Stepped);
        assert_eq!(s.scale(), 128.0);
        assert!(StaticLossScaler::new(0.0).is_err());
        assert!(StaticLossScaler::new(f32::INFINITY).is_err());
    }

    #[test]
    fn no_scaler_checks_only() {
        let mut s = NoScaler;
        let mut g = vec![1.5f32, f32::NAN];
        assert!(s.unscale_and_check(&mut g));
        assert_eq!(g[0], 1.5);
        assert!(s.update(true).unwrap().skipped_step());
        assert!(s
            .load_scaler_state(&ScalerState::Static { scale: 2.0 })
            .is_err());
        s.load_scaler_state(&ScalerState::None).unwrap();
    }

    #[test]
    fn events_classify_steps() {
        assert!(ScaleEvent::BackedOff.skipped_step());
        assert!(ScaleEvent::Skipped.skipped_step());
        assert!(ScaleEvent::Grew.stepped());
        assert!(ScaleEvent::Stepped.stepped());
    }
}
