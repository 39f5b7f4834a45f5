//! The data loader: sources, sampler or mixture, transforms and prefetching behind one
//! `next_batch`, with a state that resumes bitwise.

use crate::batch::Batch;
use crate::cache::{ChunkCache, ChunkCacheStats};
use crate::error::{DataError, Result};
use crate::mixture::{Mixture, WeightChange};
use crate::plan::{load_batch, Job, LoadCtx, PlanKind, PlanPos, Planner};
use crate::prefetch::Prefetcher;
use crate::sample::{SampleId, SkipSet};
use crate::sampler::{Cursor, DistributedSampler, SamplerConfig, TailPolicy};
use crate::source::TokenSource;
use crate::state::{LoaderState, SourceState, LOADER_STATE_VERSION};
use crate::transform::Transform;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a [`DataLoader`] reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderConfig {
    /// Input tokens per sample (a sample reads `ctx + 1` tokens).
    pub ctx: usize,
    /// Samples per batch on this rank.
    pub batch_size: usize,
    /// Data-parallel group size.
    pub dp: usize,
    /// This rank in the group.
    pub rank: usize,
    /// Seed of the order, the mixture draws and the transforms.
    pub seed: u64,
    /// End-of-epoch policy when there is one source (a mixture's sources run from one epoch
    /// into the next).
    pub tail: TailPolicy,
    /// Background worker threads; 0 loads on the calling thread.
    pub workers: usize,
    /// Batches staged ahead of the consumer (the bounded channel's capacity), at least 1.
    pub prefetch: usize,
    /// How long `next_batch` waits for a batch before reporting a stall.
    pub stall_timeout: Duration,
    /// Tokens per cached shard chunk.
    pub chunk_tokens: usize,
    /// Chunks kept in the LRU cache (0 disables it).
    pub cache_chunks: usize,
    /// Whether a state saved with another dp size or batch size may be loaded (resharding).
    pub allow_reshard: bool,
}

impl LoaderConfig {
    /// Defaults for one rank: seed 0, drop the tail, 1 worker (one keeps up with tens of
    /// millions of tokens per second; see `bench/src/bin/bench_data.rs`), 8 batches staged, 60 s
    /// stall timeout, 64 chunks of 64 Ki tokens cached, resharding allowed.
    pub fn new(ctx: usize, batch_size: usize) -> Self {
        LoaderConfig {
            ctx,
            batch_size,
            dp: 1,
            rank: 0,
            seed: 0,
            tail: TailPolicy::Drop,
            workers: 1,
            prefetch: 8,
            stall_timeout: Duration::from_secs(60),
            chunk_tokens: 1 << 16,
            cache_chunks: 64,
            allow_reshard: true,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.ctx == 0 {
            return Err(DataError::config("ctx", "0 tokens per sample"));
        }
        if self.batch_size == 0 {
            return Err(DataError::config("batch_size", "0 samples per batch"));
        }
        if self.dp == 0 || self.rank >= self.dp {
            return Err(DataError::config(
                "rank",
                format!(
                    "rank {} is not in a data-parallel group of {}",
                    self.rank, self.dp
                ),
            ));
        }
        if self.prefetch == 0 {
            return Err(DataError::config("prefetch", "0 staged batches"));
        }
        if self.stall_timeout.is_zero() {
            return Err(DataError::config("stall_timeout", "zero"));
        }
        Ok(())
    }
}

/// Counters of a [`DataLoader`]: its three cache levels and the time spent waiting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoaderStats {
    /// Batches delivered.
    pub batches: u64,
    /// Batches that were staged already when asked for (top level hit).
    pub staged_hits: u64,
    /// Batches the caller had to wait for (or that loaded on its thread).
    pub staged_misses: u64,
    /// Time spent inside `next_batch`.
    pub wait: Duration,
    /// The chunk cache (middle level; its misses read the memory-mapped files).
    pub chunks: ChunkCacheStats,
}

