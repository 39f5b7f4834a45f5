//! The device-resident step (feature `cuda`): when the model is on a CUDA device, the stage is
//! not ZeRO-3, every shard runs kiln-optim's AdamW, and the data-parallel group has one rank or
//! (feature `nccl`) is an NCCL communicator with replicated state, the fp32 master weights, the
//! gradient buckets and both AdamW moments live in device buffers, one set per unit of the
//! [`crate::FlatLayout`]. A step then moves nothing of the parameters' size to the host:
//!
//! - each segment's gradients are accumulated into the unit buffers by a kernel (the f32 copy or
//!   sum the CPU path does); over several GPUs the units are then averaged by one grouped NCCL
//!   all-reduce on the device (after the last micro-batch, as the CPU path's `no_sync`; not yet
//!   overlapped with the backward);
//! - unscale, inf/NaN check and the squares of the global norm are one kernel per parameter
//!   range: the squares go to integer bins by exponent (exact, as kiln-optim's [`SquareSum`]),
//!   and only the 512 bins and a flag word come to the host, where they become a [`SquareSum`]
//!   that is reduced over the ranks exactly as on the CPU;
//! - clipping multiplies by the coefficient kiln-optim's `clip_to_norm` computes;
//! - AdamW is `kernels/step.cu`'s `adamw_f32`, op for op the CPU kernel, per weight-decay range;
//! - the updated master values are written into the model's variables on the device.
//!
//! So a device step computes bitwise what the CPU path computes from the same gradients (over
//! NCCL the gradient average itself differs in rounding: NCCL does not sum in rank order). The
//! host copies of the master values and the moments are refreshed only when they are read: a
//! checkpoint ([`kiln_state::Stateful::state`]), [`DataParallel::full_params`], or a restore.

use super::{report, DataParallel};
use crate::cuda;
use crate::engine::config::{StepPreview, StepReport};
use crate::engine::hooks::Provider;
use crate::error::{ParallelError, Result};
use crate::flat::FlatLayout;
use crate::tp::TpSplit;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{CudaDevice, Device, Tensor};
use kiln_comm::{chunk_range, CommExt, Communicator, ReduceOp};
use kiln_memory::{BoxError, Executor, GradHook, MicroBatch, SegmentedModel};
use kiln_optim::{AdamW, Optimizer, SquareSum};
use kiln_precision::LossScaler;
use kiln_state::ZeroStage;
use std::ops::Range;
use std::time::Instant;

/// Integers per set of square bins (high and low halves of 256 exponents).
const BINS: usize = 512;

/// The device buffers of the resident step, per unit.
pub(crate) struct Resident {
    dev: CudaDevice,
    master: Vec<CudaSlice<f32>>,
    grads: Vec<CudaSlice<f32>>,
    exp_avg: Vec<CudaSlice<f32>>,
    exp_avg_sq: Vec<CudaSlice<f32>>,
    /// Per unit, the master values before an update (update norms only).
    old: Vec<CudaSlice<f32>>,
    /// Two sets of square bins.
    bins: CudaSlice<u64>,
    /// Two flag words (bit 0: NaN, bit 1: infinity).
    flags: CudaSlice<u32>,
}

impl Resident {
    fn zero_sums(&mut self) -> Result<()> {
        self.dev
            .cuda_stream()
            .memset_zeros(&mut self.bins)
            .map_err(cuda_err)?;
        self.dev
            .cuda_stream()
            .memset_zeros(&mut self.flags)
            .map_err(cuda_err)?;
        Ok(())
    }

    /// The two sums binned since [`Resident::zero_sums`]: 4 KiB and two words to the host.
    fn read_sums(&self) -> Result<[SquareSum; 2]> {
        let bins = self.dev.clone_dtoh(&self.bins)?;
        let flags = self.dev.clone_dtoh(&self.flags)?;
        let mut out = [SquareSum::new(), SquareSum::new()];
        for (k, sum) in out.iter_mut().enumerate() {
            let set = &bins[k * BINS..(k + 1) * BINS];
            let (mut high, mut low) = ([0u64; 256], [0u64; 256]);
            high.copy_from_slice(&set[..256]);
            low.copy_from_slice(&set[256..]);
            sum.add_bins(&high, &low, flags[k] & 1 != 0, flags[k] & 2 != 0);
        }
        Ok(out)
    }

