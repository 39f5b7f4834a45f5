//! Segmented execution: a model run as a chain of segments, backward one segment at a time, with
//! hooks between segments.
//!
//! candle's `backward()` returns every gradient at the end, with no per-parameter hook while it
//! runs. The [`Executor`] gets the same effect by keeping each segment's input as a fresh leaf
//! `Var` and running backward segment by segment from the top with a seeded backward
//! (`(output * grad_output).sum_all().backward()`): after each segment, its parameter gradients
//! go to a [`GradHook`] (bucketed all-reduce or reduce-scatter overlapping the segments below),
//! and the gradient of its input seeds the segment below. Between segments the executor can also
//! recompute a segment's forward just before its backward (activation recomputation, see
//! [`RecomputePolicy`]) and ask a [`ParamProvider`] for a segment's parameters just before it
//! runs (ZeRO-3 gathers them there and frees them after).
//!
//! Each segment's forward is recorded on a [`Tape`](crate::tape::Tape): where kiln's ops alone
//! make up a segment (a transformer block), its backward runs from the tape, each op's own
//! backward with no zero-filled buffer and addition per graph input; elsewhere candle's.

use crate::batch::MicroBatch;
use crate::error::{BoxError, MemoryError, Result};
use crate::tape::{self, Tape, TapeGrads};
use candle_core::{Tensor, Var};

mod seed;
mod weights;
use seed::seeded;
pub use weights::WeightPass;

/// Why the executor asks for a segment's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The forward pass.
    Forward,
    /// Recomputing a checkpointed segment's forward just before its backward.
    Recompute,
}

/// The parameters a segment runs with, by name.
#[derive(Debug, Clone, Default)]
pub struct SegmentParams {
    vars: Vec<(String, Var)>,
}

impl SegmentParams {
    /// Wraps named variables.
    pub fn new(vars: Vec<(String, Var)>) -> Self {
        Self { vars }
    }

    /// The variable called `name`.
    pub fn get(&self, name: &str) -> candle_core::Result<&Var> {
        self.vars
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("segment parameter {name} not provided"))
            })
    }

    /// The variable called `name`, as a tensor.
    pub fn tensor(&self, name: &str) -> candle_core::Result<&Tensor> {
        self.get(name).map(|v| v.as_tensor())
    }

    /// All named variables, in order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Number of variables.
    pub fn len(&self) -> usize {
        self.vars.len()
    }

    /// True when there is no variable.
    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }
}

/// A model that runs as a chain of segments (embedding, each block, head).
///
/// Segment 0 receives the model input (for a language model, the token ids); segment `i > 0`
/// receives segment `i - 1`'s output. The last segment returns the scalar loss.
pub trait SegmentedModel {
    /// Number of segments (at least 1).
    fn num_segments(&self) -> usize;

    /// Runs segment `i` on `input` with `params` (from the [`ParamProvider`]); the whole
    /// micro-batch `batch` is passed to every segment (segment 0's `input` is its inputs) and
    /// the last one reads what its loss needs (targets, loss mask, named tensors).
    fn forward_segment(
        &self,
        i: usize,
        input: &Tensor,
        batch: &MicroBatch,
        params: &SegmentParams,
    ) -> candle_core::Result<Tensor>;
}

/// Supplies each segment's parameters for one call.
///
/// The plain provider returns the model's own variables; ZeRO-3 all-gathers the segment's shards
/// into fresh variables in [`ParamProvider::acquire`] and drops them in
/// [`ParamProvider::release`].
pub trait ParamProvider {
    /// The parameters segment `segment` runs with now.
    fn acquire(
        &mut self,
        segment: usize,
        phase: Phase,
    ) -> std::result::Result<SegmentParams, BoxError>;

    /// Called when the executor no longer needs the parameters it acquired (after the forward of
    /// a checkpointed segment, or after a segment's backward).
    fn release(
        &mut self,
        segment: usize,
        params: SegmentParams,
    ) -> std::result::Result<(), BoxError> {
        let _ = (segment, params);
        Ok(())
    }
}