/// A deterministic, resumable, prefetching loader of token batches for one data-parallel rank.
///
/// With one source, batches follow a [`DistributedSampler`] (epochs, tail policy); with several,
/// a [`Mixture`] whose weights can change during training. Samples are read through a shared
/// [`ChunkCache`] over the memory-mapped shards, transformed on the worker threads, and handed
/// out in the same order whatever the number of workers. [`DataLoader::loader_state`] after batch k,
/// loaded into a fresh loader, continues with batch k + 1 bitwise as the uninterrupted loader
/// would have.
///
/// With `workers == 0` batches load on the calling thread; errors then name worker 0.
pub struct DataLoader {
    cfg: LoaderConfig,
    lc: Arc<LoadCtx>,
    state: LoaderState,
    /// The planner of the synchronous path, kept between calls.
    sync_planner: Option<Planner>,
    pipeline: Option<Prefetcher>,
    stats: LoaderStats,
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("cfg", &self.cfg)
            .field("state", &self.state)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

fn sizes_of(sources: &[TokenSource], ctx: usize) -> Result<Vec<u64>> {
    sources
        .iter()
        .map(|s| {
            let n = s.num_samples(ctx);
            if n == 0 {
                Err(DataError::SourceTooSmall {
                    name: s.name().to_string(),
                    tokens: s.tokens(),
                    needed: ctx as u64 + 1,
                })
            } else {
                Ok(n)
            }
        })
        .collect()
}

impl DataLoader {
    /// A loader at the start of training. `weights` (one per source) are required to be
    /// valid when given; with several sources and `None` every source has weight 1. With one
    /// source they are unused.
    pub fn new(
        sources: Vec<TokenSource>,
        weights: Option<&[f64]>,
        cfg: LoaderConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        if sources.is_empty() {
            return Err(DataError::config("sources", "no source"));
        }
        let sizes = sizes_of(&sources, cfg.ctx)?;
        let history = if sources.len() == 1 {
            if let Some(w) = weights.filter(|w| w.len() != 1) {
                return Err(DataError::config(
                    "weights",
                    format!("{} weights for 1 source", w.len()),
                ));
            }
            Mixture::new(sizes.clone(), &[1.0], cfg.seed)?
                .history()
                .to_vec()
        } else {
            let equal = vec![1.0; sources.len()];
            Mixture::new(sizes.clone(), weights.unwrap_or(&equal), cfg.seed)?
                .history()
                .to_vec()
        };
        let state = LoaderState {
            version: LOADER_STATE_VERSION,
            seed: cfg.seed,
            ctx: cfg.ctx,
            dp: cfg.dp,
            rank: cfg.rank,
            batch_size: cfg.batch_size,
            tail: cfg.tail,
            step: 0,
            sources: sources
                .iter()
                .zip(&sizes)
                .map(|(s, &n)| SourceState {
                    name: s.name().to_string(),
                    samples: n,
                    cursor: Cursor::default(),
                })
                .collect(),
            weights_history: history,
            skip: SkipSet::new(),
        };
        let lc = Arc::new(LoadCtx {
            sources,
            cache: Arc::new(ChunkCache::new(cfg.chunk_tokens, cfg.cache_chunks)),
            transforms: Vec::new(),
            seed: cfg.seed,
            ctx: cfg.ctx,
        });
        let loader = DataLoader {
            cfg,
            lc,
            state,
            sync_planner: None,
            pipeline: None,
            stats: LoaderStats::default(),
        };
        // fail now on a plan that cannot produce a batch (e.g. fewer samples than a batch)
        loader.planner()?;
        Ok(loader)
    }

    /// A loader restored from `state` (see [`DataLoader::load_loader_state`]).
    pub fn restore(
        sources: Vec<TokenSource>,
        weights: Option<&[f64]>,
        cfg: LoaderConfig,
        state: LoaderState,
    ) -> Result<Self> {
        let mut l = Self::new(sources, weights, cfg)?;
        l.load_loader_state(state)?;
        Ok(l)
    }

    /// Adds a transform to the chain applied to every sample on the loader threads.
    /// Batches already staged are discarded and re-made with it.
    pub fn add_transform(&mut self, t: Arc<dyn Transform>) {
        self.reset_pipeline();
        let mut lc = LoadCtx::clone(&self.lc);
        lc.transforms.push(t);
        self.lc = Arc::new(lc);
    }

    /// The configuration.
    pub fn config(&self) -> &LoaderConfig {
        &self.cfg
    }