    /// Bins `range` of `buf` into set `k`, unscaling it first by `inv` when given.
    fn bin(
        dev: &CudaDevice,
        bins: &mut CudaSlice<u64>,
        flags: &mut CudaSlice<u32>,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        inv: Option<f32>,
        k: usize,
    ) -> Result<()> {
        Ok(cuda::square_bins(
            dev,
            &mut buf.slice_mut(range),
            inv,
            &mut bins.slice_mut(k * BINS..(k + 1) * BINS),
            &mut flags.slice_mut(k..k + 1),
        )?)
    }
}

fn cuda_err(e: impl std::fmt::Display) -> ParallelError {
    ParallelError::Config(format!("cuda: {e}"))
}

/// The gradient hook of the resident step: each gradient into its unit's device buffer.
struct DeviceGradSink<'a> {
    layout: &'a FlatLayout,
    dev: &'a CudaDevice,
    grads: &'a mut [CudaSlice<f32>],
    seen: Vec<bool>,
    first_micro: bool,
}

impl GradHook for DeviceGradSink<'_> {
    fn segment_grads(
        &mut self,
        _segment: usize,
        grads: Vec<(String, Tensor)>,
    ) -> std::result::Result<(), BoxError> {
        for (name, g) in grads {
            let p = self
                .layout
                .index(&name)
                .ok_or_else(|| format!("gradient for unknown parameter {name}"))?;
            let slot = &self.layout.params()[p];
            // as the CPU path: overwrite on the first contribution of the step
            let fresh = !self.seen[p] && self.first_micro;
            self.seen[p] = true;
            let mut dst = self.grads[slot.unit].slice_mut(slot.offset..slot.offset + slot.numel);
            cuda::accumulate_grad(self.dev, &mut dst, &g, fresh, &name)?;
        }
        Ok(())
    }
}

impl DataParallel {
    /// Whether this engine's steps run device-resident (see the module docs).
    pub(super) fn resident_eligible(&self) -> bool {
        let group =
            self.dp_size == 1 || (self.cfg.stage == ZeroStage::Replicated && self.nccl_dp());
        self.device.is_cuda()
            && group
            && self.cfg.stage != ZeroStage::Zero3
            && (0..self.optim.len()).all(|u| self.adamw(u).is_some())
    }

    /// Whether the data-parallel communicator is NCCL's (device collectives).
    fn nccl_dp(&self) -> bool {
        #[cfg(feature = "nccl")]
        {
            self.nccl().is_some()
        }
        #[cfg(not(feature = "nccl"))]
        {
            false
        }
    }

    #[cfg(feature = "nccl")]
    fn nccl(&self) -> Option<&kiln_comm::nccl::NcclComm> {
        self.comm.as_any()?.downcast_ref()
    }

    fn adamw(&self, u: usize) -> Option<&AdamW> {
        self.optim[u].as_any()?.downcast_ref::<AdamW>()
    }

    fn cuda_device(&self) -> Result<CudaDevice> {
        match &self.device {
            Device::Cuda(d) => Ok(d.clone()),
            other => Err(ParallelError::Config(format!(
                "the device-resident step needs a CUDA device, the model is on {:?}",
                other.location()
            ))),
        }
    }

