//! The [`Optimizer`] trait: an optimizer over one flat f32 buffer (or a shard of it) that owns
//! its state, so that ZeRO can give each rank the state of its own shard.

use crate::adamw::{AdamW, AdamWConfig};
use crate::error::{OptimError, Result};
use crate::groups::DecayOverride;
use crate::sgd::{Sgd, SgdConfig};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// An optimizer over a flat f32 buffer of a fixed length: the whole parameter buffer, or the
/// shard of it that this rank owns.
///
/// Element-wise optimizers (AdamW) guarantee that a shard holding elements `a..b` of the buffer
/// computes bitwise the same values as the unsharded optimizer does for `a..b`.
pub trait Optimizer: Send {
    /// The optimizer's name (`adamw`, `sgd`): checkpoints record it, and loading another
    /// optimizer's state is an error.
    fn name(&self) -> &'static str;

    /// Number of parameters this optimizer holds state for.
    fn len(&self) -> usize;

    /// True when the optimizer holds no parameters (an empty shard).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of steps taken so far (0 before the first step). Skipped steps (overflow) are not
    /// counted because [`Optimizer::step`] is not called for them; an LR schedule indexed by
    /// this count does not advance on them.
    fn step_count(&self) -> u64;

    /// Sets the step count (when restoring a checkpoint from tensors).
    fn set_step_count(&mut self, step: u64);

    /// One update of `params` from `grads` at learning rate `lr`. Both slices must have
    /// [`Optimizer::len`] elements, or [`crate::OptimError::LengthMismatch`] is returned and
    /// nothing changes.
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()>;

    /// Gives the elements in each range their own weight decay (parameter groups: see
    /// [`DecayOverride`]); the others keep the optimizer's own. Ranges must be sorted, disjoint
    /// and inside the buffer.
    fn set_decay_overrides(&mut self, overrides: Vec<DecayOverride>) -> Result<()>;

    /// The state buffers, each of [`Optimizer::len`] elements, by name (for checkpoints that
    /// store tensors: AdamW gives `exp_avg` and `exp_avg_sq`, PyTorch's names).
    fn state_buffers(&self) -> Vec<(&'static str, &[f32])>;

    /// The state buffers, writable (to restore them from a checkpoint in place).
    fn state_buffers_mut(&mut self) -> Vec<(&'static str, &mut [f32])>;

    /// How many threads a step may split its buffer over (1 runs on the caller's thread). The
    /// values do not depend on it. The default ignores it: an optimizer that has no threads.
    fn set_threads(&mut self, threads: usize) {
        let _ = threads;
    }

    /// A thread pool the step may split its buffer over instead of starting threads of its
    /// own ([`Optimizer::set_threads`]); `None` (the default) goes back to those. The values do
    /// not depend on it. The default ignores it.
    fn set_runner(&mut self, runner: Option<Arc<dyn ParallelRunner>>) {
        let _ = runner;
    }

    /// The concrete optimizer, for code that runs a known optimizer on its own kernels
    /// (kiln-parallel's device-resident CUDA step runs [`AdamW`] this way). `None` (the
    /// default): only [`Optimizer::step`] may update it.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

/// A parallel for over a thread pool the caller owns: runs `job(i)` once for every `i` in
/// `0..n`, in any order and on any of its threads, and returns when all have run (kiln-parallel
/// gives candle's worker pool, which is awake right after a backward, where threads started
/// per step would compete with it for the cores).
pub trait ParallelRunner: Send + Sync + std::fmt::Debug {
    /// Runs `job(0) .. job(n - 1)`, all of them before returning.
    fn run(&self, n: usize, job: &(dyn Fn(usize) + Sync));
}

/// Builds an optimizer for a buffer of a given length: what a sharded engine calls once per
/// shard (`kiln_parallel::DataParallel::with_optimizer`). Implement it to plug in an optimizer
/// of your own; [`OptimizerConfig`], [`AdamWConfig`] and [`SgdConfig`] implement it.
pub trait OptimizerFactory: Send + Sync + std::fmt::Debug {
    /// A new optimizer over `len` elements, its state zero and step count 0.
    fn build(&self, len: usize) -> Result<Box<dyn Optimizer>>;
}

impl OptimizerFactory for AdamWConfig {
    fn build(&self, len: usize) -> Result<Box<dyn Optimizer>> {
        Ok(Box::new(AdamW::new(len, *self)?))
    }
}

impl OptimizerFactory for SgdConfig {
    fn build(&self, len: usize) -> Result<Box<dyn Optimizer>> {
        Ok(Box::new(Sgd::new(len, *self)?))
    }
}

/// The optimizers kiln ships, as one configuration value (serde: `{"type": "adamw", "beta2":
/// 0.95, ...}`; omitted fields take the optimizer's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OptimizerConfig {
    /// [`AdamW`].
    #[serde(rename = "adamw")]
    AdamW(AdamWConfig),
    /// [`Sgd`].
    Sgd(SgdConfig),
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::AdamW(AdamWConfig::default())
    }
}

impl OptimizerConfig {
    /// The weight decay the optimizer applies to parameters without an override.
    pub fn weight_decay(&self) -> f64 {
        match self {
            OptimizerConfig::AdamW(c) => c.weight_decay,
            OptimizerConfig::Sgd(c) => c.weight_decay,
        }
    }

