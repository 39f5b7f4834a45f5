//! One pipeline stage's side of the engine: the micro-batches' forwards and backwards driven
//! from outside (by a pipeline schedule), their gradients accumulated locally in micro-batch
//! order, then the tied embedding's copies summed over the embedding group, one reduction over
//! the data-parallel group, and the usual end of a step (found-inf agreed over the world, the
//! global norm over every stage, the last stage's loss broadcast).
//!
//! A parameter that two segments of one stage read (the tied embedding when the model is not
//! split) accumulates the later-listed segments' contributions apart and adds them once at the
//! end, so that one stage gives bitwise what the first and the last stage of a split pipeline
//! give after summing their copies (Megatron-LM's embedding group).

use super::super::config::StepPreview;
use super::super::hooks::GradSink;
use super::super::hooks::Provider;
use super::DataParallel;
use crate::error::{ParallelError, Result};
use crate::flat::{tensor_into_slice, FlatLayout};
use candle_core::Tensor;
use kiln_comm::{CommExt, Communicator, ReduceOp};
use kiln_memory::{
    BoxError, Executor, Forwarded, GradHook, MicroBatch, SegmentedModel, WeightPass,
};
use kiln_precision::LossScaler;
use kiln_state::ZeroStage;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an engine knows of the pipeline its stage belongs to.
pub(crate) struct PipelineLink {
    /// The pipeline group (group rank = stage).
    pub(crate) comm: Arc<dyn Communicator>,
    /// The first and the last stage's group, on those two stages when there are several.
    embedding: Option<Arc<dyn Communicator>>,
    /// Per parameter: a tied copy the global norm leaves out (the last stage's embedding).
    pub(crate) norm_skip: Vec<bool>,
    /// The parameters whose gradients are summed over the embedding group.
    tied: Vec<usize>,
    /// Per parameter: the first segment that lists it.
    owner: Vec<usize>,
    /// The step in progress.
    step: Option<Accum>,
    /// The last schedule run's trace.
    pub(super) trace: Option<super::schedule_run::PipelineTrace>,
}

/// One step's accumulation state.
struct Accum {
    /// Per parameter: whether this step's first contribution has arrived.
    seen: Vec<bool>,
    /// Per parameter: the contributions of segments other than its owner, summed apart.
    side: Vec<Option<Vec<f32>>>,
    scale: f32,
    t0: Instant,
    forward_s: f64,
    loss_sum: f64,
    losses: usize,
}

/// The weight gradients of a backward whose input gradient went ahead (a zero-bubble
/// schedule's `BackwardInput`), to be computed and accumulated by
/// [`DataParallel::pipeline_weight_grads`] (its `BackwardWeight`).
#[derive(Debug, Default)]
pub struct DeferredGrads {
    passes: Vec<WeightPass>,
}

impl DeferredGrads {
    /// Segments whose weight gradients are still to compute (kiln's linear layers on the CPU
    /// compute `dW` in the weight pass; other segments only hand theirs over).
    pub fn to_compute(&self) -> usize {
        self.passes.iter().map(WeightPass::to_compute).sum()
    }
}

/// The loss the last stage computed, on every stage.
pub(super) fn last_stage_loss(pp: &dyn Communicator, loss: f32) -> Result<f32> {
    let mut v = [loss];
    pp.broadcast(&mut v, pp.world_size() - 1)?;
    Ok(v[0])
}

/// Writes gradients into the stage's full unit buffers: a parameter's first contribution of
/// the step overwrites, the next ones of its owner segment add, other segments' go apart.
struct Accumulate<'a> {
    layout: &'a FlatLayout,
    grads: &'a mut [Vec<f32>],
    owner: &'a [usize],
    step: &'a mut Accum,
}

impl GradHook for Accumulate<'_> {
    fn segment_grads(
        &mut self,
        segment: usize,
        grads: Vec<(String, Tensor)>,
    ) -> std::result::Result<(), BoxError> {
        for (name, g) in grads {
            let p = self
                .layout
                .index(&name)
                .ok_or_else(|| format!("gradient for unknown parameter {name}"))?;
            let slot = &self.layout.params()[p];
            if segment != self.owner[p] {
                let side = &mut self.step.side[p];
                let fresh = side.is_none();
                let buf = side.get_or_insert_with(|| vec![0.0; slot.numel]);
                tensor_into_slice(&g, buf, !fresh, &name)?;
                continue;
            }
            let fresh = !self.step.seen[p];
            self.step.seen[p] = true;
            let buf = &mut self.grads[slot.unit][slot.offset..slot.offset + slot.numel];
            tensor_into_slice(&g, buf, !fresh, &name)?;
        }
        Ok(())
    }
}

