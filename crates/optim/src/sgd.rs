//! [`Sgd`]: PyTorch's `torch.optim.SGD` (momentum, dampening, Nesterov, L2 weight decay) on a
//! flat f32 buffer.

use crate::error::{check_len, invalid, OptimError, Result};
use crate::groups::{check_overrides, DecayOverride};
use crate::optimizer::Optimizer;
use serde::{Deserialize, Serialize};

/// SGD hyperparameters; [`Default`] gives PyTorch's (no momentum, no dampening, no Nesterov,
/// no weight decay). The learning rate is passed to each step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SgdConfig {
    /// Momentum factor, at least 0 (0: no momentum buffer is kept).
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum, at least 0.
    pub dampening: f64,
    /// Nesterov momentum (needs momentum above 0 and no dampening, as in PyTorch).
    pub nesterov: bool,
    /// L2 weight decay, at least 0: `weight_decay * param` is added to the gradient (coupled,
    /// as `torch.optim.SGD` does; AdamW's decay is decoupled).
    pub weight_decay: f64,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }
}

impl SgdConfig {
    /// Checks every hyperparameter; the error names the first one out of range.
    pub fn validate(&self) -> Result<()> {
        for (name, x) in [
            ("momentum", self.momentum),
            ("dampening", self.dampening),
            ("weight_decay", self.weight_decay),
        ] {
            if !(x.is_finite() && x >= 0.0) {
                return invalid(name, x, "must be finite and at least 0");
            }
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return invalid(
                "momentum",
                self.momentum,
                "Nesterov momentum requires momentum > 0 and dampening 0",
            );
        }
        Ok(())
    }
}

/// Stochastic gradient descent as `torch.optim.SGD` computes it (`_single_tensor_sgd`, no
/// `maximize`), in f32 with each constant rounded once from f64:
///
/// ```text
/// g = grad + weight_decay * param
/// buf = g                                   (first step)
/// buf = momentum * buf + (1 - dampening) * g (later steps)
/// g = g + momentum * buf  (Nesterov)  or  g = buf
/// param = param - lr * g
/// ```
///
/// Element-wise, so a shard computes bitwise what the whole buffer does. Its one state buffer
/// is `momentum_buffer` (PyTorch's name), kept only when momentum is above 0.
///
/// ```
/// use kiln_optim::{Optimizer, Sgd, SgdConfig};
///
/// let mut opt = Sgd::new(1, SgdConfig { momentum: 0.5, ..Default::default() })?;
/// let mut p = [1.0f32];
/// opt.step(&mut p, &[1.0], 0.1)?; // buf = 1, p = 1 - 0.1
/// opt.step(&mut p, &[1.0], 0.1)?; // buf = 0.5 + 1, p = 0.9 - 0.15
/// assert!((p[0] - 0.75).abs() < 1e-6);
/// # Ok::<(), kiln_optim::OptimError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Sgd {
    config: SgdConfig,
    len: usize,
    step: u64,
    buf: Vec<f32>,
    decay_overrides: Vec<DecayOverride>,
}

