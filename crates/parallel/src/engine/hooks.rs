//! The executor hooks the engine installs: the gradient sink (units to the communication
//! thread as their segments finish) and the ZeRO-3 parameter provider.

use super::worker::{Done, Job, Worker};
use crate::error::Result;
use crate::flat::{tensor_into_slice, FlatLayout};
use candle_core::{Device, Tensor, Var};
use kiln_comm::{CommExt, Communicator};
use kiln_memory::{BoxError, GradHook, ParamProvider, Phase, SegmentParams};
use kiln_state::ZeroStage;

/// The gradient hook: copies each segment's gradients into the unit buffers and hands a unit to
/// the communication thread as soon as all its contributions have arrived.
pub(super) struct GradSink<'a> {
    pub(super) layout: &'a FlatLayout,
    pub(super) stage: ZeroStage,
    pub(super) grads: &'a mut Vec<Vec<f32>>,
    pub(super) pool: &'a mut Vec<Vec<f32>>,
    pub(super) shards: &'a mut Vec<Vec<f32>>,
    pub(super) worker: &'a Worker,
    pub(super) pending: Vec<usize>,
    pub(super) seen: Vec<bool>,
    pub(super) first_micro: bool,
    pub(super) communicate: bool,
    pub(super) overlap: bool,
    pub(super) deferred: Vec<usize>,
    pub(super) in_flight: usize,
    pub(super) rank: usize,
    pub(super) dp_size: usize,
}

impl GradSink<'_> {
    fn unit_buffer(&mut self, u: usize) -> &mut Vec<f32> {
        if self.stage.shards_gradients() {
            // stage 2/3: a transient full buffer per unit while it fills
            if self.grads.len() <= u {
                self.grads.resize_with(self.layout.units().len(), Vec::new);
            }
            if self.grads[u].is_empty() {
                let len = self.layout.units()[u].len;
                let mut b = self.pool.pop().unwrap_or_default();
                b.clear();
                b.resize(len, 0.0);
                self.grads[u] = b;
            }
        }
        &mut self.grads[u]
    }

    fn dispatch(&mut self, u: usize) -> Result<()> {
        let job = if self.stage.shards_gradients() {
            let buf = std::mem::take(&mut self.grads[u]);
            let shard = std::mem::take(&mut self.shards[u]);
            Job::ReduceScatter {
                unit: u,
                buf,
                shard,
                accumulate: !self.first_micro,
            }
        } else {
            Job::AllReduce {
                unit: u,
                buf: std::mem::take(&mut self.grads[u]),
            }
        };
        self.worker.send(job, self.rank)?;
        self.in_flight += 1;
        Ok(())
    }

    /// Hands every unit to the communication thread at once (a pipeline stage's gradients,
    /// accumulated over the whole step) and waits for them all.
    pub(super) fn reduce_all(&mut self) -> Result<()> {
        for u in 0..self.layout.units().len() {
            self.dispatch(u)?;
        }
        self.finish()
    }

    /// Sends what was deferred (overlap off) and waits for every unit to come back.
    pub(super) fn finish(&mut self) -> Result<()> {
        for u in std::mem::take(&mut self.deferred) {
            self.dispatch(u)?;
        }
        while self.in_flight > 0 {
            match self.worker.recv(self.rank)? {
                Done::AllReduce { unit, buf } => self.grads[unit] = buf,
                Done::ReduceScatter { unit, buf, shard } => {
                    self.shards[unit] = shard;
                    self.pool.push(buf);
                }
            }
            self.in_flight -= 1;
        }
        if self.stage.shards_gradients() {
            // the transient buffers are back in the pool
            self.grads.iter_mut().for_each(|g| {
                if !g.is_empty() {
                    self.pool.push(std::mem::take(g));
                }
            });
        }
        debug_assert!(self.dp_size > 0);
        Ok(())
    }
}

impl GradHook for GradSink<'_> {
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
            let (u, off, n) = (slot.unit, slot.offset, slot.numel);
            // overwrite on the first contribution of the step (stages 0/1 accumulate over
            // micro-batches; stages 2/3 start each micro-batch from a fresh buffer)
            let fresh = !self.seen[p] && (self.first_micro || self.stage.shards_gradients());
            self.seen[p] = true;
            let buf = self.unit_buffer(u);
            tensor_into_slice(&g, &mut buf[off..off + n], !fresh, &name)?;
            self.pending[u] -= 1;
            if self.pending[u] == 0 && self.communicate {
                if self.overlap {
                    self.dispatch(u)?;
                } else {
                    self.deferred.push(u);
                }
            }
        }
        Ok(())
    }
}

/// The parameter provider: the model's own variables (stages 0 to 2), or, under ZeRO-3, fresh
/// variables all-gathered from the shards for the segment's units.
pub(super) struct Provider<'a> {
    pub(super) layout: &'a FlatLayout,
    pub(super) vars: &'a [Option<Var>],
    pub(super) master: &'a [Vec<f32>],
    pub(super) comm: &'a dyn Communicator,
    pub(super) stage: ZeroStage,
    pub(super) device: &'a Device,
}

impl ParamProvider for Provider<'_> {
    fn acquire(
        &mut self,
        segment: usize,
        _phase: Phase,
    ) -> std::result::Result<SegmentParams, BoxError> {
        let ids = self.layout.segment_params(segment);
        if self.stage != ZeroStage::Zero3 {
            let mut out = Vec::with_capacity(ids.len());
            for &p in ids {
                let s = &self.layout.params()[p];
                let v = self.vars[p]
                    .clone()
                    .ok_or_else(|| format!("no variable for {}", s.name))?;
                out.push((s.name.clone(), v));
            }
            return Ok(SegmentParams::new(out));
        }
        let mut units: Vec<usize> = ids.iter().map(|&p| self.layout.params()[p].unit).collect();
        units.sort_unstable();
        units.dedup();
        let mut out = Vec::with_capacity(ids.len());
        let mut full = Vec::new();
        for u in units {
            full.resize(self.layout.units()[u].len, 0.0);
            self.comm.all_gather(&self.master[u], &mut full)?;
            for &p in ids {
                let s = &self.layout.params()[p];
                if s.unit == u {
                    let t = Tensor::from_slice(
                        &full[s.offset..s.offset + s.numel],
                        s.shape.as_slice(),
                        self.device,
                    )?;
                    out.push((s.name.clone(), Var::from_tensor(&t)?));
                }
            }
        }
        // keep the segment's listing order
        out.sort_by_key(|(n, _)| ids.iter().position(|&p| self.layout.params()[p].name == *n));
        Ok(SegmentParams::new(out))
    }
}
