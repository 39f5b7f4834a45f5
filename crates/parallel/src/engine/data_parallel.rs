//! [`DataParallel`]: the engine.

use super::config::{DataParallelConfig, StepPreview, StepReport};
use super::hooks::{GradSink, Provider};
use super::worker::Worker;
use crate::error::{ParallelError, Result};
use crate::flat::{tensor_into_slice, write_var, FlatLayout};
use crate::tp::TpSplit;
use candle_core::{Device, Var};
use kiln_comm::{chunk_range, CommExt, Communicator, ReduceOp};
use kiln_memory::{Executor, MicroBatch, SegmentedModel};
use kiln_optim::{Optimizer, OptimizerFactory};
use kiln_precision::{unscale_and_check, LossScaler};
use kiln_state::ZeroStage;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod host;
mod pipeline;
mod schedule_run;
pub use pipeline::DeferredGrads;
pub use schedule_run::PipelineTrace;
#[cfg(feature = "cuda")]
mod resident;
mod state;

/// The master values per unit and the optimizer's buffers (per buffer, per unit), on the host.
pub(crate) type HostState = (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>);

/// Data parallel (optionally ZeRO-sharded) training of a [`SegmentedModel`] over a data-parallel
/// communicator. See the module docs.
pub struct DataParallel {
    cfg: DataParallelConfig,
    layout: FlatLayout,
    dp_rank: usize,
    dp_size: usize,
    /// The model's variables, per parameter (stages 0 to 2).
    vars: Vec<Option<Var>>,
    /// Per unit: the full fp32 master (replicated) or this rank's chunk (ZeRO).
    master: Vec<Vec<f32>>,
    /// Per unit: full gradient accumulators (stages 0 and 1).
    grads: Vec<Vec<f32>>,
    /// Per unit: this rank's gradient chunk (stages 2 and 3).
    grad_shards: Vec<Vec<f32>>,
    /// Transient full unit buffers for stages 2 and 3.
    pool: Vec<Vec<f32>>,
    /// Per unit: the optimizer of this rank's chunk (the whole unit when replicated).
    optim: Vec<Box<dyn Optimizer>>,
    /// What builds each unit's optimizer.
    factory: Arc<dyn OptimizerFactory>,
    /// Per parameter (layout order): its own weight decay, if it has one.
    decay: Vec<Option<f64>>,
    /// Main-thread data-parallel communicator (parameter gathers, norms).
    comm: Box<dyn Communicator>,
    /// The whole world, for the found-inf flag (defaults to the data-parallel group).
    world: Option<Arc<dyn Communicator>>,
    /// The tensor-parallel group, when the model is split over one.
    tp: Option<Arc<dyn Communicator>>,
    /// The pipeline this engine's stage belongs to, when the model is split into stages.
    pipeline: Option<pipeline::PipelineLink>,
    /// Per parameter (layout order), how it is split over tensor-parallel ranks.
    splits: Vec<TpSplit>,
    worker: Worker,
    device: Device,
    /// The preview of a backward not yet applied or discarded, and when its optimizer phase
    /// began.
    pending: Option<(StepPreview, Instant)>,
    /// A reused buffer (the master chunk before an update, for update norms).
    scratch: Vec<f32>,
    /// The device buffers of the device-resident step, once set up (feature `cuda`).
    #[cfg(feature = "cuda")]
    resident: Option<resident::Resident>,
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("stage", &self.cfg.stage)
            .field("dp_rank", &self.dp_rank)
            .field("dp_size", &self.dp_size)
            .field("units", &self.layout.units().len())
            .field("steps", &self.steps())
            .finish()
    }
}

