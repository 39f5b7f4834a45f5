//! Running a pipeline schedule's action list on one rank: the forwards and backwards through
//! the engine's pipeline methods, the activations and their gradients as point-to-point
//! messages over the pipeline group.

use super::super::config::StepPreview;
use super::{DataParallel, DeferredGrads};
use crate::error::{ParallelError, Result};
use crate::pipeline::{Action, Schedule};
use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use kiln_comm::{CommExt, Communicator};
use kiln_memory::{Forwarded, MicroBatch, SegmentedModel};
use kiln_precision::LossScaler;
use std::collections::HashMap;
use std::ops::Range;

/// The agreement tag of a message across the boundary after model stage `stage`: the
/// receiver checks it against what it expects (kind 0: an activation, 1: its gradient; header
/// part 0, data part 1).
fn tag(kind: u32, stage: usize, mb: usize, part: u32) -> u32 {
    (kind << 31) | (((stage as u32) & 0x3fff) << 17) | (((mb as u32) & 0xffff) << 1) | part
}

const HEADER: usize = 6;

fn dtype_code(d: DType) -> Result<u32> {
    Ok(match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        other => {
            return Err(ParallelError::Config(format!(
                "a pipeline sends f32, f16 or bf16 activations, got {other:?}"
            )))
        }
    })
}

fn send_tensor(
    comm: &dyn Communicator,
    t: &Tensor,
    to: usize,
    kind: u32,
    stage: usize,
    mb: usize,
) -> Result<()> {
    let dims = t.dims();
    if dims.len() > HEADER - 2 {
        return Err(ParallelError::Config(format!(
            "a pipeline sends tensors of at most {} dimensions, got {dims:?}",
            HEADER - 2
        )));
    }
    let mut header = [0u32; HEADER];
    header[0] = dtype_code(t.dtype())?;
    header[1] = dims.len() as u32;
    for (h, &d) in header[2..].iter_mut().zip(dims) {
        *h = d as u32;
    }
    comm.send(&header, to, tag(kind, stage, mb, 0))?;
    let flat = t.flatten_all()?;
    let data_tag = tag(kind, stage, mb, 1);
    match t.dtype() {
        DType::F32 => comm.send(&flat.to_vec1::<f32>()?, to, data_tag)?,
        DType::F16 => comm.send(&flat.to_vec1::<f16>()?, to, data_tag)?,
        _ => comm.send(&flat.to_vec1::<bf16>()?, to, data_tag)?,
    }
    Ok(())
}

fn recv_tensor(
    comm: &dyn Communicator,
    from: usize,
    kind: u32,
    stage: usize,
    mb: usize,
    device: &Device,
) -> Result<Tensor> {
    let mut header = [0u32; HEADER];
    comm.recv(&mut header, from, tag(kind, stage, mb, 0))?;
    let ndim = (header[1] as usize).min(HEADER - 2);
    let dims: Vec<usize> = header[2..2 + ndim].iter().map(|&d| d as usize).collect();
    let n: usize = dims.iter().product();
    let data_tag = tag(kind, stage, mb, 1);
    let t = match header[0] {
        0 => {
            let mut v = vec![0f32; n];
            comm.recv(&mut v, from, data_tag)?;
            Tensor::from_vec(v, dims, device)?
        }
        1 => {
            let mut v = vec![f16::ZERO; n];
            comm.recv(&mut v, from, data_tag)?;
            Tensor::from_vec(v, dims, device)?
        }
        2 => {
            let mut v = vec![bf16::ZERO; n];
            comm.recv(&mut v, from, data_tag)?;
            Tensor::from_vec(v, dims, device)?
        }
        c => {
            return Err(ParallelError::Config(format!(
                "rank {from} sent a tensor of unknown dtype code {c}"
            )))
        }
    };
    Ok(t)
}