/// Receives each segment's parameter gradients as soon as its backward is done, from the last
/// segment to the first. A parameter used by two segments (tied embeddings) is delivered once per
/// segment; the hook adds them (the head's first).
pub trait GradHook {
    /// The gradients of segment `segment`'s parameters, by name (parameters that received no
    /// gradient are absent).
    fn segment_grads(
        &mut self,
        segment: usize,
        grads: Vec<(String, Tensor)>,
    ) -> std::result::Result<(), BoxError>;
}

/// A [`GradHook`] that keeps every gradient, summing repeated names (for tests and simple
/// single-rank training).
#[derive(Debug, Default)]
pub struct CollectGrads {
    grads: Vec<(String, Tensor)>,
}

impl CollectGrads {
    /// The collected gradients, in the order they first arrived.
    pub fn into_grads(self) -> Vec<(String, Tensor)> {
        self.grads
    }

    /// The gradient of `name`, if any arrived.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.grads.iter().find(|(n, _)| n == name).map(|(_, g)| g)
    }
}

impl GradHook for CollectGrads {
    fn segment_grads(
        &mut self,
        _segment: usize,
        grads: Vec<(String, Tensor)>,
    ) -> std::result::Result<(), BoxError> {
        for (name, g) in grads {
            if let Some((_, acc)) = self.grads.iter_mut().find(|(n, _)| *n == name) {
                *acc = acc.add(&g)?;
            } else {
                self.grads.push((name, g));
            }
        }
        Ok(())
    }
}

/// A [`ParamProvider`] handing out fixed variables per segment (the model's own).
#[derive(Debug, Clone)]
pub struct StaticParams {
    per_segment: Vec<SegmentParams>,
}

impl StaticParams {
    /// One [`SegmentParams`] per segment.
    pub fn new(per_segment: Vec<SegmentParams>) -> Self {
        Self { per_segment }
    }
}

impl ParamProvider for StaticParams {
    fn acquire(
        &mut self,
        segment: usize,
        _phase: Phase,
    ) -> std::result::Result<SegmentParams, BoxError> {
        self.per_segment.get(segment).cloned().ok_or_else(|| {
            format!(
                "no parameters for segment {segment} of {}",
                self.per_segment.len()
            )
            .into()
        })
    }
}

/// Which segments drop their activations after forward and recompute them before backward.
/// Written (serde, [`std::fmt::Display`], [`std::str::FromStr`]) as `none`, `every_block`,
/// `every_<k>`, `selective` or `selective_<k>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum RecomputePolicy {
    /// Keep every activation (fastest, most memory).
    #[default]
    None,
    /// Recompute every block (every segment but the first and the last).
    EveryBlock,
    /// Recompute every k-th block (blocks 0, k, 2k, ... counted from the first block).
    EveryKth(usize),
    /// Selective recomputation in every k-th block (`Selective(1)`: every block): the block
    /// keeps the outputs of its products and attention and drops those of its cheap ops (the
    /// LayerNorms, the GELU, the sequence-parallel all-gathers: the ops its forward ran under
    /// [`tape::recomputable`]), which its backward computes again where it needs them
    /// (see [`tape::Thinned`]). Where the segment's tape does not cover it (a GPU, an op
    /// that is not kiln's), the block is recomputed whole instead.
    Selective(usize),
}

impl std::fmt::Display for RecomputePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecomputePolicy::None => f.write_str("none"),
            RecomputePolicy::EveryBlock => f.write_str("every_block"),
            RecomputePolicy::EveryKth(k) => write!(f, "every_{k}"),
            RecomputePolicy::Selective(1) => f.write_str("selective"),
            RecomputePolicy::Selective(k) => write!(f, "selective_{k}"),
        }
    }
}

impl std::str::FromStr for RecomputePolicy {
    type Err = MemoryError;

