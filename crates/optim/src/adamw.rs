//! [`AdamW`]: PyTorch's `torch.optim.AdamW` on a flat f32 buffer, one fused pass per step.

use crate::error::{check_len, invalid, OptimError, Result};
use crate::groups::{check_overrides, DecayOverride};
use crate::optimizer::{Optimizer, ParallelRunner};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// AdamW hyperparameters, as f64 like PyTorch's Python floats: every per-step constant is
/// computed in f64 and rounded once to f32, as PyTorch does. [`Default`] gives PyTorch's
/// defaults (betas 0.9 and 0.999, eps 1e-8, weight decay 0.01). The learning rate is passed to
/// each step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// Decay of the first moment, in [0, 1).
    pub beta1: f64,
    /// Decay of the second moment, in [0, 1).
    pub beta2: f64,
    /// Added to the denominator, at least 0.
    pub eps: f64,
    /// Decoupled weight decay, at least 0: each step multiplies the parameters by
    /// `1 - lr * weight_decay` before the Adam update.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl AdamWConfig {
    /// Checks every hyperparameter; the error names the first one out of range.
    pub fn validate(&self) -> Result<()> {
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return invalid(name, b, "must be in [0, 1)");
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return invalid("eps", self.eps, "must be finite and at least 0");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return invalid(
                "weight_decay",
                self.weight_decay,
                "must be finite and at least 0",
            );
        }
        Ok(())
    }
}

/// The state of an [`AdamW`] (serde): the step count and the two moment buffers, PyTorch's
/// `step`, `exp_avg` and `exp_avg_sq`. Restoring it with [`AdamW::load_adamw_state`] resumes
/// bitwise. The hyperparameters are not part of it: they come from the run's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdamWState {
    /// Steps taken.
    pub step: u64,
    /// First moment (`exp_avg`).
    pub m: Vec<f32>,
    /// Second moment (`exp_avg_sq`).
    pub v: Vec<f32>,
}

/// The per-step scalars of [`AdamW`], each computed in f64 and rounded once to f32, as
/// PyTorch's `_single_tensor_adam` does with `decoupled_weight_decay=True`. Public so that a
/// kernel elsewhere (kiln-parallel's CUDA step) applies exactly the CPU's constants:
/// [`AdamWConfig::step_consts`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepConsts {
    /// `1 - lr * weight_decay` (`param.mul_(1 - lr * weight_decay)`).
    pub decay: f32,
    /// `1 - beta1`, the weight of `exp_avg.lerp_(grad, 1 - beta1)`.
    pub lerp_w: f32,
    /// `1 - lerp_w` in f32, for lerp's large-weight branch.
    pub lerp_w_comp: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2` (`addcmul_(grad, grad, value=1 - beta2)`).
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// `-lr / (1 - beta1^t)` (`param.addcdiv_(exp_avg, denom, value=-step_size)`).
    pub neg_step_size: f32,
}

impl AdamWConfig {
    /// The constants of optimizer step `step` (1 for the first) at learning rate `lr` for
    /// elements whose weight decay is `weight_decay`.
    pub fn step_consts(&self, weight_decay: f64, lr: f32, step: u64) -> StepConsts {
        StepConsts::new(self, weight_decay, lr, step)
    }
}

impl StepConsts {
    /// Whether lerp takes its small-weight branch (`m + w (g - m)`, for `|w| < 0.5`) rather
    /// than `g - (g - m)(1 - w)`.
    pub fn small_weight(&self) -> bool {
        self.lerp_w.abs() < 0.5
    }

    fn new(cfg: &AdamWConfig, weight_decay: f64, lr: f32, step: u64) -> Self {
        let lr = lr as f64;
        // PyTorch computes `beta ** step` with a float step: powf, not repeated products
        let t = step as f64;
        let bc1 = 1.0 - cfg.beta1.powf(t);
        let bc2 = 1.0 - cfg.beta2.powf(t);
        let lerp_w = (1.0 - cfg.beta1) as f32;
        StepConsts {
            decay: (1.0 - lr * weight_decay) as f32,
            lerp_w,
            lerp_w_comp: 1.0 - lerp_w,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            // `bias_correction2 ** 0.5`, as PyTorch writes it
            bc2_sqrt: bc2.powf(0.5) as f32,
            eps: cfg.eps as f32,
            neg_step_size: (-(lr / bc1)) as f32,
        }
    }
}

/// Elements per block handed to the vectorised kernel.
const BLOCK: usize = 4096;

/// The fused update of one block: reads p, g, m, v once and writes p, m, v once. The operations
/// and their order are PyTorch's, element by element:
///
/// ```text
/// p = p * decay
/// m = lerp(m, g, 1 - beta1)          // m + w (g - m) for w < 0.5, else g - (g - m)(1 - w)
/// v = v * beta2 + (1 - beta2) * g * g
/// p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)
/// ```
///
/// The loop has no bounds checks (zipped iterators) and no fused multiply-add, so it
/// vectorises and gives the same bits at every position of the buffer and on every machine:
/// any shard of the buffer computes bitwise what the whole buffer does. (PyTorch's CPU build
/// fuses the `lerp_` and, on its scalar path, the `addcmul_` into multiply-adds, so its
/// moments can differ from these in the last bit or two.)
#[inline(always)]
fn adamw_block<const SMALL_W: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: StepConsts,
) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let pd = *p * c.decay;
        let mn = if SMALL_W {
            *m + c.lerp_w * (g - *m)
        } else {
            g - (g - *m) * c.lerp_w_comp
        };
        let vn = *v * c.beta2 + c.one_minus_beta2 * g * g;
        let denom = vn.sqrt() / c.bc2_sqrt + c.eps;
        *p = pd + (c.neg_step_size * mn) / denom;
        *m = mn;
        *v = vn;
    }
}