    /// The sources.
    pub fn sources(&self) -> &[TokenSource] {
        &self.lc.sources
    }

    fn planner(&self) -> Result<Planner> {
        let s = &self.state;
        let kind = if self.lc.sources.len() == 1 {
            let mut sampler = DistributedSampler::new(SamplerConfig {
                num_samples: s.sources[0].samples,
                dp: self.cfg.dp,
                rank: self.cfg.rank,
                batch_size: self.cfg.batch_size,
                seed: s.seed,
                tail: s.tail,
            })?;
            sampler.set_cursor(s.sources[0].cursor);
            PlanKind::Single(sampler)
        } else {
            PlanKind::Mix(Mixture::from_parts(
                s.sources.iter().map(|x| x.samples).collect(),
                s.seed,
                s.step,
                s.sources.iter().map(|x| x.cursor).collect(),
                s.weights_history.clone(),
            )?)
        };
        Ok(Planner {
            kind,
            skip: s.skip.clone(),
            step: s.step,
            dp: self.cfg.dp,
            rank: self.cfg.rank,
            batch: self.cfg.batch_size,
        })
    }

    fn reset_pipeline(&mut self) {
        self.pipeline = None;
        self.sync_planner = None;
    }

    /// The next batch of this rank.
    pub fn next_batch(&mut self) -> Result<Batch> {
        let t0 = Instant::now();
        let res = self.next_inner();
        self.stats.wait += t0.elapsed();
        match res {
            Ok((batch, pos, staged)) => {
                self.state.step = pos.step;
                for (s, c) in self.state.sources.iter_mut().zip(pos.cursors) {
                    s.cursor = c;
                }
                self.stats.batches += 1;
                if staged {
                    self.stats.staged_hits += 1;
                } else {
                    self.stats.staged_misses += 1;
                }
                Ok(batch)
            }
            Err(e) => {
                // A stall may still resolve; anything else restarts from the last batch
                // delivered on the next call.
                if !matches!(e, DataError::Stalled { .. }) {
                    self.reset_pipeline();
                }
                Err(e)
            }
        }
    }

    fn next_inner(&mut self) -> Result<(Batch, PlanPos, bool)> {
        if self.cfg.workers == 0 {
            let mut planner = match self.sync_planner.take() {
                Some(p) => p,
                None => self.planner()?,
            };
            let job: Job = planner.next()?;
            let batch =
                load_batch(&self.lc, &job, |_| {}).map_err(|(sample, e)| DataError::Worker {
                    worker: 0,
                    batch: job.step,
                    sample,
                    source: Box::new(e),
                })?;
            self.sync_planner = Some(planner);
            return Ok((batch, job.after, false));
        }
        if self.pipeline.is_none() {
            self.pipeline = Some(Prefetcher::start(
                self.lc.clone(),
                self.planner()?,
                self.cfg.workers,
                self.cfg.prefetch,
                self.cfg.stall_timeout,
            )?);
        }
        match self.pipeline.as_mut() {
            Some(p) => p.next(),
            None => Err(DataError::PipelineClosed {
                batch: self.state.step,
            }),
        }
    }

    /// The state after the last batch delivered, with this loader's dp, rank and batch size.
    pub fn loader_state(&self) -> LoaderState {
        let mut s = self.state.clone();
        s.dp = self.cfg.dp;
        s.rank = self.cfg.rank;
        s.batch_size = self.cfg.batch_size;
        s
    }