    /// `none` (also `off`, `false`), `every_block` (also `all`, `on`, `true`, `every_1`) or
    /// `every_<k>` with k at least 1, `selective` (also `selective_1`) or `selective_<k>`; case
    /// and surrounding spaces do not matter.
    fn from_str(s: &str) -> std::result::Result<Self, MemoryError> {
        let t = s.trim().to_ascii_lowercase();
        let bad = || MemoryError::Config {
            field: "activation recomputation",
            message: format!(
                "expected none, every_block, every_<k>, selective or selective_<k> with k >= 1, \
                 got {s:?}"
            ),
        };
        match t.as_str() {
            "none" | "off" | "false" | "" => Ok(RecomputePolicy::None),
            "every_block" | "all" | "true" | "on" => Ok(RecomputePolicy::EveryBlock),
            "selective" => Ok(RecomputePolicy::Selective(1)),
            other => {
                let k = |prefix: &str| {
                    other
                        .strip_prefix(prefix)
                        .and_then(|k| k.parse::<usize>().ok())
                        .filter(|&k| k > 0)
                };
                match (k("every_"), k("selective_")) {
                    (Some(1), _) => Ok(RecomputePolicy::EveryBlock),
                    (Some(k), _) => Ok(RecomputePolicy::EveryKth(k)),
                    (_, Some(k)) => Ok(RecomputePolicy::Selective(k)),
                    _ => Err(bad()),
                }
            }
        }
    }
}

impl TryFrom<String> for RecomputePolicy {
    type Error = MemoryError;

    fn try_from(s: String) -> std::result::Result<Self, MemoryError> {
        s.parse()
    }
}

impl From<RecomputePolicy> for String {
    fn from(p: RecomputePolicy) -> String {
        p.to_string()
    }
}

impl RecomputePolicy {
    /// True when segment `i` of `n` is recomputed whole. The first (embedding) and last (head,
    /// loss) segments are never checkpointed: the first has no differentiable input and the
    /// last is needed right away.
    pub fn recomputes(self, i: usize, n: usize) -> bool {
        if i == 0 || i + 1 >= n {
            return false;
        }
        let block = i - 1;
        match self {
            RecomputePolicy::None | RecomputePolicy::Selective(_) => false,
            RecomputePolicy::EveryBlock => true,
            RecomputePolicy::EveryKth(k) => k > 0 && block % k == 0,
        }
    }

    /// True when segment `i` of `n` drops the outputs of its cheap ops and computes them
    /// again in its backward ([`RecomputePolicy::Selective`]).
    pub fn selects(self, i: usize, n: usize) -> bool {
        match self {
            RecomputePolicy::Selective(k) if i > 0 && i + 1 < n => k > 0 && (i - 1) % k == 0,
            _ => false,
        }
    }

    /// How many of `n_blocks` transformer blocks are checkpointed selectively.
    pub fn selective_blocks(self, n_blocks: u64) -> u64 {
        let n = n_blocks as usize;
        (1..=n).filter(|&i| self.selects(i, n + 2)).count() as u64
    }

    /// How many of `n_blocks` transformer blocks recompute their activations (the blocks
    /// [`RecomputePolicy::recomputes`] picks among the `n_blocks + 2` segments): none, all,
    /// or blocks 0, k, 2k, ... (`ceil(n_blocks / k)`).
    pub fn recomputed_blocks(self, n_blocks: u64) -> u64 {
        let n = n_blocks as usize;
        (1..=n).filter(|&i| self.recomputes(i, n + 2)).count() as u64
    }
}

/// What one forward and backward pass produced.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// The (unscaled) loss, detached.
    pub loss: Tensor,
    /// Segments whose forward ran twice (checkpointed).
    pub recomputed: usize,
    /// Seconds of host time in the forward pass (a recomputation counts as backward; on a GPU
    /// this is launch time unless the device is synchronised).
    pub forward_s: f64,
}