impl Sgd {
    /// An optimizer for `len` parameters, momentum buffer zero, step count 0.
    pub fn new(len: usize, config: SgdConfig) -> Result<Self> {
        config.validate()?;
        let buf = if config.momentum > 0.0 {
            vec![0.0; len]
        } else {
            Vec::new()
        };
        Ok(Sgd {
            config,
            len,
            step: 0,
            buf,
            decay_overrides: Vec::new(),
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The momentum buffer (empty without momentum).
    pub fn momentum_buffer(&self) -> &[f32] {
        &self.buf
    }

    fn update(&mut self, range: std::ops::Range<usize>, p: &mut [f32], g: &[f32], c: SgdConsts) {
        let (p, g) = (&mut p[range.clone()], &g[range.clone()]);
        if self.buf.is_empty() {
            for (p, &g) in p.iter_mut().zip(g) {
                let g = g + c.wd * *p;
                *p += c.neg_lr * g;
            }
            return;
        }
        let buf = &mut self.buf[range];
        for ((p, &g), b) in p.iter_mut().zip(g).zip(buf) {
            let g = g + c.wd * *p;
            *b = if c.first {
                g
            } else {
                c.momentum * *b + c.keep * g
            };
            let d = if c.nesterov { g + c.momentum * *b } else { *b };
            *p += c.neg_lr * d;
        }
    }
}

/// One step's constants, each rounded once to f32.
#[derive(Debug, Clone, Copy)]
struct SgdConsts {
    wd: f32,
    momentum: f32,
    keep: f32,
    nesterov: bool,
    neg_lr: f32,
    first: bool,
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        "sgd"
    }

    fn len(&self) -> usize {
        self.len
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    fn set_decay_overrides(&mut self, overrides: Vec<DecayOverride>) -> Result<()> {
        check_overrides(&overrides, self.len)?;
        self.decay_overrides = overrides;
        Ok(())
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()> {
        check_len("sgd step", "params", self.len, params.len())?;
        check_len("sgd step", "grads", self.len, grads.len())?;
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(OptimError::InvalidHyperparameter {
                name: "lr",
                value: lr as f64,
                reason: "must be finite and at least 0",
            });
        }
        let (cfg, first) = (self.config, self.step == 0);
        let consts = |wd: f64| SgdConsts {
            wd: wd as f32,
            momentum: cfg.momentum as f32,
            keep: (1.0 - cfg.dampening) as f32,
            nesterov: cfg.nesterov,
            neg_lr: -lr,
            first,
        };
        // taken out for the loop and put back: no copy of the list per step
        let (base, overrides) = (
            consts(cfg.weight_decay),
            std::mem::take(&mut self.decay_overrides),
        );
        let mut done = 0;
        for o in &overrides {
            if o.range.start > done {
                self.update(done..o.range.start, params, grads, base);
            }
            self.update(o.range.clone(), params, grads, consts(o.weight_decay));
            done = o.range.end;
        }
        if done < params.len() {
            self.update(done..params.len(), params, grads, base);
        }
        self.decay_overrides = overrides;
        self.step += 1;
        Ok(())
    }

    fn state_buffers(&self) -> Vec<(&'static str, &[f32])> {
        if self.buf.is_empty() {
            Vec::new()
        } else {
            vec![("momentum_buffer", &self.buf)]
        }
    }

    fn state_buffers_mut(&mut self) -> Vec<(&'static str, &mut [f32])> {
        if self.buf.is_empty() {
            Vec::new()
        } else {
            vec![("momentum_buffer", &mut self.buf)]
        }
    }
}

/// SGD as a kiln-state component: tensor `momentum_buffer` (when momentum is on) and metadata
/// `step` and `config`.
impl kiln_state::Stateful for Sgd {
    fn state(&self) -> kiln_state::Result<kiln_state::StateDict> {
        let mut sd = kiln_state::StateDict::new();
        if !self.buf.is_empty() {
            sd.put("momentum_buffer", &[self.buf.len()], &self.buf)?;
        }
        sd.set_meta("step", self.step)?;
        sd.set_meta("config", self.config)?;
        Ok(sd)
    }

    fn load_state(&mut self, state: kiln_state::StateDict) -> kiln_state::Result<()> {
        if !self.buf.is_empty() {
            self.buf = state.get_shaped("momentum_buffer", &[self.len])?;
        }
        self.step = state.meta("step")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The update in f64, for comparison.
    fn reference(cfg: SgdConfig, p0: &[f64], grads: &[Vec<f64>], lr: f64) -> Vec<f64> {
        let mut p = p0.to_vec();
        let mut buf = vec![0.0; p.len()];
        for (t, g) in grads.iter().enumerate() {
            for i in 0..p.len() {
                let gi = g[i] + cfg.weight_decay * p[i];
                let d = if cfg.momentum > 0.0 {
                    buf[i] = if t == 0 {
                        gi
                    } else {
                        cfg.momentum * buf[i] + (1.0 - cfg.dampening) * gi
                    };
                    if cfg.nesterov {
                        gi + cfg.momentum * buf[i]
                    } else {
                        buf[i]
                    }
                } else {
                    gi
                };
                p[i] -= lr * d;
            }
        }
        p
    }

    #[test]
    fn matches_the_f64_reference_and_shards_bitwise() {
        let n = 37;
        let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let grads: Vec<Vec<f32>> = (0..5)
            .map(|t| (0..n).map(|i| ((i * 7 + t) as f32 * 0.11).cos()).collect())
            .collect();
        for cfg in [
            SgdConfig::default(),
            SgdConfig {
                momentum: 0.9,
                weight_decay: 0.01,
                ..Default::default()
            },
            SgdConfig {
                momentum: 0.9,
                dampening: 0.1,
                ..Default::default()
            },
            SgdConfig {
                momentum: 0.8,
                nesterov: true,
                weight_decay: 0.05,
                ..Default::default()
            },
        ] {
            let mut whole = Sgd::new(n, cfg).unwrap();
            let mut p = p0.clone();
            for g in &grads {
                whole.step(&mut p, g, 0.05).unwrap();
            }
            let p64: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
            let g64: Vec<Vec<f64>> = grads
                .iter()
                .map(|g| g.iter().map(|&x| x as f64).collect())
                .collect();
            let want = reference(cfg, &p64, &g64, 0.05);
            for (a, b) in p.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "{cfg:?}: {a} vs {b}");
            }
            // two shards give bitwise the same parameters
            let mut q = p0.clone();
            let (lo, hi) = q.split_at_mut(20);
            let (mut s0, mut s1) = (Sgd::new(20, cfg).unwrap(), Sgd::new(n - 20, cfg).unwrap());
            for g in &grads {
                s0.step(lo, &g[..20], 0.05).unwrap();
                s1.step(hi, &g[20..], 0.05).unwrap();
            }
            assert_eq!(p, q);
        }
    }

    #[test]
    fn bad_hyperparameters_are_named() {
        let e = Sgd::new(
            1,
            SgdConfig {
                nesterov: true,
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("Nesterov"), "{e}");
        let e = Sgd::new(
            1,
            SgdConfig {
                momentum: -1.0,
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("momentum"), "{e}");
        let mut o = Sgd::new(2, SgdConfig::default()).unwrap();
        assert!(o.step(&mut [0.0; 2], &[0.0; 3], 0.1).is_err());
        assert!(o.step(&mut [0.0; 2], &[0.0; 2], f32::NAN).is_err());
    }

    #[test]
    fn state_round_trips_bitwise() {
        use kiln_state::Stateful;
        let cfg = SgdConfig {
            momentum: 0.9,
            ..Default::default()
        };
        let mut a = Sgd::new(3, cfg).unwrap();
        let mut p = [1.0f32, 2.0, 3.0];
        a.step(&mut p, &[0.1, 0.2, 0.3], 0.1).unwrap();
        let mut b = Sgd::new(3, cfg).unwrap();
        b.load_state(a.state().unwrap()).unwrap();
        let mut q = p;
        a.step(&mut p, &[0.3, 0.2, 0.1], 0.1).unwrap();
        b.step(&mut q, &[0.3, 0.2, 0.1], 0.1).unwrap();
        assert_eq!(p, q);
        assert_eq!(b.step_count(), 2);
    }
}