impl DataParallel {
    /// Sets up data parallel training of the parameters `segments` lists (per segment, the named
    /// variables it uses; a name in two segments is a tied parameter) over the data-parallel
    /// group `dp`. Collective: every rank of `dp` calls it. Rank 0's initial values are
    /// broadcast, so all replicas start equal.
    ///
    /// For [`ZeroStage::Zero3`] the variables are read once here (to take this rank's chunks) and
    /// then never used again: the model must run with the parameters the provider hands out
    /// (see [`SegmentedModel::forward_segment`]), and the caller may drop its own copies.
    pub fn new(
        segments: &[Vec<(String, Var)>],
        dp: &dyn Communicator,
        cfg: DataParallelConfig,
    ) -> Result<Self> {
        let shapes: Vec<Vec<(String, Vec<usize>)>> = segments
            .iter()
            .map(|s| {
                s.iter()
                    .map(|(n, v)| (n.clone(), v.dims().to_vec()))
                    .collect()
            })
            .collect();
        let layout = FlatLayout::new(&shapes, (cfg.bucket_bytes / 4).max(1))?;
        let mut vars: Vec<Option<Var>> = vec![None; layout.params().len()];
        for seg in segments {
            for (n, v) in seg {
                if let Some(i) = layout.index(n) {
                    vars[i] = Some(v.clone());
                }
            }
        }
        let device = segments
            .iter()
            .flatten()
            .next()
            .map(|(_, v)| v.device().clone())
            .unwrap_or(Device::Cpu);
        let dp_rank = dp.rank();
        let dp_size = dp.world_size();
        let comm = dp.split(0, dp_rank as u32)?;
        let worker_comm = dp.split(0, dp_rank as u32)?;
        let stage = cfg.stage;
        let mut master = Vec::with_capacity(layout.units().len());
        let mut optim = Vec::with_capacity(layout.units().len());
        for unit in layout.units() {
            let mut full = vec![0.0f32; unit.len];
            for &p in &unit.params {
                let slot = &layout.params()[p];
                let v = vars[p].as_ref().ok_or_else(|| ParallelError::Param {
                    name: slot.name.clone(),
                    expected: "a variable".into(),
                    got: "none".into(),
                })?;
                tensor_into_slice(
                    v.as_tensor(),
                    &mut full[slot.offset..slot.offset + slot.numel],
                    false,
                    &slot.name,
                )?;
            }
            comm.broadcast(&mut full, 0)?;
            let mine = if stage == ZeroStage::Replicated {
                full
            } else {
                full[chunk_range(unit.len, dp_size, dp_rank)].to_vec()
            };
            if stage != ZeroStage::Zero3 {
                // make every replica start from rank 0's values
                for &p in &unit.params {
                    let slot = &layout.params()[p];
                    if let Some(v) = vars[p].as_ref() {
                        if stage == ZeroStage::Replicated {
                            write_var(v, &mine[slot.offset..slot.offset + slot.numel])?;
                        }
                    }
                }
            }
            optim.push(cfg.optimizer.build(mine.len())?);
            master.push(mine);
        }
        let mut dp_engine = Self {
            grads: Vec::new(),
            grad_shards: Vec::new(),
            pool: Vec::new(),
            cfg,
            dp_rank,
            dp_size,
            vars: if stage == ZeroStage::Zero3 {
                vec![None; layout.params().len()]
            } else {
                vars
            },
            master,
            optim,
            factory: Arc::new(cfg.optimizer),
            decay: vec![None; layout.params().len()],
            comm,
            world: None,
            tp: None,
            pipeline: None,
            splits: vec![TpSplit::Replicated; layout.params().len()],
            worker: Worker::start(worker_comm)?,
            device,
            layout,
            pending: None,
            scratch: Vec::new(),
            #[cfg(feature = "cuda")]
            resident: None,
        };
        if matches!(stage, ZeroStage::Zero1 | ZeroStage::Zero2) {
            dp_engine.gather_into_vars()?;
        }
        if stage.shards_gradients() {
            dp_engine.grad_shards = dp_engine
                .master
                .iter()
                .map(|m| vec![0.0; m.len()])
                .collect();
        } else {
            dp_engine.grads = dp_engine
                .layout
                .units()
                .iter()
                .map(|u| vec![0.0; u.len])
                .collect();
        }
        Ok(dp_engine)
    }

    /// Whether the next applied steps report the parameter norm and the update ratio
    /// ([`DataParallelConfig::update_norms`]): a trainer that logs them every few steps turns
    /// them on for those steps only (each costs two exact square sums over the rank's shard,
    /// 2.3% of the main job's step on 2 cores).
    pub fn set_update_norms(&mut self, on: bool) {
        self.cfg.update_norms = on;
    }