struct Saved {
    /// The segment's input (a fresh leaf `Var` for every segment but the first).
    input: Tensor,
    /// The output with its graph, when the segment is not checkpointed.
    output: Option<Tensor>,
    /// The parameters the kept graph uses.
    params: Option<SegmentParams>,
    /// The kiln ops the kept graph ran, for the backward (see [`crate::tape`]).
    tape: Option<Tape>,
    /// A selectively checkpointed segment's values (see [`RecomputePolicy::Selective`]).
    thinned: Option<tape::Thinned>,
}

/// A segment's gradients: from its tape, or from candle's backward.
enum Grads {
    Tape(TapeGrads),
    Candle(candle_core::backprop::GradStore),
}

impl Grads {
    fn get(&self, t: &Tensor) -> Option<&Tensor> {
        match self {
            Grads::Tape(g) => g.get(t),
            Grads::Candle(g) => g.get(t),
        }
    }
}

/// Runs a [`SegmentedModel`] forward and backward segment by segment.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use kiln_memory::{
///     RecomputePolicy, CollectGrads, Executor, MicroBatch, SegmentParams, SegmentedModel,
///     StaticParams,
/// };
///
/// // loss = sum((x * w0) * w1)
/// struct Chain;
/// impl SegmentedModel for Chain {
///     fn num_segments(&self) -> usize { 2 }
///     fn forward_segment(&self, i: usize, x: &Tensor, _b: &MicroBatch, p: &SegmentParams) -> candle_core::Result<Tensor> {
///         let y = x.broadcast_mul(p.tensor(&format!("w{i}"))?)?;
///         if i == 1 { y.sum_all() } else { Ok(y) }
///     }
/// }
/// let dev = Device::Cpu;
/// let w0 = Var::new(&[2.0f32, 3.0], &dev)?;
/// let w1 = Var::new(&[5.0f32, 7.0], &dev)?;
/// let mut params = StaticParams::new(vec![
///     SegmentParams::new(vec![("w0".into(), w0)]),
///     SegmentParams::new(vec![("w1".into(), w1)]),
/// ]);
/// let x = Tensor::new(&[1.0f32, 1.0], &dev)?;
/// let mut grads = CollectGrads::default();
/// let batch = MicroBatch::new(x.clone(), x)?;
/// let out = Executor::new(RecomputePolicy::None).run(&Chain, &batch, &mut params, &mut grads, 1.0)?;
/// assert_eq!(out.loss.to_scalar::<f32>()?, 2.0 * 5.0 + 3.0 * 7.0);
/// assert_eq!(grads.get("w0").ok_or("no gradient")?.to_vec1::<f32>()?, vec![5.0, 7.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Executor {
    policy: RecomputePolicy,
}

impl Executor {
    /// An executor with the given activation-checkpointing policy.
    pub fn new(policy: RecomputePolicy) -> Self {
        Self { policy }
    }

    /// The checkpointing policy.
    pub fn policy(&self) -> RecomputePolicy {
        self.policy
    }

    /// Runs forward and backward once. Gradients are of `loss * loss_scale` (pass the loss
    /// scaler's scale for mixed precision, 1.0 otherwise); the returned loss is unscaled.
    pub fn run<M: SegmentedModel + ?Sized>(
        &self,
        model: &M,
        batch: &MicroBatch,
        provider: &mut dyn ParamProvider,
        hook: &mut dyn GradHook,
        loss_scale: f64,
    ) -> Result<StepOutput> {
        let n = model.num_segments();
        if n == 0 {
            return Err(MemoryError::Segment {
                segment: 0,
                message: "the model has no segment".into(),
            });
        }
        let forwarded = self.forward(model, 0..n, batch.inputs().clone(), batch, provider)?;
        let loss = forwarded.output.clone();
        let forward_s = forwarded.forward_s;
        let back = self.backward(model, forwarded, None, batch, provider, hook, loss_scale)?;
        Ok(StepOutput {
            loss,
            recomputed: back.recomputed,
            forward_s,
        })
    }

