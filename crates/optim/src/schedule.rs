//! Learning-rate schedules: pure functions of the step, so a resumed run gets exactly the
//! learning rates of an uninterrupted one.

use crate::error::{invalid, OptimError, Result};
use serde::{Deserialize, Serialize};
use std::f64::consts::PI;

/// A learning rate as a pure function of the optimizer step (the number of steps taken so far:
/// the step about to be taken uses `lr(optimizer.step_count())`). Skipped steps do not advance
/// the optimizer's count, so they do not advance the schedule.
pub trait LrSchedule: Send + Sync + std::fmt::Debug {
    /// The learning rate for step `step` (0-based).
    fn lr(&self, step: u64) -> f32;
}

/// Linear warmup, as `torch.optim.lr_scheduler.LinearLR(start_factor, end_factor=1,
/// total_iters=steps)`: the factor on the peak learning rate at step `s < steps` is
/// `start_factor + (1 - start_factor) * s / steps`, and 1 from `steps` on. With
/// `start_factor = 0` step 0 has learning rate 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Warmup {
    /// Steps of warmup (0: none).
    pub steps: u64,
    /// The factor at step 0, in [0, 1].
    pub start_factor: f64,
}

impl Warmup {
    /// No warmup.
    pub const NONE: Warmup = Warmup {
        steps: 0,
        start_factor: 1.0,
    };

    /// Warmup over `steps` steps from 0.
    pub fn linear(steps: u64) -> Self {
        Warmup {
            steps,
            start_factor: 0.0,
        }
    }

    /// The factor at `step`, in [start_factor, 1].
    pub fn factor(&self, step: u64) -> f64 {
        if step >= self.steps {
            1.0
        } else {
            self.start_factor + (1.0 - self.start_factor) * step as f64 / self.steps as f64
        }
    }

    fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.start_factor) {
            return Err(OptimError::InvalidHyperparameter {
                name: "warmup start_factor",
                value: self.start_factor,
                reason: "must be in [0, 1]",
            });
        }
        Ok(())
    }
}

fn check_lr(name: &'static str, lr: f64) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperparameter {
            name,
            value: lr,
            reason: "must be finite and at least 0",
        })
    }
}

/// A constant learning rate, optionally after a warmup.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Constant {
    lr: f64,
    warmup: Warmup,
}

impl Constant {
    /// `lr` at every step.
    pub fn new(lr: f64) -> Result<Self> {
        Self::with_warmup(lr, Warmup::NONE)
    }

    /// `lr` after `warmup`.
    pub fn with_warmup(lr: f64, warmup: Warmup) -> Result<Self> {
        check_lr("lr", lr)?;
        warmup.validate()?;
        Ok(Constant { lr, warmup })
    }
}

impl LrSchedule for Constant {
    fn lr(&self, step: u64) -> f32 {
        (self.lr * self.warmup.factor(step)) as f32
    }
}

/// The shape of the decay phase of a [`WarmupDecay`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Decay {
    /// Half a cosine from the peak down to the floor (GPT-3, Megatron, nanoGPT).
    Cosine,
    /// A straight line from the peak down to the floor.
    Linear,
}

/// Warmup to a peak learning rate, then a decay to a floor at `total_steps`, constant at the
/// floor after that. With `w` warmup steps, `T` total steps and progress
/// `x = (s - w) / (T - w)` for `w <= s < T`:
///
/// - cosine: `floor + (peak - floor) * (1 + cos(pi * x)) / 2`;
/// - linear: `peak + (floor - peak) * x`.
///
/// Learning rates are given as f64 (like PyTorch's Python floats) and every value is computed
/// in f64 and rounded once to f32.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WarmupDecay {
    peak: f64,
    floor: f64,
    warmup: Warmup,
    total_steps: u64,
    decay: Decay,
}

impl WarmupDecay {
    /// Validates `0 <= floor <= peak`, `warmup.steps <= total_steps`, a start factor in [0, 1].
    pub fn new(
        decay: Decay,
        peak: f64,
        floor: f64,
        warmup: Warmup,
        total_steps: u64,
    ) -> Result<Self> {
        check_lr("peak lr", peak)?;
        check_lr("floor lr", floor)?;
        if floor > peak {
            return Err(OptimError::InvalidHyperparameter {
                name: "floor lr",
                value: floor,
                reason: "must not exceed the peak lr",
            });
        }
        if warmup.steps > total_steps {
            return Err(OptimError::InvalidHyperparameter {
                name: "warmup steps",
                value: warmup.steps as f64,
                reason: "must not exceed total_steps",
            });
        }
        warmup.validate()?;
        Ok(WarmupDecay {
            peak,
            floor,
            warmup,
            total_steps,
            decay,
        })
    }

