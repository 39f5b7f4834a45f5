//! Planning (which samples go in batch k) and loading (reading and transforming them), shared by
//! the loader's synchronous path and its worker threads.

use crate::batch::Batch;
use crate::cache::ChunkCache;
use crate::error::{DataError, Result};
use crate::mixture::Mixture;
use crate::sample::{SampleId, SkipSet};
use crate::sampler::{Cursor, DistributedSampler, PlannedSample};
use crate::source::TokenSource;
use crate::transform::{apply_transforms, SampleView, Transform};
use std::sync::Arc;

/// Where planning stands after a batch: what [`crate::LoaderState`] records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PlanPos {
    pub step: u64,
    pub cursors: Vec<Cursor>,
}

/// One rank's batch to load.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub step: u64,
    pub samples: Vec<PlannedSample>,
    pub after: PlanPos,
}

#[derive(Debug, Clone)]
pub(crate) enum PlanKind {
    /// One source: epochs with a tail policy.
    Single(DistributedSampler),
    /// Several sources drawn by weight.
    Mix(Mixture),
}

/// Produces the jobs of one rank in order.
#[derive(Debug, Clone)]
pub(crate) struct Planner {
    pub kind: PlanKind,
    pub skip: SkipSet,
    pub step: u64,
    pub dp: usize,
    pub rank: usize,
    pub batch: usize,
}

impl Planner {
    pub fn pos(&self) -> PlanPos {
        let cursors = match &self.kind {
            PlanKind::Single(s) => vec![s.cursor()],
            PlanKind::Mix(m) => m.cursors().to_vec(),
        };
        PlanPos {
            step: self.step,
            cursors,
        }
    }

    /// Plans the next global batch and returns this rank's slice of it.
    pub fn next(&mut self) -> Result<Job> {
        let g = self.dp * self.batch;
        let step = self.step;
        let mut samples = match &mut self.kind {
            PlanKind::Single(s) => s.next_global_batch(&self.skip)?.samples,
            PlanKind::Mix(m) => m.next_global_batch(g, &self.skip)?,
        };
        self.step += 1;
        let lo = self.rank * self.batch;
        let samples: Vec<PlannedSample> = samples.drain(lo..lo + self.batch).collect();
        Ok(Job {
            step,
            samples,
            after: self.pos(),
        })
    }
}

/// What loading needs, shared by all workers.
#[derive(Clone)]
pub(crate) struct LoadCtx {
    pub sources: Vec<TokenSource>,
    pub cache: Arc<ChunkCache>,
    pub transforms: Vec<Arc<dyn Transform>>,
    pub seed: u64,
    pub ctx: usize,
}

/// Reads and transforms a job's samples; `on_sample` is told each sample before it is read.
/// An error comes with the sample it happened on.
pub(crate) fn load_batch(
    lc: &LoadCtx,
    job: &Job,
    mut on_sample: impl FnMut(SampleId),
) -> std::result::Result<Batch, (Option<SampleId>, DataError)> {
    let t = lc.ctx;
    let b = job.samples.len();
    let mut inputs = vec![0u32; b * t];
    let mut targets = vec![0u32; b * t];
    let mut window = vec![0u32; t + 1];
    for (r, p) in job.samples.iter().enumerate() {
        on_sample(p.id);
        let err = |e| (Some(p.id), e);
        let source = lc.sources.get(p.id.source as usize).ok_or_else(|| {
            err(DataError::OutOfRange {
                what: "source",
                index: p.id.source as u64,
                len: lc.sources.len() as u64,
            })
        })?;
        source
            .read_sample(p.id.index, t, &mut window, Some(&lc.cache))
            .map_err(err)?;
        let (inp, tgt) = (
            &mut inputs[r * t..(r + 1) * t],
            &mut targets[r * t..(r + 1) * t],
        );
        inp.copy_from_slice(&window[..t]);
        tgt.copy_from_slice(&window[1..]);
        if !lc.transforms.is_empty() {
            let mut view = SampleView {
                id: p.id,
                epoch: p.epoch,
                inputs: inp,
                targets: tgt,
            };
            apply_transforms(&lc.transforms, lc.seed, &mut view).map_err(err)?;
        }
    }
    Ok(Batch {
        step: job.step,
        batch_size: b,
        ctx: t,
        inputs,
        targets,
        sample_ids: job.samples.iter().map(|p| p.id).collect(),
        epochs: job.samples.iter().map(|p| p.epoch).collect(),
    })
}