    /// The forward half of [`Executor::run`] over the segments `segments` of `model` (a
    /// pipeline stage runs its own): `input` is the first segment's input (the micro-batch's
    /// inputs for segment 0, the previous stage's output otherwise, which becomes a leaf whose
    /// gradient [`Executor::backward`] returns). What the backward needs is kept in the result
    /// as the recomputation policy says (over the whole model's segment count); its `output` is
    /// the last segment's, detached: the scalar loss when the range ends the model.
    pub fn forward<M: SegmentedModel + ?Sized>(
        &self,
        model: &M,
        segments: std::ops::Range<usize>,
        input: Tensor,
        batch: &MicroBatch,
        provider: &mut dyn ParamProvider,
    ) -> Result<Forwarded> {
        let n = model.num_segments();
        if segments.is_empty() || segments.end > n {
            return Err(MemoryError::Segment {
                segment: segments.start,
                message: format!(
                    "segments {segments:?} are not a non-empty range of the model's {n}"
                ),
            });
        }
        let t_forward = std::time::Instant::now();
        let mut saved: Vec<Saved> = Vec::with_capacity(segments.len());
        let mut x = input;
        for i in segments.clone() {
            let params = provider
                .acquire(i, Phase::Forward)
                .map_err(|source| hook_err("parameter provider", i, source))?;
            let seg_input = if i == 0 {
                x
            } else {
                Var::from_tensor(&x.detach())?.as_tensor().clone()
            };
            let (out, tape) = tape::record(|| model.forward_segment(i, &seg_input, batch, &params));
            let out = out?;
            x = out.detach();
            // a selective segment keeps its table of values (without the graph); where its
            // tape does not cover it, it is recomputed whole
            let (tape, thinned) = if self.policy.selects(i, n) {
                match out.device().is_cpu().then(|| tape.thin(&out)) {
                    Some(Ok(thinned)) => (None, Some(thinned)),
                    _ => (None, None),
                }
            } else {
                (Some(tape), None)
            };
            if let Some(thinned) = thinned {
                drop(out);
                saved.push(Saved {
                    input: seg_input,
                    output: None,
                    params: Some(params),
                    tape: None,
                    thinned: Some(thinned),
                });
            } else if self.policy.recomputes(i, n) || tape.is_none() {
                drop((out, tape));
                provider
                    .release(i, params)
                    .map_err(|source| hook_err("parameter provider", i, source))?;
                saved.push(Saved {
                    input: seg_input,
                    output: None,
                    params: None,
                    tape: None,
                    thinned: None,
                });
            } else {
                saved.push(Saved {
                    input: seg_input,
                    output: Some(out),
                    params: Some(params),
                    tape,
                    thinned: None,
                });
            }
        }
        let forward_s = t_forward.elapsed().as_secs_f64();
        if segments.end == n && x.elem_count() != 1 {
            return Err(MemoryError::Segment {
                segment: n - 1,
                message: format!(
                    "the last segment must return a scalar loss, got shape {:?}",
                    x.dims()
                ),
            });
        }
        Ok(Forwarded {
            saved,
            first: segments.start,
            output: x,
            forward_s,
        })
    }