impl DataParallel {
    /// Makes this engine one stage of a pipeline: `pp` is the pipeline group (group rank =
    /// stage, as [`crate::Groups::pp`]), `embedding` the first and the last stage's group
    /// ([`crate::Groups::embedding`]) and `tied` the parameters both of them hold (the
    /// embedding a tied head reads): their gradients are summed over that group before the
    /// data-parallel reduction, and the last stage's copy is left out of the global norm.
    /// Drive each step with [`DataParallel::pipeline_begin`], the stage's forwards and
    /// backwards in schedule order, and [`DataParallel::pipeline_finish`]. ZeRO stages 0 to
    /// 2; a one-stage pipeline (`pp` of one rank) is the reference a split one equals.
    pub fn with_pipeline(
        mut self,
        pp: Arc<dyn Communicator>,
        embedding: Option<Arc<dyn Communicator>>,
        tied: &[&str],
    ) -> Result<Self> {
        if self.cfg.stage == ZeroStage::Zero3 {
            return Err(ParallelError::Config(
                "pipeline stages run ZeRO stages 0 to 2: ZeRO-3 gathers every segment's \
                 parameters per micro-batch, which a pipeline schedule does not drive yet"
                    .into(),
            ));
        }
        let n = self.layout.params().len();
        let mut owner = vec![usize::MAX; n];
        for s in 0..self.layout.num_segments() {
            for &p in self.layout.segment_params(s) {
                owner[p] = owner[p].min(s);
            }
        }
        let (stage, stages) = (pp.rank(), pp.world_size());
        let mut tied_ids = Vec::new();
        if embedding.is_some() {
            for name in tied {
                let p = self.layout.index(name).ok_or_else(|| {
                    ParallelError::Config(format!(
                        "stage {stage} of {stages} is in the embedding group but holds no \
                         parameter {name}"
                    ))
                })?;
                tied_ids.push(p);
            }
        }
        let mut norm_skip = vec![false; n];
        if stages > 1 && stage + 1 == stages {
            for &p in &tied_ids {
                norm_skip[p] = true;
            }
        }
        self.pipeline = Some(PipelineLink {
            comm: pp,
            embedding,
            norm_skip,
            tied: tied_ids,
            owner,
            step: None,
            trace: None,
        });
        Ok(self)
    }

    /// The pipeline stage of this engine and the number of stages (`(0, 1)` without one).
    pub fn pipeline_dims(&self) -> (usize, usize) {
        self.pipeline
            .as_ref()
            .map_or((0, 1), |p| (p.comm.rank(), p.comm.world_size()))
    }

    /// Starts a pipelined step: the scaler's scale is the one every backward of the step uses.
    pub fn pipeline_begin(&mut self, scaler: &dyn LossScaler) -> Result<()> {
        if self.pending.is_some() {
            return Err(ParallelError::Config(
                "pipeline_begin called before apply or discard of the previous step".into(),
            ));
        }
        let n = self.layout.params().len();
        let units: Vec<usize> = self.layout.units().iter().map(|u| u.len).collect();
        let grads = &mut self.grads;
        let pool = &mut self.pool;
        let link = self.pipeline.as_mut().ok_or_else(|| {
            ParallelError::Config("pipeline_begin needs with_pipeline first".into())
        })?;
        if link.step.is_some() {
            return Err(ParallelError::Config(
                "pipeline_begin called twice without pipeline_finish".into(),
            ));
        }
        // every unit's full buffer for the whole step (ZeRO-2 reduce-scatters it at the end)
        if grads.len() < units.len() {
            grads.resize_with(units.len(), Vec::new);
        }
        for (g, &len) in grads.iter_mut().zip(&units) {
            if g.len() != len {
                let mut b = pool.pop().unwrap_or_default();
                b.clear();
                b.resize(len, 0.0);
                *g = b;
            }
        }
        link.step = Some(Accum {
            seen: vec![false; n],
            side: vec![None; n],
            scale: scaler.scale(),
            t0: Instant::now(),
            forward_s: 0.0,
            loss_sum: 0.0,
            losses: 0,
        });
        Ok(())
    }