/// What one rank's [`DataParallel::pipeline_step`] did, for measuring a schedule: each action
/// with its start and end (seconds from the step's start), the step's length, and the most
/// micro-batches whose activations the rank held at once.
#[derive(Debug, Clone, Default)]
pub struct PipelineTrace {
    /// Each action of the rank's list, with its start and end in seconds.
    pub spans: Vec<(Action, f64, f64)>,
    /// Seconds from the first action's start to the last one's end.
    pub step_s: f64,
    /// The most forwards whose backward (or weight gradient) had not run yet, at once.
    pub peak_in_flight: usize,
    /// Segments whose weight gradients a `BackwardWeight` computed (kiln's linear layers'
    /// `dW` held back from the input pass), not only accumulated: zero without a zero-bubble
    /// schedule, and where candle's backward runs a stage (a GPU).
    pub weight_segments: usize,
}

impl PipelineTrace {
    /// Seconds spent in forwards and backwards (not in sends, receives or waiting).
    pub fn compute_s(&self) -> f64 {
        self.spans
            .iter()
            .filter(|(a, _, _)| a.compute().is_some())
            .map(|(_, s, e)| e - s)
            .sum()
    }
}

fn missing(what: &str, a: &Action) -> ParallelError {
    ParallelError::Config(format!("pipeline action {a:?}: {what}"))
}