    /// Uploads the master values and the moments, once (or again after a restore).
    fn ensure_resident(&mut self) -> Result<()> {
        if self.resident.is_some() {
            return Ok(());
        }
        let dev = self.cuda_device()?;
        let n = self.layout.units().len();
        let (mut master, mut grads) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut exp_avg, mut exp_avg_sq) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for u in 0..n {
            let a = self.adamw(u).ok_or_else(|| {
                ParallelError::Config(format!("unit {u}: the device step runs AdamW only"))
            })?;
            master.push(dev.clone_htod(&self.master[u])?);
            grads.push(dev.alloc_zeros::<f32>(self.master[u].len())?);
            exp_avg.push(dev.clone_htod(a.exp_avg())?);
            exp_avg_sq.push(dev.clone_htod(a.exp_avg_sq())?);
        }
        self.resident = Some(Resident {
            bins: dev.alloc_zeros::<u64>(2 * BINS)?,
            flags: dev.alloc_zeros::<u32>(2)?,
            dev,
            master,
            grads,
            exp_avg,
            exp_avg_sq,
            old: Vec::new(),
        });
        Ok(())
    }

    /// [`DataParallel::backward`] on device buffers.
    pub(super) fn backward_resident<M: SegmentedModel + ?Sized>(
        &mut self,
        model: &M,
        micro_batches: &[MicroBatch],
        scaler: &mut dyn LossScaler,
    ) -> Result<StepPreview> {
        let t0 = Instant::now();
        self.ensure_resident()?;
        let scale = scaler.scale();
        let executor = Executor::new(self.cfg.recompute);
        let accum = micro_batches.len();
        let mut loss_sum = 0.0f64;
        let mut forward_s = 0.0f64;
        let res = self
            .resident
            .as_mut()
            .ok_or_else(|| ParallelError::Config("the device buffers are not set up".into()))?;
        for (k, batch) in micro_batches.iter().enumerate() {
            let mut hook = DeviceGradSink {
                layout: &self.layout,
                dev: &res.dev,
                grads: &mut res.grads,
                seen: vec![false; self.layout.params().len()],
                first_micro: k == 0,
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
        }
        // several GPUs: the gradient average, on the device, once per step
        let tw = Instant::now();
        if self.dp_size > 1 {
            #[cfg(feature = "nccl")]
            {
                let nccl = (self.comm.as_any())
                    .and_then(|a| a.downcast_ref::<kiln_comm::nccl::NcclComm>())
                    .ok_or_else(|| {
                        ParallelError::Config(
                            "a device-resident step over several ranks needs NCCL".into(),
                        )
                    })?;
                nccl.all_reduce_many_device(&mut res.grads, ReduceOp::Avg)?;
            }
            #[cfg(not(feature = "nccl"))]
            return Err(ParallelError::Config(
                "a device-resident step over several ranks needs the nccl feature".into(),
            ));
        }
        let comm_wait_s = tw.elapsed().as_secs_f64();
        let compute_s = t0.elapsed().as_secs_f64() - comm_wait_s;

        let t_opt = Instant::now();
        // unscale (and average micro-batches), check and bin the squares: set 0 for what the
        // norm sums over tensor-parallel ranks, set 1 for replicated parameters under tp
        let inv = 1.0 / (scale * accum as f32);
        let inv = (inv != 1.0).then_some(inv);
        res.zero_sums()?;
        for (u, unit) in self.layout.units().iter().enumerate() {
            // the norm and the check count this rank's chunk (each element once over the
            // group, as the CPU path); the rest of the replicated buffer is only unscaled
            let c = chunk_range(unit.len, self.dp_size, self.dp_rank);
            if let Some(f) = inv {
                for rest in [0..c.start, c.end..unit.len] {
                    if !rest.is_empty() {
                        cuda::scale(&res.dev, &mut res.grads[u].slice_mut(rest), f)?;
                    }
                }
            }
            let mut params = unit.params.clone();
            params.sort_by_key(|&p| self.layout.params()[p].offset);
            let mut run: Option<(Range<usize>, usize)> = None;
            for p in params {
                let s = &self.layout.params()[p];
                let k = usize::from(self.tp.is_some() && self.splits[p] == TpSplit::Replicated);
                let r = s.offset.max(c.start)..(s.offset + s.numel).min(c.end);
                if r.is_empty() {
                    continue;
                }
                run = match run {
                    Some((cur, ck)) if ck == k && cur.end == r.start => Some((cur.start..r.end, k)),
                    Some((cur, ck)) => {
                        Resident::bin(
                            &res.dev,
                            &mut res.bins,
                            &mut res.flags,
                            &mut res.grads[u],
                            cur,
                            inv,
                            ck,
                        )?;
                        Some((r, k))
                    }
                    None => Some((r, k)),
                };
            }
            if let Some((cur, ck)) = run {
                Resident::bin(
                    &res.dev,
                    &mut res.bins,
                    &mut res.flags,
                    &mut res.grads[u],
                    cur,
                    inv,
                    ck,
                )?;
            }
        }
        let [mut split, replicated] = res.read_sums()?;
        let found_inf = !(split.is_finite() && replicated.is_finite());
        let found_inf = match &self.world {
            Some(w) => kiln_precision::all_reduce_found_inf(&**w, found_inf)?,
            None => kiln_precision::all_reduce_found_inf(&*self.comm, found_inf)?,
        };
        let loss_local = loss_sum / accum as f64;
        let loss = self.comm.all_reduce_scalar(loss_local, ReduceOp::Avg)? as f32;
        let scale_event = scaler.update(found_inf)?;
        let grad_norm = if found_inf {
            None
        } else {
            // the reductions of `global_norm`, in its order
            let mut replicated = replicated;
            split.all_reduce(&*self.comm)?;
            if let Some(tp) = &self.tp {
                split.all_reduce(&**tp)?;
                replicated.all_reduce(&*self.comm)?;
                split.merge(&replicated);
            }
            Some(split.norm())
        };
        let preview = StepPreview {
            loss,
            grad_norm,
            found_inf,
            loss_scale: scale,
            scale_event,
            compute_s,
            forward_s,
            comm_wait_s,
        };
        self.pending = Some((preview, t_opt));
        Ok(preview)
    }

    /// [`DataParallel::apply`] on device buffers, after the preview's checks.
    pub(super) fn apply_resident(
        &mut self,
        preview: StepPreview,
        t_opt: Instant,
        norm: f64,
        lr: f32,
    ) -> Result<StepReport> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(ParallelError::Config(format!(
                "learning rate {lr}: must be finite and at least 0"
            )));
        }
        let counted = if self.cfg.update_norms {
            Some(self.counted_ranges()?)
        } else {
            None
        };
        // per unit: the AdamW constants' inputs and the weight-decay ranges
        let mut plans = Vec::with_capacity(self.optim.len());
        for u in 0..self.optim.len() {
            let a = self.adamw(u).ok_or_else(|| {
                ParallelError::Config(format!("unit {u}: the device step runs AdamW only"))
            })?;
            let (cfg, step, len) = (*a.config(), a.step_count() + 1, a.exp_avg().len());
            let mut ranges = Vec::new();
            let mut done = 0;
            for o in a.decay_overrides() {
                if o.range.start > done {
                    ranges.push((done..o.range.start, cfg.weight_decay));
                }
                ranges.push((o.range.clone(), o.weight_decay));
                done = o.range.end;
            }
            if done < len {
                ranges.push((done..len, cfg.weight_decay));
            }
            plans.push((cfg, step, ranges));
        }
        let max_grad_norm = self.cfg.max_grad_norm;
        let res = self
            .resident
            .as_mut()
            .ok_or_else(|| ParallelError::Config("the device buffers are not set up".into()))?;
        let mut clipped = false;
        if let Some(max_norm) = max_grad_norm {
            // the coefficient of the CPU path, from the same function
            let r = kiln_optim::clip_to_norm(&mut [], norm, max_norm)?;
            if r.clipped {
                for g in res.grads.iter_mut() {
                    cuda::scale(&res.dev, &mut g.slice_mut(..), r.coef)?;
                }
                clipped = true;
            }
        }
        if counted.is_some() {
            if res.old.len() != res.master.len() {
                res.old = res
                    .master
                    .iter()
                    .map(|m| res.dev.alloc_zeros::<f32>(m.len()))
                    .collect::<candle_core::Result<_>>()?;
            }
            for (old, m) in res.old.iter_mut().zip(&res.master) {
                res.dev.memcpy_dtod(m, old)?;
            }
        }
        for (u, (cfg, step, ranges)) in plans.iter().enumerate() {
            for (r, wd) in ranges {
                let c = cfg.step_consts(*wd, lr, *step);
                cuda::adamw_range(
                    &res.dev,
                    &mut res.master[u].slice_mut(r.clone()),
                    &res.grads[u].slice(r.clone()),
                    &mut res.exp_avg[u].slice_mut(r.clone()),
                    &mut res.exp_avg_sq[u].slice_mut(r.clone()),
                    &c,
                )?;
            }
        }
        // the updated values into the model's variables, on the device
        for (u, unit) in self.layout.units().iter().enumerate() {
            for &p in &unit.params {
                let s = &self.layout.params()[p];
                if let Some(var) = &self.vars[p] {
                    let src = res.master[u].slice(s.offset..s.offset + s.numel);
                    cuda::write_var_from_device(var, &src)?;
                }
            }
        }
        let norms = match &counted {
            Some(ranges) => {
                res.zero_sums()?;
                for (u, rs) in ranges.iter().enumerate() {
                    for r in rs {
                        Resident::bin(
                            &res.dev,
                            &mut res.bins,
                            &mut res.flags,
                            &mut res.master[u],
                            r.clone(),
                            None,
                            0,
                        )?;
                        cuda::delta(
                            &res.dev,
                            &mut res.old[u].slice_mut(r.clone()),
                            &res.master[u].slice(r.clone()),
                        )?;
                        Resident::bin(
                            &res.dev,
                            &mut res.bins,
                            &mut res.flags,
                            &mut res.old[u],
                            r.clone(),
                            None,
                            1,
                        )?;
                    }
                }
                Some(res.read_sums()?)
            }
            None => None,
        };
        for (u, (_, step, _)) in plans.iter().enumerate() {
            self.optim[u].set_step_count(*step);
        }
        let mut rep = report(&preview, clipped, t_opt);
        if let Some([mut params, mut delta]) = norms {
            let world: &dyn Communicator = self.world.as_deref().unwrap_or(&*self.comm);
            params.all_reduce(world)?;
            delta.all_reduce(world)?;
            let pn = params.norm();
            rep.param_norm = Some(pn);
            rep.update_ratio = Some(if pn > 0.0 { delta.norm() / pn } else { 0.0 });
        }
        Ok(rep)
    }

    /// Copies the device master values and moments to the host and drops the device buffers
    /// (the next backward uploads them again). Before a restore replaces the host state.
    pub(super) fn release_resident(&mut self) -> Result<()> {
        let Some(res) = self.resident.take() else {
            return Ok(());
        };
        let stream = res.dev.cuda_stream();
        for u in 0..res.master.len() {
            stream
                .memcpy_dtoh(&res.master[u], self.master[u].as_mut_slice())
                .map_err(cuda_err)?;
            for (name, buf) in self.optim[u].state_buffers_mut() {
                let src = match name {
                    "exp_avg" => &res.exp_avg[u],
                    "exp_avg_sq" => &res.exp_avg_sq[u],
                    other => {
                        return Err(ParallelError::Config(format!(
                            "the device step holds no optimizer buffer {other}"
                        )))
                    }
                };
                stream.memcpy_dtoh(src, buf).map_err(cuda_err)?;
            }
        }
        Ok(())
    }

    /// The device master values and optimizer buffers (in [`kiln_optim::Optimizer::state_buffers`]
    /// order), copied to the host; `None` when the step is not resident.
    pub(super) fn resident_snapshot(&self) -> Result<Option<super::HostState>> {
        let Some(res) = &self.resident else {
            return Ok(None);
        };
        let master = res
            .master
            .iter()
            .map(|m| res.dev.clone_dtoh(m))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let names: Vec<&str> = self
            .optim
            .first()
            .map(|o| o.state_buffers().iter().map(|(n, _)| *n).collect())
            .unwrap_or_default();
        let mut buffers = Vec::with_capacity(names.len());
        for name in names {
            let src = match name {
                "exp_avg" => &res.exp_avg,
                "exp_avg_sq" => &res.exp_avg_sq,
                other => {
                    return Err(ParallelError::Config(format!(
                        "the device step holds no optimizer buffer {other}"
                    )))
                }
            };
            buffers.push(
                src.iter()
                    .map(|b| res.dev.clone_dtoh(b))
                    .collect::<candle_core::Result<Vec<_>>>()?,
            );
        }
        Ok(Some((master, buffers)))
    }

    /// Unit `u`'s master values from the device, when resident.
    pub(super) fn resident_unit(&self, u: usize) -> Result<Option<Vec<f32>>> {
        match &self.resident {
            Some(res) => Ok(Some(res.dev.clone_dtoh(&res.master[u])?)),
            None => Ok(None),
        }
    }

    /// Uploads the host master values to the device (after [`DataParallel::load_master`]).
    pub(super) fn resident_load_master(&mut self) -> Result<()> {
        let Some(res) = self.resident.as_mut() else {
            return Ok(());
        };
        for (d, h) in res.master.iter_mut().zip(&self.master) {
            res.dev.memcpy_htod(h.as_slice(), d)?;
        }
        Ok(())
    }
}