    /// All-reduce the found-inf flag over this communicator (the whole world when tensor
    /// parallel ranks must skip together) instead of the data-parallel group.
    pub fn with_world(mut self, world: Arc<dyn Communicator>) -> Self {
        self.world = Some(world);
        self
    }

    /// Declares how each parameter is split over tensor-parallel ranks (the model's list, for
    /// example `kiln_model::Gpt::param_splits`); parameters it does not name are replicated.
    /// It decides which gradients the global norm counts once, and how checkpoints store each
    /// parameter (its whole shape and this rank's slice), so give it at tp = 1 too: the
    /// checkpoint then reshards to any degree. A name the engine does not hold is an error.
    pub fn with_param_splits(mut self, splits: &[(String, TpSplit)]) -> Result<Self> {
        for (name, split) in splits {
            let i = self
                .layout
                .index(name)
                .ok_or_else(|| ParallelError::Param {
                    name: name.clone(),
                    expected: "a parameter of the engine".into(),
                    got: "an unknown name in the split list".into(),
                })?;
            self.splits[i] = *split;
        }
        Ok(self)
    }

    /// Declares that the model is also split over the tensor-parallel group `tp` (see
    /// [`DataParallel::with_param_splits`] for which parameters). The global gradient norm then
    /// sums the split parameters over `tp` and counts the replicated ones once, so clipping
    /// equals the unsplit model's.
    pub fn with_tensor_parallel(mut self, tp: Arc<dyn Communicator>) -> Self {
        self.tp = Some(tp);
        self
    }

    /// How each parameter (layout order) is split over tensor-parallel ranks.
    pub fn param_splits(&self) -> &[TpSplit] {
        &self.splits
    }

    /// `(degree, rank)` of the tensor-parallel group (`(1, 0)` without one).
    pub fn tp_dims(&self) -> (usize, usize) {
        self.tp
            .as_ref()
            .map_or((1, 0), |t| (t.world_size(), t.rank()))
    }

    /// `(degree, rank)` of the data-parallel group.
    pub fn dp_dims(&self) -> (usize, usize) {
        (self.dp_size, self.dp_rank)
    }