    /// The backward half of [`Executor::run`] for what [`Executor::forward`] kept: from the
    /// last segment of its range to the first, each segment's parameter gradients to `hook`.
    /// `grad_output` is the gradient of the range's output (from the next pipeline stage), or
    /// `None` when the range ends with the loss, whose gradient is `loss_scale`. Returns the
    /// gradient of the range's input, for the previous stage (none when the range starts at
    /// segment 0).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<M: SegmentedModel + ?Sized>(
        &self,
        model: &M,
        forwarded: Forwarded,
        grad_output: Option<Tensor>,
        batch: &MicroBatch,
        provider: &mut dyn ParamProvider,
        hook: &mut dyn GradHook,
        loss_scale: f64,
    ) -> Result<Backwarded> {
        let (back, _) = self.backward_walk(
            model,
            forwarded,
            grad_output,
            batch,
            provider,
            Some(hook),
            loss_scale,
        )?;
        Ok(back)
    }

    /// [`Executor::backward`] with the parameters' gradients held back: the input gradient
    /// (for the previous pipeline stage) is computed now, and the parameters' by
    /// [`WeightPass::run`] later, which hands them to its hook segment by segment as
    /// [`Executor::backward`] would have, bitwise. Where a segment's backward runs from its
    /// tape, kiln's linear layers compute `dx` now and `dW` in the weight pass
    /// ([`tape::Tape::backward_deferring`]); a selectively recomputed segment, or one that
    /// candle's backward runs, computes every gradient now and only hands them over later.
    /// A zero-bubble pipeline schedule's `BackwardInput` and `BackwardWeight` (Qi et al., 2024).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_deferring<M: SegmentedModel + ?Sized>(
        &self,
        model: &M,
        forwarded: Forwarded,
        grad_output: Option<Tensor>,
        batch: &MicroBatch,
        provider: &mut dyn ParamProvider,
        loss_scale: f64,
    ) -> Result<(Backwarded, WeightPass)> {
        self.backward_walk(
            model,
            forwarded,
            grad_output,
            batch,
            provider,
            None,
            loss_scale,
        )
    }

    /// The walk of [`Executor::backward`] (with `hook`) and [`Executor::backward_deferring`]
    /// (without: the parameters' gradients go to the returned [`WeightPass`]).
    #[allow(clippy::too_many_arguments)]
    fn backward_walk<M: SegmentedModel + ?Sized>(
        &self,
        model: &M,
        forwarded: Forwarded,
        grad_output: Option<Tensor>,
        batch: &MicroBatch,
        provider: &mut dyn ParamProvider,
        mut hook: Option<&mut dyn GradHook>,
        loss_scale: f64,
    ) -> Result<(Backwarded, WeightPass)> {
        let deferring = hook.is_none();
        let mut recomputed = 0;
        let mut weights = WeightPass::default();
        let Forwarded {
            mut saved, first, ..
        } = forwarded;
        let mut grad_out: Option<Tensor> = grad_output;
        while let Some(mut s) = saved.pop() {
            let i = first + saved.len();
            if let Some(thinned) = s.thinned.take() {
                let (Some(params), Some(out)) = (s.params, thinned.output()) else {
                    return Err(MemoryError::Segment {
                        segment: i,
                        message: "the selective segment's output or parameters were not kept"
                            .into(),
                    });
                };
                let root = match grad_out.take() {
                    Some(g) => g,
                    None => Tensor::full(loss_scale as f32, out.shape(), out.device())?
                        .to_dtype(out.dtype())?,
                };
                let grads = Grads::Tape(thinned.backward(root)?);
                grad_out = input_grad(i, &grads, &s.input)?;
                let param_grads = param_grads(&grads, &params);
                drop(grads);
                weights.hand_over(i, param_grads, &mut hook)?;
                provider
                    .release(i, params)
                    .map_err(|source| hook_err("parameter provider", i, source))?;
                continue;
            }
            let (out, params, tape) = match (s.output, s.params, s.tape) {
                (Some(out), Some(params), tape) => (out, params, tape),
                _ => {
                    let params = provider
                        .acquire(i, Phase::Recompute)
                        .map_err(|source| hook_err("parameter provider", i, source))?;
                    recomputed += 1;
                    let (out, tape) =
                        tape::record(|| model.forward_segment(i, &s.input, batch, &params));
                    (out?, params, Some(tape))
                }
            };
            // the segment's own ops where they cover it (on the CPU): no zero-filled buffer
            // and addition per graph input; candle's backward of the graph otherwise. The
            // loss's gradient is the loss scale, as candle's backward of `loss * scale` gives
            let tape = tape.filter(|_| out.device().is_cpu());
            let root = match &grad_out {
                Some(g) => g.clone(),
                None => Tensor::full(loss_scale as f32, out.shape(), out.device())?
                    .to_dtype(out.dtype())?,
            };
            let (taped, held) = match tape {
                Some(tape) if deferring => {
                    let defer = params.vars().iter().map(|(_, v)| v.as_tensor().id());
                    match tape.backward_deferring(&out, root, &defer.collect())? {
                        Some((tg, held)) => (Some(tg), Some(held)),
                        None => (None, None),
                    }
                }
                Some(tape) => (tape.backward(&out, root)?, None),
                None => (None, None),
            };
            let grads = match (taped, grad_out.take()) {
                (Some(tg), _) => Grads::Tape(tg),
                (None, None) if loss_scale == 1.0 => Grads::Candle(out.backward()?),
                (None, None) => Grads::Candle(out.affine(loss_scale, 0.0)?.backward()?),
                (None, Some(g)) => Grads::Candle(seeded(&out, g)?.backward()?),
            };
            drop(out);
            grad_out = input_grad(i, &grads, &s.input)?;
            match held {
                Some(held) => weights.hold(i, held, &params),
                None => {
                    let param_grads = param_grads(&grads, &params);
                    drop(grads);
                    weights.hand_over(i, param_grads, &mut hook)?;
                }
            }
            provider
                .release(i, params)
                .map_err(|source| hook_err("parameter provider", i, source))?;
        }
        Ok((
            Backwarded {
                grad_input: grad_out,
                recomputed,
            },
            weights,
        ))
    }
}