    /// Linear warmup from 0 over `warmup_steps`, then cosine decay to `floor` at `total_steps`.
    pub fn cosine(peak: f64, floor: f64, warmup_steps: u64, total_steps: u64) -> Result<Self> {
        Self::new(
            Decay::Cosine,
            peak,
            floor,
            Warmup::linear(warmup_steps),
            total_steps,
        )
    }

    /// Linear warmup from 0 over `warmup_steps`, then linear decay to `floor` at `total_steps`.
    pub fn linear(peak: f64, floor: f64, warmup_steps: u64, total_steps: u64) -> Result<Self> {
        Self::new(
            Decay::Linear,
            peak,
            floor,
            Warmup::linear(warmup_steps),
            total_steps,
        )
    }

    /// The step at which the floor is reached.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }
}

impl LrSchedule for WarmupDecay {
    fn lr(&self, step: u64) -> f32 {
        let w = self.warmup.steps;
        let lr = if step < w {
            self.peak * self.warmup.factor(step)
        } else if step >= self.total_steps {
            self.floor
        } else {
            let x = (step - w) as f64 / (self.total_steps - w) as f64;
            match self.decay {
                Decay::Cosine => {
                    self.floor + (self.peak - self.floor) * 0.5 * (1.0 + (PI * x).cos())
                }
                Decay::Linear => self.peak + (self.floor - self.peak) * x,
            }
        };
        lr as f32
    }
}

impl<S: LrSchedule + ?Sized> LrSchedule for Box<S> {
    fn lr(&self, step: u64) -> f32 {
        (**self).lr(step)
    }
}
/// A schedule is a pure function of the optimizer step, so its state is its definition
/// (metadata `schedule`): loading replaces it, as PyTorch's `LRScheduler.load_state_dict`
/// does. The step itself is counted once, by the optimizer.
macro_rules! stateful_schedule {
    ($($t:ty),*) => {
        $(
            impl kiln_state::Stateful for $t {
                fn state(&self) -> kiln_state::Result<kiln_state::StateDict> {
                    let mut sd = kiln_state::StateDict::new();
                    sd.set_meta("schedule", self)?;
                    Ok(sd)
                }
                fn load_state(&mut self, state: kiln_state::StateDict) -> kiln_state::Result<()> {
                    *self = state.meta("schedule")?;
                    Ok(())
                }
            }
        )*
    };
}
stateful_schedule!(Constant, WarmupDecay);

/// The shape of the learning rate after warmup, for [`ScheduleConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecayShape {
    /// Half a cosine from the peak to the floor ([`WarmupDecay::cosine`]).
    Cosine,
    /// A straight line from the peak to the floor ([`WarmupDecay::linear`]).
    Linear,
    /// The peak until the end ([`Constant`]).
    Constant,
}

/// A learning-rate schedule as a configuration value: linear warmup from 0 to `lr` over
/// `warmup_steps`, then `decay` down to `min_lr` at the run's last step. [`Default`] gives
/// 3e-3 decaying by cosine to 3e-4 after 10 warmup steps.
///
/// ```
/// use kiln_optim::{DecayShape, LrSchedule, ScheduleConfig};
/// let s = ScheduleConfig { lr: 1e-2, min_lr: 1e-3, warmup_steps: 10, decay: DecayShape::Linear };
/// let sched = s.build(110)?;
/// assert_eq!((sched.lr(5), sched.lr(10), sched.lr(60), sched.lr(110)), (5e-3, 1e-2, 5.5e-3, 1e-3));
/// # Ok::<(), kiln_optim::OptimError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScheduleConfig {
    /// The peak learning rate, above 0.
    pub lr: f64,
    /// The learning rate at the end of the decay, in [0, `lr`].
    pub min_lr: f64,
    /// Steps of linear warmup from 0 (capped at the run's length).
    pub warmup_steps: u64,
    /// The decay after warmup.
    pub decay: DecayShape,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 10,
            decay: DecayShape::Cosine,
        }
    }
}

impl ScheduleConfig {
    /// The schedule of a run of `total_steps` optimizer steps; the error names the option
    /// out of range.
    pub fn build(&self, total_steps: u64) -> Result<Box<dyn LrSchedule>> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return invalid("lr", self.lr, "must be finite and above 0");
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return invalid("min_lr", self.min_lr, "must be in [0, lr]");
        }
        let warmup = self.warmup_steps.min(total_steps);
        Ok(match self.decay {
            DecayShape::Cosine => Box::new(WarmupDecay::cosine(
                self.lr,
                self.min_lr,
                warmup,
                total_steps,
            )?),
            DecayShape::Linear => Box::new(WarmupDecay::linear(
                self.lr,
                self.min_lr,
                warmup,
                total_steps,
            )?),
            DecayShape::Constant => {
                Box::new(Constant::with_warmup(self.lr, Warmup::linear(warmup))?)
            }
        })
    }
}