    /// The data-parallel communicator of the main thread (gathers for checkpoints).
    pub(crate) fn dp_comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    /// The device of the model's parameters (the device batches go to).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the optimizer phase runs device-resident: master weights, gradient buckets and
    /// AdamW moments in CUDA buffers, fused kernels for unscale, norm, clipping and AdamW,
    /// nothing of the parameters' size copied to the host in a step. True with the `cuda`
    /// feature when the model is on a CUDA device, the stage is not ZeRO-3, the optimizer is
    /// kiln-optim's AdamW, and the data-parallel group has one rank or (feature `nccl`) is an
    /// NCCL communicator with replicated state; otherwise gradients and updates go through
    /// host buffers (correct on any device, slower on a GPU).
    pub fn is_device_resident(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.resident_eligible()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// The master values and optimizer buffers from the device when the step is resident
    /// (`None` otherwise: the host buffers are current).
    pub(crate) fn device_snapshot(&self) -> Result<Option<HostState>> {
        #[cfg(feature = "cuda")]
        {
            self.resident_snapshot()
        }
        #[cfg(not(feature = "cuda"))]
        {
            Ok(None)
        }
    }

    /// Makes the host buffers current and drops any device buffers (the next backward uploads
    /// them again): before a restore replaces the host state.
    pub(crate) fn sync_host(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        self.release_resident()?;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &DataParallelConfig {
        &self.cfg
    }

    /// The parameter layout.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// Optimizer steps taken (skipped steps not counted).
    pub fn steps(&self) -> u64 {
        // one counter: the optimizers' (every unit's optimizer steps together), which a
        // restored checkpoint sets
        self.optim.first().map_or(0, |o| o.step_count())
    }

    /// One optimizer step over `micro_batches` (each a [`MicroBatch`] of named tensors;
    /// gradient accumulation when more than one): forward and backward through the segmented executor with this engine's
    /// gradient hook and parameter provider, gradient reduction, unscale and found-inf check,
    /// clipping, the optimizer on this rank's shard and the parameter gather.
    ///
    /// `lr` is the learning rate for this step; a step skipped by the loss scaler leaves every
    /// parameter and the optimizer state unchanged (check [`StepReport::scale_event`]).
    pub fn step<M: SegmentedModel + ?Sized>(
        &mut self,
        model: &M,
        micro_batches: &[MicroBatch],
        lr: f32,
        scaler: &mut dyn LossScaler,
    ) -> Result<StepReport> {
        self.step_gated(model, micro_batches, lr, scaler, &mut |_| true)
            .map(|(report, _)| report)
    }

    /// [`DataParallel::step`] with a gate: once the gradients are reduced, found finite and
    /// their norm is known, `gate` sees a [`StepPreview`] and says whether to apply the update
    /// (clipping, optimizer, parameter gather). Returns the report and whether the update was
    /// applied. A step the loss scaler skips never reaches the gate (`false` is returned).
    ///
    /// A circuit breaker uses this to skip a batch whose loss or gradient norm is anomalous:
    /// the parameters and the optimizer state stay as they were, only the loss scaler has
    /// counted a clean step. The gate must answer the same on every rank.
    pub fn step_gated<M: SegmentedModel + ?Sized>(
        &mut self,
        model: &M,
        micro_batches: &[MicroBatch],
        lr: f32,
        scaler: &mut dyn LossScaler,
        gate: &mut dyn FnMut(&StepPreview) -> bool,
    ) -> Result<(StepReport, bool)> {
        let preview = self.backward(model, micro_batches, scaler)?;
        if !preview.found_inf && gate(&preview) {
            Ok((self.apply(lr)?, true))
        } else {
            Ok((self.discard()?, false))
        }
    }

    /// The first half of a step: forward and backward over `micro_batches` (gradients
    /// accumulated, reduced over the data-parallel group as the backward goes), then unscaled,
    /// checked for inf/NaN (agreed over the world), the loss averaged, the loss scaler updated
    /// and the global gradient norm computed. Nothing is updated yet: follow with
    /// [`DataParallel::apply`] (clip and step the optimizer) or [`DataParallel::discard`],
    /// as PyTorch's `loss.backward()` is followed by `clip_grad_norm_` and `optimizer.step()`,
    /// or not. Every rank gets the same preview.
    pub fn backward<M: SegmentedModel + ?Sized>(
        &mut self,
        model: &M,
        micro_batches: &[MicroBatch],
        scaler: &mut dyn LossScaler,
    ) -> Result<StepPreview> {
        if self.pending.is_some() {
            return Err(ParallelError::Config(
                "backward called again before apply or discard of the previous one".into(),
            ));
        }
        if micro_batches.is_empty() {
            return Err(ParallelError::Config(
                "a step needs at least one micro-batch".into(),
            ));
        }
        if model.num_segments() != self.layout.num_segments() {
            return Err(ParallelError::Config(format!(
                "the model has {} segments but the parameters were listed for {}",
                model.num_segments(),
                self.layout.num_segments()
            )));
        }
        #[cfg(feature = "cuda")]
        if self.resident_eligible() {
            return self.backward_resident(model, micro_batches, scaler);
        }
        let t0 = Instant::now();
        let scale = scaler.scale();
        let executor = Executor::new(self.cfg.recompute);
        let accum = micro_batches.len();
        let mut loss_sum = 0.0f64;
        let mut forward_s = 0.0f64;
        let mut comm_wait = Duration::ZERO;
        for (k, batch) in micro_batches.iter().enumerate() {
            let sync = k + 1 == accum;
            let communicate = sync || self.cfg.stage.shards_gradients();
            let mut hook = GradSink {
                layout: &self.layout,
                stage: self.cfg.stage,
                grads: &mut self.grads,
                pool: &mut self.pool,
                shards: &mut self.grad_shards,
                worker: &self.worker,
                pending: self
                    .layout
                    .units()
                    .iter()
                    .map(|u| u.contributions)
                    .collect(),
                seen: vec![false; self.layout.params().len()],
                first_micro: k == 0,
                communicate,
                overlap: self.cfg.overlap,
                deferred: Vec::new(),
                in_flight: 0,
                rank: self.dp_rank,
                dp_size: self.dp_size,
            };
            let mut provider = Provider {
                layout: &self.layout,
                vars: &self.vars,
                master: &self.master,
                comm: &*self.comm,
                stage: self.cfg.stage,
                device: &self.device,
            };
            let out = executor.run(model, batch, &mut provider, &mut hook, scale as f64)?;
            forward_s += out.forward_s;
            loss_sum += out
                .loss
                .to_dtype(candle_core::DType::F64)?
                .to_scalar::<f64>()?;
            let tw = Instant::now();
            hook.finish()?;
            comm_wait += tw.elapsed();
        }
        let compute_s = t0.elapsed().as_secs_f64() - comm_wait.as_secs_f64();
        self.conclude(
            scale, accum, loss_sum, compute_s, forward_s, comm_wait, scaler,
        )
    }

    /// The end of [`DataParallel::backward`] once every micro-batch's gradients are reduced
    /// over the data-parallel group: unscale and the found-inf check (agreed over the world),
    /// the loss (the mean of `loss_sum` over `accum` micro-batches, averaged over the group; a
    /// pipeline's last stage broadcasts its own), the loss scaler's update and the global norm.
    #[allow(clippy::too_many_arguments)]
    fn conclude(
        &mut self,
        scale: f32,
        accum: usize,
        loss_sum: f64,
        compute_s: f64,
        forward_s: f64,
        comm_wait: Duration,
        scaler: &mut dyn LossScaler,
    ) -> Result<StepPreview> {
        let t_opt = Instant::now();
        // unscale (and average micro-batches), check for inf/NaN on what this rank owns
        let inv = 1.0 / (scale * accum as f32);
        let threads = self.host_threads();
        // with nothing to unscale, the exact norm's pass finds any inf or NaN itself (its square
        // sum keeps them; the norm of finite f32 values is finite), and every rank gets the same
        // norm: one read of every gradient fewer (the check was 0.7% of a d512 f32 step)
        let norm_first = if inv == 1.0 {
            Some(self.global_norm()?)
        } else {
            None
        };
        let found_inf = match norm_first {
            Some(n) => !n.is_finite(),
            None => {
                let mut found_inf = false;
                for u in 0..self.layout.units().len() {
                    found_inf |= host::unscale_and_check_par(self.owned_grads_mut(u), inv, threads);
                }
                if self.cfg.stage == ZeroStage::Replicated {
                    // the rest of the replicated buffer is needed by the optimizer too
                    for u in 0..self.layout.units().len() {
                        let len = self.grads[u].len();
                        let c = chunk_range(len, self.dp_size, self.dp_rank);
                        let g = &mut self.grads[u];
                        let (head, tail) = g.split_at_mut(c.start);
                        unscale_and_check(head, inv);
                        unscale_and_check(&mut tail[c.len()..], inv);
                    }
                }
                match &self.world {
                    Some(w) => kiln_precision::all_reduce_found_inf(&**w, found_inf)?,
                    None => kiln_precision::all_reduce_found_inf(&*self.comm, found_inf)?,
                }
            }
        };
        let loss_local = loss_sum / accum as f64;
        let mut loss = self.comm.all_reduce_scalar(loss_local, ReduceOp::Avg)? as f32;
        if let Some(pp) = &self.pipeline {
            loss = pipeline::last_stage_loss(&*pp.comm, loss)?;
        }
        let scale_event = scaler.update(found_inf)?;
        let grad_norm = match (found_inf, norm_first) {
            (true, _) => None,
            (false, Some(n)) => Some(n),
            (false, None) => Some(self.global_norm()?),
        };
        let preview = StepPreview {
            loss,
            grad_norm,
            found_inf,
            loss_scale: scale,
            scale_event,
            compute_s,
            forward_s,
            comm_wait_s: comm_wait.as_secs_f64(),
        };
        self.pending = Some((preview, t_opt));
        Ok(preview)
    }

    /// The second half of a step after [`DataParallel::backward`]: clips the gradients to
    /// the configured global norm (kiln-optim's [`kiln_optim::clip_to_norm`], PyTorch's
    /// `clip_grad_norm_`), steps every shard's optimizer at learning rate `lr` and gathers
    /// the updated parameters into the model. A step that overflowed is not applied (as
    /// `GradScaler.step` skips it); the report says so through its scale event.
    pub fn apply(&mut self, lr: f32) -> Result<StepReport> {
        let (preview, t_opt) = self.take_pending("apply")?;
        let Some(norm) = preview.grad_norm.filter(|_| !preview.found_inf) else {
            return Ok(report(&preview, false, t_opt));
        };
        #[cfg(feature = "cuda")]
        if self.resident.is_some() {
            return self.apply_resident(preview, t_opt, norm, lr);
        }
        let mut clipped = false;
        let threads = self.host_threads();
        if let Some(max_norm) = self.cfg.max_grad_norm {
            for u in 0..self.layout.units().len() {
                let g: &mut [f32] = if self.cfg.stage.shards_gradients() {
                    &mut self.grad_shards[u]
                } else {
                    &mut self.grads[u]
                };
                clipped |= host::clip_to_norm_par(g, norm, max_norm, threads)?;
            }
        }
        // with update norms, each unit's chunk before its step, in one reused buffer
        let counted = if self.cfg.update_norms {
            Some(self.counted_ranges()?)
        } else {
            None
        };
        let (mut params, mut delta) = (kiln_optim::SquareSum::new(), kiln_optim::SquareSum::new());
        let mut old = std::mem::take(&mut self.scratch);
        let runner: Option<Arc<dyn kiln_optim::ParallelRunner>> =
            (threads > 1).then(|| Arc::new(host::PoolRunner) as _);
        for u in 0..self.layout.units().len() {
            self.optim[u].set_threads(threads);
            self.optim[u].set_runner(runner.clone());
            let c = chunk_range(self.layout.units()[u].len, self.dp_size, self.dp_rank);
            let grads: &[f32] = match self.cfg.stage {
                ZeroStage::Replicated => &self.grads[u],
                ZeroStage::Zero1 => &self.grads[u][c],
                ZeroStage::Zero2 | ZeroStage::Zero3 => &self.grad_shards[u],
            };
            if counted.is_some() {
                old.clear();
                old.extend_from_slice(&self.master[u]);
            }
            self.optim[u].step(&mut self.master[u], grads, lr)?;
            if let Some(ranges) = &counted {
                for r in ranges[u].iter().cloned() {
                    let now = &self.master[u][r.clone()];
                    params.add(now);
                    // the update, in place of the old values
                    let upd = &mut old[r];
                    upd.iter_mut().zip(now).for_each(|(o, n)| *o = n - *o);
                    delta.add(upd);
                }
            }
        }
        self.scratch = old;
        if self.cfg.stage != ZeroStage::Zero3 {
            self.gather_into_vars()?;
        }
        let mut rep = report(&preview, clipped, t_opt);
        if counted.is_some() {
            let world: &dyn Communicator = self.world.as_deref().unwrap_or(&*self.comm);
            params.all_reduce(world)?;
            delta.all_reduce(world)?;
            let pn = params.norm();
            rep.param_norm = Some(pn);
            rep.update_ratio = Some(if pn > 0.0 { delta.norm() / pn } else { 0.0 });
        }
        Ok(rep)
    }

    /// Drops the gradients of the last [`DataParallel::backward`] without updating anything
    /// (a batch a circuit breaker skips); the loss scaler has already seen the step.
    pub fn discard(&mut self) -> Result<StepReport> {
        let (preview, t_opt) = self.take_pending("discard")?;
        Ok(report(&preview, false, t_opt))
    }

    /// Per unit, the ranges of this rank's master chunk that the global parameter and update
    /// norms count, each element of the model once over the world: the elements this rank
    /// saves in a checkpoint (its chunk of each unit, even when it holds the whole unit), and
    /// a parameter replicated over tensor-parallel ranks only on tp rank 0.
    fn counted_ranges(&self) -> Result<Vec<Vec<std::ops::Range<usize>>>> {
        let plan = self.shard_plan()?;
        let skip_replicated = self.tp_dims().1 != 0;
        let mut out = vec![Vec::new(); self.layout.units().len()];
        for p in plan.params() {
            if p.save.is_empty() || (skip_replicated && p.region.is_none()) {
                continue;
            }
            let unit_start = if self.cfg.stage == ZeroStage::Replicated {
                0
            } else {
                chunk_range(self.layout.units()[p.unit].len, self.dp_size, self.dp_rank).start
            };
            let base = p.offset + p.save.start - unit_start;
            out[p.unit].push(base..base + p.save.len());
        }
        Ok(out)
    }

    fn take_pending(&mut self, what: &str) -> Result<(StepPreview, Instant)> {
        self.pending.take().ok_or_else(|| {
            ParallelError::Config(format!("{what} called without a backward before it"))
        })
    }

    /// Threads this rank's host-side work over whole buffers (the optimizer, the gradient norm)
    /// may use: the threads of candle's worker pool, shared among the ranks of this process
    /// when they are threads (so that four thread ranks on two cores do not start eight
    /// threads each).
    fn host_threads(&self) -> usize {
        let ranks = if self.comm.backend() == "thread" {
            self.dp_size * self.tp.as_ref().map_or(1, |t| t.world_size())
        } else {
            1
        };
        (kiln_kernels::pool::pool_threads() / ranks.max(1)).max(1)
    }

    /// The global L2 norm of the gradients from each rank's chunks (the square sums are exact,
    /// so the result does not depend on the chunking).
    fn global_norm(&self) -> Result<f64> {
        // each parameter's owned values, and whether they are replicated over tp ranks
        let mut values: Vec<&[f32]> = Vec::new();
        let mut replicated_at: Vec<bool> = Vec::new();
        for (u, unit) in self.layout.units().iter().enumerate() {
            let c = chunk_range(unit.len, self.dp_size, self.dp_rank);
            let owned = self.owned_grads(u);
            for &p in &unit.params {
                let slot = &self.layout.params()[p];
                let (lo, hi) = (
                    slot.offset.max(c.start),
                    (slot.offset + slot.numel).min(c.end),
                );
                if lo >= hi {
                    continue;
                }
                if self.pipeline.as_ref().is_some_and(|pp| pp.norm_skip[p]) {
                    continue;
                }
                values.push(&owned[lo - c.start..hi - c.start]);
                replicated_at.push(self.tp.is_some() && self.splits[p] == TpSplit::Replicated);
            }
        }
        let (mut split, mut replicated) =
            (kiln_optim::SquareSum::new(), kiln_optim::SquareSum::new());
        for (part, repl) in host::square_sums(&values, self.host_threads())
            .iter()
            .zip(replicated_at)
        {
            if repl {
                replicated.merge(part);
            } else {
                split.merge(part);
            }
        }
        split.all_reduce(&*self.comm)?;
        if let Some(tp) = &self.tp {
            split.all_reduce(&**tp)?;
            replicated.all_reduce(&*self.comm)?;
            split.merge(&replicated);
        }
        if let Some(pp) = &self.pipeline {
            split.all_reduce(&*pp.comm)?;
        }
        Ok(split.norm())
    }

    fn owned_grads(&self, u: usize) -> &[f32] {
        if self.cfg.stage.shards_gradients() {
            &self.grad_shards[u]
        } else {
            let c = chunk_range(self.grads[u].len(), self.dp_size, self.dp_rank);
            &self.grads[u][c]
        }
    }

    fn owned_grads_mut(&mut self, u: usize) -> &mut [f32] {
        if self.cfg.stage.shards_gradients() {
            &mut self.grad_shards[u]
        } else {
            let c = chunk_range(self.grads[u].len(), self.dp_size, self.dp_rank);
            &mut self.grads[u][c]
        }
    }
}

/// The report of a step from its preview.
fn report(p: &StepPreview, clipped: bool, t_opt: Instant) -> StepReport {
    StepReport {
        loss: p.loss,
        grad_norm: p.grad_norm,
        clipped,
        scale_event: p.scale_event,
        loss_scale: p.loss_scale,
        compute_s: p.compute_s,
        forward_s: p.forward_s,
        comm_wait_s: p.comm_wait_s,
        optim_s: t_opt.elapsed().as_secs_f64(),
        param_norm: None,
        update_ratio: None,
    }
}