    fn step_state(&mut self, what: &str) -> Result<&mut Accum> {
        self.pipeline
            .as_mut()
            .and_then(|l| l.step.as_mut())
            .ok_or_else(|| ParallelError::Config(format!("{what} outside pipeline_begin/finish")))
    }

    /// The forward of `segments` (this stage's, or one of its chunks) for one micro-batch:
    /// `input` is the micro-batch's inputs on the first stage and the previous stage's output
    /// otherwise. Returns what the backward needs; its `output` goes to the next stage (or is
    /// the loss, which the step's report averages).
    pub fn pipeline_forward<M: SegmentedModel + ?Sized>(
        &mut self,
        model: &M,
        segments: Range<usize>,
        input: Tensor,
        batch: &MicroBatch,
    ) -> Result<Forwarded> {
        let last = segments.end == model.num_segments();
        self.step_state("pipeline_forward")?;
        let mut provider = Provider {
            layout: &self.layout,
            vars: &self.vars,
            master: &self.master,
            comm: &*self.comm,
            stage: self.cfg.stage,
            device: &self.device,
        };
        let out = Executor::new(self.cfg.recompute).forward(
            model,
            segments,
            input,
            batch,
            &mut provider,
        )?;
        let loss = if last {
            Some(
                out.output
                    .to_dtype(candle_core::DType::F64)?
                    .to_scalar::<f64>()?,
            )
        } else {
            None
        };
        let step = self.step_state("pipeline_forward")?;
        step.forward_s += out.forward_s;
        if let Some(l) = loss {
            step.loss_sum += l;
            step.losses += 1;
        }
        Ok(out)
    }

    /// The backward of what [`DataParallel::pipeline_forward`] kept, given the gradient of its
    /// output from the next stage (`None` on the last stage, where the output is the loss):
    /// the weight gradients are accumulated, and the gradient of the input, for the previous
    /// stage, is returned (`None` on the first stage).
    pub fn pipeline_backward<M: SegmentedModel + ?Sized>(
        &mut self,
        model: &M,
        forwarded: Forwarded,
        grad_output: Option<Tensor>,
        batch: &MicroBatch,
    ) -> Result<Option<Tensor>> {
        self.pipeline_backward_input(model, forwarded, grad_output, batch, None)
    }

    /// The backward with the weight gradients held back (a zero-bubble schedule's input
    /// gradient first) when `deferred` is given: the input gradient is computed now and the
    /// weights' go to `deferred`, for [`DataParallel::pipeline_weight_grads`] later. Where a
    /// stage's segments run from kiln's tape (on the CPU), their linear layers compute `dx` here
    /// and `dW` in the weight pass ([`Executor::backward_deferring`]); elsewhere both are
    /// computed here and only their accumulation waits. Without `deferred` this is
    /// [`DataParallel::pipeline_backward`]. The gradients are bitwise the same either way.
    pub fn pipeline_backward_input<M: SegmentedModel + ?Sized>(
        &mut self,
        model: &M,
        forwarded: Forwarded,
        grad_output: Option<Tensor>,
        batch: &MicroBatch,
        deferred: Option<&mut DeferredGrads>,
    ) -> Result<Option<Tensor>> {
        let scale = self.step_state("pipeline_backward")?.scale;
        let mut provider = Provider {
            layout: &self.layout,
            vars: &self.vars,
            master: &self.master,
            comm: &*self.comm,
            stage: self.cfg.stage,
            device: &self.device,
        };
        let executor = Executor::new(self.cfg.recompute);
        let Some(deferred) = deferred else {
            // both gradients in one pass, accumulated as each segment's arrive
            let link = self.pipeline.as_mut().ok_or_else(|| {
                ParallelError::Config("pipeline_backward needs with_pipeline first".into())
            })?;
            let step = link.step.as_mut().ok_or_else(|| {
                ParallelError::Config("pipeline_backward outside pipeline_begin/finish".into())
            })?;
            let mut hook = Accumulate {
                layout: &self.layout,
                grads: &mut self.grads,
                owner: &link.owner,
                step,
            };
            let out = executor.backward(
                model,
                forwarded,
                grad_output,
                batch,
                &mut provider,
                &mut hook,
                scale as f64,
            )?;
            return Ok(out.grad_input);
        };
        let (out, pass) = executor.backward_deferring(
            model,
            forwarded,
            grad_output,
            batch,
            &mut provider,
            scale as f64,
        )?;
        deferred.passes.push(pass);
        Ok(out.grad_input)
    }