fn adamw_range(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: StepConsts) {
    let small = c.small_weight();
    let blocks = p
        .chunks_mut(BLOCK)
        .zip(g.chunks(BLOCK))
        .zip(m.chunks_mut(BLOCK))
        .zip(v.chunks_mut(BLOCK));
    for (((p, g), m), v) in blocks {
        if small {
            adamw_block::<true>(p, g, m, v, c);
        } else {
            adamw_block::<false>(p, g, m, v, c);
        }
    }
}

/// Buffers shorter than this run on the calling thread whatever [`AdamW::set_threads`] says.
pub const PARALLEL_MIN_LEN: usize = 1 << 18;

/// AdamW (Loshchilov and Hutter), matching `torch.optim.AdamW` (no amsgrad, no maximize):
/// decoupled weight decay, then the Adam update with bias correction, in PyTorch's order of
/// operations, with its per-step constants rounded as PyTorch rounds them. Against numbers
/// recorded from PyTorch 2.15 the parameters agree to 1e-6 relative (the moments to a few
/// ulps: PyTorch fuses some multiply-adds, see the kernel's notes); the learning rate is an
/// f32, so PyTorch's f64 learning rate must be f32-representable for a bit-level comparison. It owns its moment buffers and step count, for a buffer of fixed length: the
/// whole flat parameter buffer, or one rank's shard of it (bitwise the same values).
///
/// ```
/// use kiln_optim::{AdamW, AdamWConfig, Optimizer};
///
/// let mut opt = AdamW::new(2, AdamWConfig { weight_decay: 0.0, ..Default::default() })?;
/// let mut params = [1.0f32, -1.0];
/// opt.step(&mut params, &[0.5, -2.0], 0.1)?;
/// // the first step moves each parameter by lr * sign(grad) (up to eps)
/// assert!((params[0] - 0.9).abs() < 1e-6 && (params[1] + 0.9).abs() < 1e-6);
/// assert_eq!(opt.step_count(), 1);
/// # Ok::<(), kiln_optim::OptimError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    config: AdamWConfig,
    step: u64,
    m: Vec<f32>,
    v: Vec<f32>,
    threads: usize,
    runner: Runner,
    decay_overrides: Vec<DecayOverride>,
}