/// What [`Executor::forward`] kept for the backward of its segments, and their output.
pub struct Forwarded {
    saved: Vec<Saved>,
    first: usize,
    /// The last segment's output, detached (the scalar loss when the range ends the model).
    pub output: Tensor,
    /// Seconds of host time in the forward.
    pub forward_s: f64,
}

impl std::fmt::Debug for Forwarded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarded")
            .field("segments", &(self.first..self.first + self.saved.len()))
            .field("output", &self.output.dims())
            .finish()
    }
}

/// What [`Executor::backward`] returns.
#[derive(Debug, Clone)]
pub struct Backwarded {
    /// The gradient of the range's input (`None` when the range starts at segment 0).
    pub grad_input: Option<Tensor>,
    /// Segments whose forward ran again (checkpointed).
    pub recomputed: usize,
}

/// The gradient of segment `i`'s input, for the segment below (none for the first).
fn input_grad(i: usize, grads: &Grads, input: &Tensor) -> Result<Option<Tensor>> {
    if i == 0 {
        return Ok(None);
    }
    Ok(Some(match grads.get(input) {
        Some(g) => g.clone(),
        None => input.zeros_like()?,
    }))
}

/// The gradients of a segment's parameters, by name, in the order the segment lists them.
fn param_grads(grads: &Grads, params: &SegmentParams) -> Vec<(String, Tensor)> {
    params
        .vars()
        .iter()
        .filter_map(|(name, v)| grads.get(v.as_tensor()).map(|g| (name.clone(), g.clone())))
        .collect()
}

fn hook_err(what: &'static str, segment: usize, source: BoxError) -> MemoryError {
    MemoryError::Hook {
        what,
        segment,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recompute_policy_reads_and_writes_its_names() {
        for (text, want) in [
            ("none", RecomputePolicy::None),
            (" Every_Block ", RecomputePolicy::EveryBlock),
            ("every_1", RecomputePolicy::EveryBlock),
            ("every_3", RecomputePolicy::EveryKth(3)),
        ] {
            let got: RecomputePolicy = text.parse().unwrap();
            assert_eq!(got, want, "{text}");
            assert_eq!(got.to_string().parse::<RecomputePolicy>().unwrap(), got);
        }
        for bad in ["every_0", "every_x", "sometimes"] {
            let e = bad.parse::<RecomputePolicy>().unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }
}