    /// Computes and accumulates the weight gradients held back by
    /// [`DataParallel::pipeline_backward_input`].
    pub fn pipeline_weight_grads(&mut self, deferred: DeferredGrads) -> Result<()> {
        let layout = &self.layout;
        let grads = &mut self.grads;
        let link = self.pipeline.as_mut().ok_or_else(|| {
            ParallelError::Config("pipeline_weight_grads needs with_pipeline first".into())
        })?;
        let step = link.step.as_mut().ok_or_else(|| {
            ParallelError::Config("pipeline_weight_grads outside pipeline_begin/finish".into())
        })?;
        let mut hook = Accumulate {
            layout,
            grads,
            owner: &link.owner,
            step,
        };
        for pass in deferred.passes {
            pass.run(&mut hook)?;
        }
        Ok(())
    }

    /// Ends a pipelined step of `micro_batches` micro-batches: the tied copies' gradients
    /// summed, the data-parallel reduction, then what [`DataParallel::backward`] ends with.
    /// Follow with [`DataParallel::apply`] or [`DataParallel::discard`].
    pub fn pipeline_finish(
        &mut self,
        micro_batches: usize,
        scaler: &mut dyn LossScaler,
    ) -> Result<StepPreview> {
        let link = self.pipeline.as_mut().ok_or_else(|| {
            ParallelError::Config("pipeline_finish needs with_pipeline first".into())
        })?;
        let mut step = link.step.take().ok_or_else(|| {
            ParallelError::Config("pipeline_finish without pipeline_begin".into())
        })?;
        let last = link.comm.rank() + 1 == link.comm.world_size();
        if last && step.losses != micro_batches {
            return Err(ParallelError::Config(format!(
                "the last stage computed {} losses for a step of {micro_batches} micro-batches",
                step.losses
            )));
        }
        // a parameter read by two segments of this stage: the later segments' sum added once
        for (p, side) in step.side.iter_mut().enumerate() {
            if let Some(side) = side.take() {
                let slot = &self.layout.params()[p];
                let buf = &mut self.grads[slot.unit][slot.offset..slot.offset + slot.numel];
                buf.iter_mut().zip(&side).for_each(|(a, b)| *a += *b);
            }
        }
        // the tied copies on the first and the last stage: one sum over both
        if let Some(emb) = &link.embedding {
            for &p in &link.tied {
                let slot = &self.layout.params()[p];
                let buf = &mut self.grads[slot.unit][slot.offset..slot.offset + slot.numel];
                emb.all_reduce(buf, ReduceOp::Sum)?;
            }
        }
        let tw = Instant::now();
        let mut sink = GradSink {
            layout: &self.layout,
            stage: self.cfg.stage,
            grads: &mut self.grads,
            pool: &mut self.pool,
            shards: &mut self.grad_shards,
            worker: &self.worker,
            pending: vec![0; self.layout.units().len()],
            seen: Vec::new(),
            first_micro: true,
            communicate: true,
            overlap: true,
            deferred: Vec::new(),
            in_flight: 0,
            rank: self.dp_rank,
            dp_size: self.dp_size,
        };
        sink.reduce_all()?;
        let comm_wait: Duration = tw.elapsed();
        let compute_s = step.t0.elapsed().as_secs_f64() - comm_wait.as_secs_f64();
        let loss_sum = if last { step.loss_sum } else { 0.0 };
        self.conclude(
            step.scale,
            micro_batches.max(1),
            loss_sum,
            compute_s,
            step.forward_s,
            comm_wait,
            scaler,
        )
    }
}