/// The pool a step runs on, if any: how the work is spread, not part of the optimizer's value
/// (equal whatever it holds).
#[derive(Debug, Clone, Default)]
struct Runner(Option<Arc<dyn ParallelRunner>>);

impl PartialEq for Runner {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Elements of one job of a step on a [`ParallelRunner`] (a whole number of blocks).
const RUNNER_PART: usize = 1 << 16;

impl AdamW {
    /// An optimizer for `len` parameters, moments zero, step count 0.
    pub fn new(len: usize, config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        Ok(AdamW {
            config,
            step: 0,
            m: vec![0.0; len],
            v: vec![0.0; len],
            threads: 1,
            runner: Runner::default(),
            decay_overrides: Vec::new(),
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Changes the hyperparameters from the next step on (a weight-decay schedule, say).
    pub fn set_config(&mut self, config: AdamWConfig) -> Result<()> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// Splits each step of a buffer of at least [`PARALLEL_MIN_LEN`] elements over `threads`
    /// scoped threads (1, the default, runs on the caller's thread). The result does not depend
    /// on it, bit for bit.
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }

    /// The weight-decay overrides (see [`Optimizer::set_decay_overrides`]).
    pub fn decay_overrides(&self) -> &[DecayOverride] {
        &self.decay_overrides
    }

    /// Splits each step of a buffer of at least [`PARALLEL_MIN_LEN`] elements into jobs on
    /// `runner` (see [`Optimizer::set_runner`]); it takes the place of
    /// [`AdamW::set_threads`]' threads while set. The result does not depend on it, bit for bit.
    pub fn set_runner(&mut self, runner: Option<Arc<dyn ParallelRunner>>) {
        self.runner = Runner(runner);
    }

    /// Runs the kernel over `range`, on the runner or split over the configured threads when
    /// it is large.
    fn update_range(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        c: StepConsts,
    ) {
        let (p, g) = (&mut params[range.clone()], &grads[range.clone()]);
        let (m, v) = (&mut self.m[range.clone()], &mut self.v[range.clone()]);
        let n = p.len();
        if let (Some(runner), true) = (&self.runner.0, n >= PARALLEL_MIN_LEN) {
            // jobs of whole blocks, each taking its slices once
            let jobs: Vec<_> = p
                .chunks_mut(RUNNER_PART)
                .zip(g.chunks(RUNNER_PART))
                .zip(m.chunks_mut(RUNNER_PART))
                .zip(v.chunks_mut(RUNNER_PART))
                .map(|job| Mutex::new(Some(job)))
                .collect();
            let run = |i: usize| {
                let job = jobs[i].lock().ok().and_then(|mut j| j.take());
                if let Some((((p, g), m), v)) = job {
                    adamw_range(p, g, m, v, c);
                }
            };
            runner.run(jobs.len(), &run);
            // a job the runner left (none, unless it failed) runs here
            (0..jobs.len()).for_each(run);
            return;
        }
        if self.threads == 1 || n < PARALLEL_MIN_LEN {
            adamw_range(p, g, m, v, c);
            return;
        }
        // contiguous parts, each a whole number of blocks
        let part = n.div_ceil(self.threads).div_ceil(BLOCK) * BLOCK;
        std::thread::scope(|s| {
            let parts = p
                .chunks_mut(part)
                .zip(g.chunks(part))
                .zip(m.chunks_mut(part))
                .zip(v.chunks_mut(part));
            for (((p, g), m), v) in parts {
                s.spawn(move || adamw_range(p, g, m, v, c));
            }
        });
    }

    /// The first moment (`exp_avg`).
    pub fn exp_avg(&self) -> &[f32] {
        &self.m
    }

    /// The second moment (`exp_avg_sq`).
    pub fn exp_avg_sq(&self) -> &[f32] {
        &self.v
    }

    /// Both moments, writable: `(exp_avg, exp_avg_sq)`.
    pub fn moments_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        (&mut self.m, &mut self.v)
    }

    /// A copy of the state, for a checkpoint.
    pub fn adamw_state(&self) -> AdamWState {
        AdamWState {
            step: self.step,
            m: self.m.clone(),
            v: self.v.clone(),
        }
    }

    /// Restores a state taken with [`AdamW::adamw_state`] from an optimizer of the same length;
    /// resumes bitwise.
    pub fn load_adamw_state(&mut self, state: AdamWState) -> Result<()> {
        check_len("adamw load_state", "m", self.m.len(), state.m.len())?;
        check_len("adamw load_state", "v", self.v.len(), state.v.len())?;
        self.step = state.step;
        self.m = state.m;
        self.v = state.v;
        Ok(())
    }
}

impl Optimizer for AdamW {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn set_threads(&mut self, threads: usize) {
        AdamW::set_threads(self, threads);
    }