impl DataParallel {
    /// One optimizer step's forward and backward as `schedule` orders them on this rank
    /// (this engine's stage, [`DataParallel::with_pipeline`]): `chunks[c]` are the segments of
    /// the rank's chunk `c` (its model stage `c * pp + rank`), `micro_batches` the step's
    /// micro-batches (the same on every stage of a pipeline: the first reads the inputs, the
    /// last the targets). Activations and their gradients go over the pipeline group. Follow
    /// with [`DataParallel::apply`] or [`DataParallel::discard`], as after
    /// [`DataParallel::backward`].
    pub fn pipeline_step<M: SegmentedModel + ?Sized>(
        &mut self,
        model: &M,
        schedule: &Schedule,
        chunks: &[Range<usize>],
        micro_batches: &[MicroBatch],
        scaler: &mut dyn LossScaler,
    ) -> Result<StepPreview> {
        let comm = match &self.pipeline {
            Some(link) => link.comm.clone(),
            None => {
                return Err(ParallelError::Config(
                    "pipeline_step needs with_pipeline first".into(),
                ))
            }
        };
        let (rank, stages) = (comm.rank(), comm.world_size());
        let spec = schedule.spec;
        if spec.stages != stages {
            return Err(ParallelError::Config(format!(
                "the schedule is for {} stages, the pipeline group has {stages}",
                spec.stages
            )));
        }
        if spec.micro_batches != micro_batches.len() {
            return Err(ParallelError::Config(format!(
                "the schedule is for {} micro-batches, the step has {}",
                spec.micro_batches,
                micro_batches.len()
            )));
        }
        if chunks.len() != spec.virtual_stages {
            return Err(ParallelError::Config(format!(
                "the schedule gives each rank {} chunks, this rank has segments for {}",
                spec.virtual_stages,
                chunks.len()
            )));
        }
        let n = model.num_segments();
        let device = self.device.clone();
        self.pipeline_begin(scaler)?;
        let mut saved: HashMap<(usize, usize), Forwarded> = HashMap::new();
        let mut outputs: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut inputs: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut grads_out: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut grads_in: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut deferred: HashMap<(usize, usize), DeferredGrads> = HashMap::new();
        let mut trace = PipelineTrace::default();
        let t0 = std::time::Instant::now();
        for a in &schedule.ranks[rank] {
            let started = t0.elapsed().as_secs_f64();
            let (mb, chunk) = (a.mb(), a.chunk());
            let key = (mb, chunk);
            let segs = chunks
                .get(chunk)
                .cloned()
                .ok_or_else(|| missing("no such chunk on this rank", a))?;
            let batch = micro_batches
                .get(mb)
                .ok_or_else(|| missing("no such micro-batch", a))?;
            let stage = spec.stage_of(rank, chunk);
            match *a {
                Action::Forward { .. } => {
                    let input = if segs.start == 0 {
                        batch.inputs().clone()
                    } else {
                        inputs
                            .remove(&key)
                            .ok_or_else(|| missing("its activation was not received", a))?
                    };
                    let f = self.pipeline_forward(model, segs.clone(), input, batch)?;
                    if segs.end < n {
                        outputs.insert(key, f.output.clone());
                    }
                    saved.insert(key, f);
                }
                Action::Backward { .. } | Action::BackwardInput { .. } => {
                    let f = saved
                        .remove(&key)
                        .ok_or_else(|| missing("no forward to go back through", a))?;
                    let grad_output =
                        if segs.end == n {
                            None
                        } else {
                            Some(grads_in.remove(&key).ok_or_else(|| {
                                missing("its output gradient was not received", a)
                            })?)
                        };
                    let grad_input = if matches!(a, Action::Backward { .. }) {
                        self.pipeline_backward(model, f, grad_output, batch)?
                    } else {
                        let mut d = DeferredGrads::default();
                        let g = self.pipeline_backward_input(
                            model,
                            f,
                            grad_output,
                            batch,
                            Some(&mut d),
                        )?;
                        deferred.insert(key, d);
                        g
                    };
                    if segs.start > 0 {
                        let g = grad_input
                            .ok_or_else(|| missing("the backward gave no input gradient", a))?;
                        grads_out.insert(key, g);
                    }
                }
                Action::BackwardWeight { .. } => {
                    let d = deferred
                        .remove(&key)
                        .ok_or_else(|| missing("no input-gradient pass before it", a))?;
                    trace.weight_segments += d.to_compute();
                    self.pipeline_weight_grads(d)?;
                }
                Action::SendActivation { to, .. } => {
                    let t = outputs
                        .remove(&key)
                        .ok_or_else(|| missing("no output to send", a))?;
                    send_tensor(&*comm, &t, to, 0, stage, mb)?;
                }
                Action::RecvActivation { from, .. } => {
                    let t = recv_tensor(&*comm, from, 0, stage.wrapping_sub(1), mb, &device)?;
                    inputs.insert(key, t);
                }
                Action::SendGrad { to, .. } => {
                    let t = grads_out
                        .remove(&key)
                        .ok_or_else(|| missing("no input gradient to send", a))?;
                    send_tensor(&*comm, &t, to, 1, stage.wrapping_sub(1), mb)?;
                }
                Action::RecvGrad { from, .. } => {
                    let t = recv_tensor(&*comm, from, 1, stage, mb, &device)?;
                    grads_in.insert(key, t);
                }
            }
            trace.peak_in_flight = trace.peak_in_flight.max(saved.len() + deferred.len());
            trace.spans.push((*a, started, t0.elapsed().as_secs_f64()));
        }
        trace.step_s = t0.elapsed().as_secs_f64();
        if let Some(link) = self.pipeline.as_mut() {
            link.trace = Some(trace);
        }
        let left = saved.len() + outputs.len() + inputs.len() + grads_out.len();
        if left + grads_in.len() + deferred.len() > 0 {
            return Err(ParallelError::Config(format!(
                "rank {rank}'s schedule left work undone: {} forwards without backward, {} \
                 unsent outputs, {} unused inputs, {} unsent gradients, {} unused gradients, {} \
                 weight gradients not taken",
                saved.len(),
                outputs.len(),
                inputs.len(),
                grads_out.len(),
                grads_in.len(),
                deferred.len()
            )));
        }
        self.pipeline_finish(micro_batches.len(), scaler)
    }

    /// What this rank's last [`DataParallel::pipeline_step`] did (its actions' times and the
    /// activations it held at most).
    pub fn last_pipeline_trace(&self) -> Option<&PipelineTrace> {
        self.pipeline.as_ref().and_then(|l| l.trace.as_ref())
    }
}