    /// Continues from a saved state. The seed, ctx, tail policy and sources (names and sample
    /// counts) must match ([`DataError::StateMismatch`] names the field). A state saved with
    /// another dp size or per-rank batch size is resharded when `allow_reshard` is set: the
    /// cursors count samples across the whole group, so the next global batch is the next
    /// `dp * batch_size` samples of the same order and no sample is lost or repeated within the
    /// epoch; otherwise it is [`DataError::DpMismatch`] naming saved and current dp.
    pub fn load_loader_state(&mut self, state: LoaderState) -> Result<()> {
        let mismatch = |field, saved: String, current: String| DataError::StateMismatch {
            field,
            saved,
            current,
        };
        if state.version != LOADER_STATE_VERSION {
            return Err(mismatch(
                "version",
                state.version.to_string(),
                LOADER_STATE_VERSION.to_string(),
            ));
        }
        if state.seed != self.cfg.seed {
            return Err(mismatch(
                "seed",
                state.seed.to_string(),
                self.cfg.seed.to_string(),
            ));
        }
        if state.ctx != self.cfg.ctx {
            return Err(mismatch(
                "ctx",
                state.ctx.to_string(),
                self.cfg.ctx.to_string(),
            ));
        }
        if state.tail != self.cfg.tail {
            return Err(mismatch(
                "tail",
                format!("{:?}", state.tail),
                format!("{:?}", self.cfg.tail),
            ));
        }
        let names = |v: Vec<(&str, u64)>| format!("{v:?}");
        let saved: Vec<(&str, u64)> = state
            .sources
            .iter()
            .map(|s| (&s.name[..], s.samples))
            .collect();
        let current: Vec<(&str, u64)> = self
            .state
            .sources
            .iter()
            .map(|s| (&s.name[..], s.samples))
            .collect();
        if saved != current {
            return Err(mismatch("sources", names(saved), names(current)));
        }
        if (state.dp, state.batch_size) != (self.cfg.dp, self.cfg.batch_size)
            && !self.cfg.allow_reshard
        {
            return Err(DataError::DpMismatch {
                saved_dp: state.dp,
                current_dp: self.cfg.dp,
                saved_batch: state.batch_size,
                current_batch: self.cfg.batch_size,
            });
        }
        let old = std::mem::replace(&mut self.state, state);
        if let Err(e) = self.planner() {
            self.state = old;
            return Err(e);
        }
        self.reset_pipeline();
        Ok(())
    }

    /// Changes the mixture weights from the next batch on (several sources only). Batches
    /// already staged are discarded and re-drawn.
    pub fn set_weights(&mut self, weights: &[f64]) -> Result<()> {
        if self.lc.sources.len() == 1 {
            return Err(DataError::config(
                "weights",
                "a single source has no mixture weights",
            ));
        }
        let s = &self.state;
        let mut m = Mixture::from_parts(
            s.sources.iter().map(|x| x.samples).collect(),
            s.seed,
            s.step,
            s.sources.iter().map(|x| x.cursor).collect(),
            s.weights_history.clone(),
        )?;
        m.set_weights(weights)?;
        self.state.weights_history = m.history().to_vec();
        self.reset_pipeline();
        Ok(())
    }

    /// The mixture weights in effect (`[1.0]` for one source).
    pub fn weights(&self) -> &[f64] {
        self.state
            .weights_history
            .last()
            .map_or(&[], |w: &WeightChange| &w.weights[..])
    }

    /// Never yields these samples from the next batch on (batches already staged are re-made).
    pub fn skip_samples(&mut self, ids: impl IntoIterator<Item = SampleId>) {
        self.state.skip_samples(ids);
        self.reset_pipeline();
    }

    /// Never yields windows `range` of `source` from the next batch on.
    pub fn skip_range(&mut self, source: u32, range: Range<u64>) {
        self.state.skip_range(source, range);
        self.reset_pipeline();
    }

    /// The epoch the next batch comes from (one source), or the first source's epoch.
    pub fn epoch(&self) -> u64 {
        match self.planner().map(|p| p.kind) {
            Ok(PlanKind::Single(s)) => s.epoch(&self.state.skip),
            _ => self.state.epoch(),
        }
    }

    /// Batches per epoch on every rank (one source; `None` for a mixture, whose sources run
    /// through epochs at their own pace).
    pub fn batches_per_epoch(&self) -> Option<u64> {
        match self.planner().map(|p| p.kind) {
            Ok(PlanKind::Single(s)) => Some(s.batches_per_epoch(&self.state.skip)),
            _ => None,
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> LoaderStats {
        LoaderStats {
            chunks: self.lc.cache.stats(),
            ..self.stats
        }
    }
}

impl Iterator for DataLoader {
    type Item = Result<Batch>;

    /// Endless: the loader starts the next epoch after each.
    fn next(&mut self) -> Option<Self::Item> {
        Some(self.next_batch())
    }
}
