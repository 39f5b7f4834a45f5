//! [`DynamicLossScaler`]: torch.amp.GradScaler's dynamic loss scale, with DeepSpeed's
//! hysteresis, a minimum scale that stops training with an error, and a maximum scale.

use crate::error::{PrecisionError, Result};
use crate::scaler::{check_scale, LossScaler, ScaleEvent, ScalerState};
use serde::{Deserialize, Serialize};

/// The options of a [`DynamicLossScaler`]. [`Default`] gives torch.amp.GradScaler's defaults
/// (initial scale 2^16, growth 2.0 every 2000 clean steps, backoff 0.5), no hysteresis, no
/// maximum, and a minimum scale of 1.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DynamicScalerConfig {
    /// The first scale (torch `init_scale`, default 65536).
    pub init_scale: f32,
    /// The factor applied after `growth_interval` consecutive clean steps (torch
    /// `growth_factor`, default 2.0; above 1).
    pub growth_factor: f32,
    /// The factor applied on overflow (torch `backoff_factor`, default 0.5; in (0, 1)).
    pub backoff_factor: f32,
    /// Consecutive clean steps before the scale grows (torch `growth_interval`, default 2000;
    /// at least 1).
    pub growth_interval: u32,
    /// Overflows needed to back off once (DeepSpeed `delayed_shift`, default 1: back off at
    /// every overflow, as torch does). See [`DynamicLossScaler`] for the exact rule.
    pub hysteresis: u32,
    /// Refill the hysteresis after every clean step, not only when the scale grows (DeepSpeed
    /// `consecutive_hysteresis`, default false).
    pub consecutive_hysteresis: bool,
    /// The smallest scale (default 1.0, DeepSpeed's default; torch has no minimum): a backoff
    /// stops here, and an overflow at this scale is [`PrecisionError::ScaleUnderflow`].
    pub min_scale: f32,
    /// The largest scale (default none: like torch, the scale grows only while the result is
    /// finite).
    pub max_scale: Option<f32>,
}

impl Default for DynamicScalerConfig {
    fn default() -> Self {
        DynamicScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_scale: 1.0,
            max_scale: None,
        }
    }
}

impl DynamicScalerConfig {
    /// Checks every option; the error names the first one out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: f64, reason| {
            Err(PrecisionError::InvalidConfig {
                name,
                value,
                reason,
            })
        };
        check_scale("init_scale", self.init_scale)?;
        check_scale("min_scale", self.min_scale)?;
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(
                "growth_factor",
                self.growth_factor as f64,
                "must be finite and above 1",
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(
                "backoff_factor",
                self.backoff_factor as f64,
                "must be in (0, 1)",
            );
        }
        if self.growth_interval == 0 {
            return bad("growth_interval", 0.0, "must be at least 1");
        }
        if self.hysteresis == 0 {
            return bad("hysteresis", 0.0, "must be at least 1");
        }
        if self.min_scale > self.init_scale {
            return bad(
                "min_scale",
                self.min_scale as f64,
                "must not exceed init_scale",
            );
        }
        if let Some(max) = self.max_scale {
            check_scale("max_scale", max)?;
            if max < self.init_scale {
                return bad("max_scale", max as f64, "must not be below init_scale");
            }
        }
        Ok(())
    }
}

/// Dynamic loss scaling with torch.amp.GradScaler's semantics.
///
/// `update(found_inf)`:
/// - clean step: the growth tracker counts up; when it reaches `growth_interval` the scale is
///   multiplied by `growth_factor` (clamped to `max_scale`, and kept as is when the product
///   would be inf, as torch does) and the tracker restarts at 0 ([`ScaleEvent::Grew`]),
///   otherwise [`ScaleEvent::Stepped`];
/// - overflow: the step is skipped and the growth tracker resets to 0. Without hysteresis the
///   scale is multiplied by `backoff_factor` ([`ScaleEvent::BackedOff`]), never below
///   `min_scale`; an overflow while the scale already equals `min_scale` returns
///   [`PrecisionError::ScaleUnderflow`] and leaves the state unchanged.
///
/// Hysteresis follows DeepSpeed's `DynamicLossScaler` (`delayed_shift`,
/// `consecutive_hysteresis`) exactly: a counter starts at `hysteresis`; an overflow while it is
/// above 1 decrements it and only skips the step ([`ScaleEvent::Skipped`]); an overflow while
/// it is 1 backs off, and the counter stays at 1, so further overflows keep backing off until it
/// is refilled. It is refilled to `hysteresis` when the scale grows, or after every clean step
/// with `consecutive_hysteresis`. The growth interval counts as torch's does (growth after
/// exactly `growth_interval` consecutive clean steps; DeepSpeed grows one step later).
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    config: DynamicScalerConfig,
    scale: f32,
    growth_tracker: u32,
    hysteresis_left: u32,
}

