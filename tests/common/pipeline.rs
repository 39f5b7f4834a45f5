//! One rank of a `dp x tp x pp` pipelined GPT run, for the thread and the MPI pipeline suites:
//! every rank builds the model, its engine holds the parameters of its stage's chunks, and the
//! step runs the schedule's action list.

use super::equivalence::tokens;
use candle_core::DType;
use kiln_comm::Communicator;
use kiln_memory::MicroBatch;
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::pipeline::{PipelineSpec, Schedule, ScheduleKind};
use kiln_parallel::{stage_segments, DataParallel, DataParallelConfig, ParallelDims, StageSplit};
use kiln_precision::{DynamicLossScaler, LossScaler, NoScaler};
use std::sync::Arc;

/// A pipelined run's layout and schedule.
#[derive(Debug, Clone, Copy)]
pub struct PipeRun {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub kind: ScheduleKind,
    pub virtual_stages: usize,
    pub micro_batches: usize,
    pub fp16: bool,
    pub steps: usize,
}

/// What one rank saw: its pipeline coordinates, its stage's parameters (its tp shard, whole
/// over dp) after the run, the losses and gradient norms of every step, and the steps the
/// loss scaler skipped.
#[derive(Debug, Clone)]
pub struct PipeRankRun {
    pub pp_rank: usize,
    pub dp_rank: usize,
    pub tp_rank: usize,
    pub params: Vec<(String, Vec<f32>)>,
    pub losses: Vec<f32>,
    pub norms: Vec<Option<f64>>,
    pub skipped: Vec<usize>,
    /// Segments whose weight gradients a `BackwardWeight` computed, over the steps.
    pub weight_segments: usize,
}

/// The model with an overflow injected into the backward of one segment: its output is
/// `y + (y - y.detach()) * 1e38` in f32, the same values forward and a gradient that overflows
/// to infinity backward, on the parameters of that segment (and, through its input gradient,
/// the segments before it only).
struct Poisoned<'a> {
    inner: &'a Gpt,
    segment: Option<usize>,
}

impl kiln_memory::SegmentedModel for Poisoned<'_> {
    fn num_segments(&self) -> usize {
        self.inner.num_segments()
    }

    fn forward_segment(
        &self,
        i: usize,
        input: &candle_core::Tensor,
        batch: &MicroBatch,
        params: &kiln_memory::SegmentParams,
    ) -> candle_core::Result<candle_core::Tensor> {
        let y = self.inner.forward_segment(i, input, batch, params)?;
        if self.segment != Some(i) {
            return Ok(y);
        }
        let dt = y.dtype();
        let z = (y.to_dtype(DType::F32)? - y.detach().to_dtype(DType::F32)?)?
            .affine(1e38, 0.0)?
            .to_dtype(dt)?;
        y + z
    }
}

/// One rank of `run` over `world` (`dp * tp * pp` ranks). `overflow` = `(step, segment)` makes
/// that segment's backward overflow at that step (see [`Poisoned`]).
pub fn train_pipeline_rank(
    world: Arc<dyn Communicator>,
    cfg: &GptConfig,
    run: PipeRun,
    dpc: DataParallelConfig,
    overflow: Option<(usize, usize)>,
) -> anyhow::Result<PipeRankRun> {
    let PipeRun {
        dp,
        tp,
        pp,
        kind,
        virtual_stages: v,
        micro_batches: m,
        fp16,
        steps,
    } = run;
    let dims = ParallelDims::with_pipeline(dp, tp, pp, dp * tp * pp, &cfg.shape())?;
    let groups = dims.build_groups(&*world)?;
    let r = world.rank();
    let (pr, dr, tr) = (dims.pp_rank(r), dims.dp_rank(r), dims.tp_rank(r));
    let tp_comm: Arc<dyn Communicator> = Arc::from(groups.tp);
    let mut opts = GptOptions::seeded(3);
    if fp16 {
        opts = opts.with_compute_dtype(DType::F16);
    }
    let model = Gpt::tensor_parallel(cfg, &opts, tp_comm.clone())?;
    let spec = PipelineSpec {
        stages: pp,
        virtual_stages: v,
        micro_batches: m,
    };
    let schedule = Schedule::build(kind, spec)?;
    let stages = stage_segments(&cfg.shape(), pp * v, &StageSplit::Balanced)?;
    let chunks: Vec<_> = (0..v)
        .map(|c| stages[spec.stage_of(pr, c)].clone())
        .collect();
    let mut lists = model.segment_param_lists();
    for (i, l) in lists.iter_mut().enumerate() {
        if !chunks.iter().any(|c| c.contains(&i)) {
            l.clear();
        }
    }
    let held: std::collections::HashSet<String> =
        lists.iter().flatten().map(|(n, _)| n.clone()).collect();
    let splits: Vec<_> = model
        .param_splits()
        .into_iter()
        .filter(|(n, _)| held.contains(n))
        .collect();
    // a tied head reads the first stage's embedding on the last stage; an untied one (Llama)
    // shares nothing between stages
    let (emb, tied): (Option<Arc<dyn Communicator>>, &[&str]) = if cfg.tied_embeddings {
        (groups.embedding.map(Arc::from), &["wte"])
    } else {
        (None, &[])
    };
    let mut engine = DataParallel::new(&lists, &*groups.dp, dpc)?
        .with_world(world.clone())
        .with_param_splits(&splits)?
        .with_tensor_parallel(tp_comm)
        .with_pipeline(Arc::from(groups.pp), emb, tied)?;
    let mut scaler: Box<dyn LossScaler> = if fp16 {
        Box::new(DynamicLossScaler::new(Default::default())?)
    } else {
        Box::new(NoScaler)
    };
    // per step: 2 sequences per micro-batch per data-parallel rank
    let per = 2;
    let mut out = PipeRankRun {
        pp_rank: pr,
        dp_rank: dr,
        tp_rank: tr,
        params: Vec::new(),
        losses: Vec::new(),
        norms: Vec::new(),
        skipped: Vec::new(),
        weight_segments: 0,
    };
    for s in 0..steps {
        let (x, y) = tokens(per * dp * m, 16, cfg.vocab_size, s % 3);
        let mut mbs = Vec::with_capacity(m);
        for k in 0..m {
            let lo = (k * dp + dr) * per;
            mbs.push(MicroBatch::new(
                x.narrow(0, lo, per)?,
                y.narrow(0, lo, per)?,
            )?);
        }
        let poisoned = Poisoned {
            inner: &model,
            segment: overflow.filter(|&(step, _)| step == s).map(|(_, seg)| seg),
        };
        let preview = engine.pipeline_step(&poisoned, &schedule, &chunks, &mbs, &mut *scaler)?;
        out.weight_segments += engine
            .last_pipeline_trace()
            .map_or(0, |t| t.weight_segments);
        out.losses.push(preview.loss);
        out.norms.push(preview.grad_norm);
        if preview.found_inf {
            out.skipped.push(s);
            engine.discard()?;
        } else {
            engine.apply(3e-3)?;
        }
    }
    out.params = engine.full_params()?;
    Ok(out)
}