    /// Checks the hyperparameters.
    pub fn validate(&self) -> Result<()> {
        match self {
            OptimizerConfig::AdamW(c) => c.validate(),
            OptimizerConfig::Sgd(c) => c.validate(),
        }
    }
}

/// Reads a configuration from JSON (`{"type": "sgd", "momentum": 0.9}`) or a bare name
/// (`adamw`, `sgd`: that optimizer's defaults), for command lines.
impl std::str::FromStr for OptimizerConfig {
    type Err = OptimError;

    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        let json = if t.starts_with('{') {
            t.to_string()
        } else {
            serde_json::json!({ "type": t.to_ascii_lowercase() }).to_string()
        };
        serde_json::from_str(&json).map_err(|e| OptimError::Parse {
            what: "optimizer configuration",
            text: s.to_string(),
            reason: e.to_string(),
        })
    }
}

impl OptimizerFactory for OptimizerConfig {
    fn build(&self, len: usize) -> Result<Box<dyn Optimizer>> {
        match self {
            OptimizerConfig::AdamW(c) => c.build(len),
            OptimizerConfig::Sgd(c) => c.build(len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_reads_with_defaults_and_rejects_unknown_fields() {
        let c: OptimizerConfig =
            serde_json::from_str(r#"{"type": "adamw", "beta2": 0.95}"#).unwrap();
        assert_eq!(
            c,
            OptimizerConfig::AdamW(AdamWConfig {
                beta2: 0.95,
                ..Default::default()
            })
        );
        let c: OptimizerConfig =
            serde_json::from_str(r#"{"type": "sgd", "momentum": 0.9}"#).unwrap();
        assert_eq!(c.build(3).unwrap().name(), "sgd");
        assert!(
            serde_json::from_str::<OptimizerConfig>(r#"{"type": "adamw", "betta": 1}"#).is_err()
        );
        assert!(serde_json::from_str::<OptimizerConfig>(r#"{"type": "lion"}"#).is_err());
        // the command-line form: JSON or a bare name
        assert_eq!(
            "sgd".parse::<OptimizerConfig>().unwrap(),
            OptimizerConfig::Sgd(SgdConfig::default())
        );
        let c: OptimizerConfig = r#"{"type": "adamw", "eps": 1e-3}"#.parse().unwrap();
        assert_eq!(
            c,
            OptimizerConfig::AdamW(AdamWConfig {
                eps: 1e-3,
                ..Default::default()
            })
        );
        let e = "lion".parse::<OptimizerConfig>().unwrap_err().to_string();
        assert!(e.contains("lion") && e.contains("adamw"), "{e}");
    }
}