impl Default for DynamicLossScaler {
    /// torch.amp.GradScaler's defaults ([`DynamicScalerConfig::default`]).
    fn default() -> Self {
        let config = DynamicScalerConfig::default();
        DynamicLossScaler {
            scale: config.init_scale,
            growth_tracker: 0,
            hysteresis_left: config.hysteresis,
            config,
        }
    }
}

impl DynamicLossScaler {
    /// A scaler with `config`, validated.
    pub fn new(config: DynamicScalerConfig) -> Result<Self> {
        config.validate()?;
        Ok(DynamicLossScaler {
            scale: config.init_scale,
            growth_tracker: 0,
            hysteresis_left: config.hysteresis,
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DynamicScalerConfig {
        &self.config
    }

    /// Consecutive clean steps since the last overflow or growth.
    pub fn growth_tracker(&self) -> u32 {
        self.growth_tracker
    }

    /// The hysteresis counter (DeepSpeed's `cur_hysteresis`): the next `hysteresis_left - 1`
    /// overflows only skip their step, the one after backs off.
    pub fn hysteresis_left(&self) -> u32 {
        self.hysteresis_left
    }
}

impl LossScaler for DynamicLossScaler {
    fn kind(&self) -> &'static str {
        "dynamic"
    }

    fn scale(&self) -> f32 {
        self.scale
    }

    fn update(&mut self, found_inf: bool) -> Result<ScaleEvent> {
        let c = &self.config;
        if found_inf {
            if self.hysteresis_left > 1 {
                self.hysteresis_left -= 1;
                self.growth_tracker = 0;
                return Ok(ScaleEvent::Skipped);
            }
            if self.scale <= c.min_scale {
                return Err(PrecisionError::ScaleUnderflow {
                    scale: self.scale,
                    min_scale: c.min_scale,
                });
            }
            self.scale = (self.scale * c.backoff_factor).max(c.min_scale);
            self.growth_tracker = 0;
            return Ok(ScaleEvent::BackedOff);
        }
        if c.consecutive_hysteresis {
            self.hysteresis_left = c.hysteresis;
        }
        self.growth_tracker += 1;
        if self.growth_tracker < c.growth_interval {
            return Ok(ScaleEvent::Stepped);
        }
        self.growth_tracker = 0;
        self.hysteresis_left = c.hysteresis;
        let mut grown = self.scale * c.growth_factor;
        if let Some(max) = c.max_scale {
            grown = grown.min(max);
        }
        if grown.is_finite() && grown > self.scale {
            self.scale = grown;
            Ok(ScaleEvent::Grew)
        } else {
            Ok(ScaleEvent::Stepped)
        }
    }

    fn scaler_state(&self) -> ScalerState {
        ScalerState::Dynamic {
            scale: self.scale,
            growth_tracker: self.growth_tracker,
            hysteresis_left: self.hysteresis_left,
            config: self.config,
        }
    }

    fn load_scaler_state(&mut self, state: &ScalerState) -> Result<()> {
        match state {
            ScalerState::Dynamic {
                scale,
                growth_tracker,
                hysteresis_left,
                config,
            } => {
                config.validate()?;
                self.scale = check_scale("scale", *scale)?;
                self.growth_tracker = *growth_tracker;
                self.hysteresis_left = *hysteresis_left;
                self.config = *config;
                Ok(())
            }
            other => Err(PrecisionError::StateKind {
                expected: self.kind(),
                got: other.kind(),
            }),
        }
    }
}