    fn set_runner(&mut self, runner: Option<Arc<dyn ParallelRunner>>) {
        AdamW::set_runner(self, runner);
    }

    fn set_decay_overrides(&mut self, overrides: Vec<DecayOverride>) -> Result<()> {
        check_overrides(&overrides, self.m.len())?;
        self.decay_overrides = overrides;
        Ok(())
    }

    fn len(&self) -> usize {
        self.m.len()
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()> {
        check_len("adamw step", "params", self.m.len(), params.len())?;
        check_len("adamw step", "grads", self.m.len(), grads.len())?;
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(OptimError::InvalidHyperparameter {
                name: "lr",
                value: lr as f64,
                reason: "must be finite and at least 0",
            });
        }
        self.step += 1;
        let (cfg, step) = (self.config, self.step);
        let consts = |wd: f64| StepConsts::new(&cfg, wd, lr, step);
        let overrides = std::mem::take(&mut self.decay_overrides);
        let mut done = 0;
        for o in &overrides {
            if o.range.start > done {
                self.update_range(done..o.range.start, params, grads, consts(cfg.weight_decay));
            }
            self.update_range(o.range.clone(), params, grads, consts(o.weight_decay));
            done = o.range.end;
        }
        if done < params.len() {
            self.update_range(done..params.len(), params, grads, consts(cfg.weight_decay));
        }
        self.decay_overrides = overrides;
        Ok(())
    }

    fn state_buffers(&self) -> Vec<(&'static str, &[f32])> {
        vec![("exp_avg", &self.m), ("exp_avg_sq", &self.v)]
    }

    fn state_buffers_mut(&mut self) -> Vec<(&'static str, &mut [f32])> {
        vec![("exp_avg", &mut self.m), ("exp_avg_sq", &mut self.v)]
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
/// AdamW as a kiln-state component, in PyTorch's terms: tensors `exp_avg` and `exp_avg_sq`
/// (this optimizer's flat buffers) and metadata `step` and `config`. Loading checks the lengths
/// and takes the step count and moments; the hyperparameters stay this optimizer's. An engine
/// that shards parameters saves the moments per parameter instead (kiln-parallel).
impl kiln_state::Stateful for AdamW {
    fn state(&self) -> kiln_state::Result<kiln_state::StateDict> {
        let mut sd = kiln_state::StateDict::new();
        sd.put("exp_avg", &[self.m.len()], &self.m)?;
        sd.put("exp_avg_sq", &[self.v.len()], &self.v)?;
        sd.set_meta("step", self.step)?;
        sd.set_meta("config", self.config)?;
        Ok(sd)
    }

    fn load_state(&mut self, state: kiln_state::StateDict) -> kiln_state::Result<()> {
        let n = self.m.len();
        let s = AdamWState {
            step: state.meta("step")?,
            m: state.get_shaped("exp_avg", &[n])?,
            v: state.get_shaped("exp_avg_sq", &[n])?,
        };
        self.load_adamw_state(s)
            .map_err(|e| kiln_state::StateError::component("adamw", e))
    }
}
