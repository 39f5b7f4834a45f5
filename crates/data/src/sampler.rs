//! Which samples each data-parallel rank reads: a fresh permutation every epoch, cut into global
//! batches, each rank taking its own disjoint slice of every global batch.

use crate::error::{DataError, Result};
use crate::rng::{stream_key, Permutation, Purpose};
use crate::sample::{SampleId, SkipSet};
use serde::{Deserialize, Serialize};

/// What to do with the samples left at the end of an epoch that do not fill a global batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum TailPolicy {
    /// Leave them out: every batch holds distinct samples; `n mod (dp * batch)` samples (a
    /// different set each epoch, since the order is reshuffled) are not seen in that epoch.
    #[default]
    Drop,
    /// Complete the last batch with samples from the start of the same epoch's order: every
    /// sample is seen at least once per epoch, the first few of that order twice.
    Wrap,
}

/// A position in a source's sample order: `pos` samples of epoch `epoch`'s permutation taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Cursor {
    /// The epoch.
    pub epoch: u64,
    /// Samples of that epoch's order consumed (skipped ones included).
    pub pos: u64,
}

/// One sample chosen for a batch, with the epoch of the order it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedSample {
    /// The sample.
    pub id: SampleId,
    /// Its epoch in its source (keys its augmentation).
    pub epoch: u64,
}

/// The permutation of source `source`'s `n` samples in `epoch`.
pub(crate) fn epoch_order(seed: u64, source: u32, epoch: u64, n: u64) -> Permutation {
    Permutation::new(
        n,
        stream_key(seed, Purpose::Permutation, &[source as u64, epoch]),
    )
}

/// Takes the next sample of an endless sequence of epochs (each a fresh permutation), passing
/// over skipped samples; an epoch's end runs straight into the next one.
pub(crate) fn next_carry(
    cursor: &mut Cursor,
    n: u64,
    seed: u64,
    source: u32,
    skip: &SkipSet,
) -> Result<PlannedSample> {
    let mut scanned = 0u64;
    let mut order = epoch_order(seed, source, cursor.epoch, n);
    loop {
        if cursor.pos >= n {
            cursor.epoch += 1;
            cursor.pos = 0;
            order = epoch_order(seed, source, cursor.epoch, n);
        }
        if scanned >= n {
            return Err(DataError::Exhausted {
                source_index: source as usize,
                samples: n,
                available: 0,
                needed: 1,
            });
        }
        let id = SampleId::new(source, order.apply(cursor.pos));
        cursor.pos += 1;
        scanned += 1;
        if !skip.contains(id) {
            return Ok(PlannedSample {
                id,
                epoch: cursor.epoch,
            });
        }
    }
}

/// Configuration of a [`DistributedSampler`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// Samples in the source.
    pub num_samples: u64,
    /// Data-parallel group size.
    pub dp: usize,
    /// This rank in the group.
    pub rank: usize,
    /// Samples per batch on each rank.
    pub batch_size: usize,
    /// The seed of the permutations.
    pub seed: u64,
    /// End-of-epoch policy.
    pub tail: TailPolicy,
}

/// A global batch: `dp * batch_size` samples, rank `r` taking `r*batch_size .. (r+1)*batch_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalBatch {
    /// The epoch it belongs to.
    pub epoch: u64,
    /// Its samples in order.
    pub samples: Vec<PlannedSample>,
    /// How many samples at its end were wrapped from the start of the epoch's order.
    pub wrapped: usize,
}

/// Splits one source's samples across the ranks of a data-parallel group, epoch by epoch.
///
/// Epoch `e` orders the samples by a permutation keyed by (seed, source, e); global batch `g`
/// of the epoch is the next `dp * batch_size` samples of that order, and rank `r` takes slice
/// `r` of it. Every rank therefore sees a disjoint set of samples, all ranks produce the same
/// number of batches per epoch (no rank runs out early and hangs a collective), and every
/// sample is seen exactly once per epoch across the group, up to the [`TailPolicy`]. Samples in
/// a [`SkipSet`] are passed over. The sampler is a cursor into this order: it can be saved
/// ([`DistributedSampler::cursor`]) and restored exactly.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    cfg: SamplerConfig,
    source: u32,
    cursor: Cursor,
}

impl DistributedSampler {
    /// A sampler at the start of epoch 0 over source 0. Rejects `dp == 0`, `rank >= dp`,
    /// `batch_size == 0`, no samples, and (with [`TailPolicy::Drop`]) fewer samples than one
    /// global batch.
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        if cfg.dp == 0 || cfg.rank >= cfg.dp {
            return Err(DataError::config(
                "rank",
                format!(
                    "rank {} is not in a data-parallel group of {}",
                    cfg.rank, cfg.dp
                ),
            ));
        }
        if cfg.batch_size == 0 {
            return Err(DataError::config("batch_size", "0 samples per batch"));
        }
        let g = (cfg.dp * cfg.batch_size) as u64;
        if cfg.num_samples == 0 || (cfg.tail == TailPolicy::Drop && cfg.num_samples < g) {
            return Err(DataError::Exhausted {
                source_index: 0,
                samples: cfg.num_samples,
                available: cfg.num_samples,
                needed: g,
            });
        }
        Ok(DistributedSampler {
            cfg,
            source: 0,
            cursor: Cursor::default(),
        })
    }

    /// The same sampler over source `source` (its samples' [`SampleId::source`], and the key of
    /// its permutations).
    pub fn with_source(mut self, source: u32) -> Self {
        self.source = source;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// `dp * batch_size`.
    pub fn global_batch_size(&self) -> usize {
        self.cfg.dp * self.cfg.batch_size
    }

    /// Batches per epoch on every rank, for an epoch read from its start with `skip`.
    pub fn batches_per_epoch(&self, skip: &SkipSet) -> u64 {
        let n = self.cfg.num_samples - skip.count_below(self.source, self.cfg.num_samples);
        let g = self.global_batch_size() as u64;
        match self.cfg.tail {
            TailPolicy::Drop => n / g,
            TailPolicy::Wrap => n.div_ceil(g),
        }
    }

    /// The position in the sample order (what a checkpoint saves).
    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// Moves to a saved position.
    pub fn set_cursor(&mut self, cursor: Cursor) {
        self.cursor = cursor;
    }

    /// The epoch the next batch will come from: the cursor's epoch, or the one after it when
    /// what is left of the cursor's epoch (outside `skip`) cannot start a batch under the tail
    /// policy.
    pub fn epoch(&self, skip: &SkipSet) -> u64 {
        let n = self.cfg.num_samples;
        let need = match self.cfg.tail {
            TailPolicy::Drop => self.global_batch_size() as u64,
            TailPolicy::Wrap => 1,
        };
        let order = epoch_order(self.cfg.seed, self.source, self.cursor.epoch, n);
        let mut found = 0u64;
        let mut pos = self.cursor.pos;
        while pos < n && found < need {
            if !skip.contains(SampleId::new(self.source, order.apply(pos))) {
                found += 1;
            }
            pos += 1;
        }
        if found < need {
            self.cursor.epoch + 1
        } else {
            self.cursor.epoch
        }
    }

    /// The next global batch, passing over samples in `skip`.
    pub fn next_global_batch(&mut self, skip: &SkipSet) -> Result<GlobalBatch> {
        let n = self.cfg.num_samples;
        let g = self.global_batch_size();
        let seed = self.cfg.seed;
        loop {
            if self.cursor.pos >= n {
                self.cursor = Cursor {
                    epoch: self.cursor.epoch + 1,
                    pos: 0,
                };
            }
            let from_start = self.cursor.pos == 0;
            let epoch = self.cursor.epoch;
            let order = epoch_order(seed, self.source, epoch, n);
            let mut samples = Vec::with_capacity(g);
            while samples.len() < g && self.cursor.pos < n {
                let id = SampleId::new(self.source, order.apply(self.cursor.pos));
                self.cursor.pos += 1;
                if !skip.contains(id) {
                    samples.push(PlannedSample { id, epoch });
                }
            }
            if samples.len() == g {
                return Ok(GlobalBatch {
                    epoch,
                    samples,
                    wrapped: 0,
                });
            }
            let available = n - skip.count_below(self.source, n);
            let exhausted = DataError::Exhausted {
                source_index: self.source as usize,
                samples: n,
                available,
                needed: g as u64,
            };
            match self.cfg.tail {
                TailPolicy::Drop => {
                    // the partial batch is dropped; an epoch that cannot fill one batch even
                    // from its start never will
                    if from_start {
                        return Err(exhausted);
                    }
                }
                TailPolicy::Wrap => {
                    if available == 0 {
                        return Err(exhausted);
                    }
                    if samples.is_empty() {
                        // the epoch ended exactly at the previous batch
                        continue;
                    }
                    let wrapped = g - samples.len();
                    let mut w = 0u64;
                    while samples.len() < g {
                        let id = SampleId::new(self.source, order.apply(w % n));
                        w += 1;
                        if !skip.contains(id) {
                            samples.push(PlannedSample { id, epoch });
                        }
                    }
                    return Ok(GlobalBatch {
                        epoch,
                        samples,
                        wrapped,
                    });
                }
            }
        }
    }

    /// This rank's next batch: its slice of the next global batch.
    pub fn next_batch(&mut self, skip: &SkipSet) -> Result<Vec<PlannedSample>> {
        let b = self.cfg.batch_size;
        let r = self.cfg.rank;
        let mut global = self.next_global_batch(skip)?;
        Ok(global.samples.drain(r * b..(r + 1) * b).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(n: u64, dp: usize, rank: usize, b: usize, tail: TailPolicy) -> SamplerConfig {
        SamplerConfig {
            num_samples: n,
            dp,
            rank,
            batch_size: b,
            seed: 42,
            tail,
        }
    }

    /// Runs every rank for `epochs` epochs; returns per-rank lists of (epoch, index).
    fn run(
        n: u64,
        dp: usize,
        b: usize,
        tail: TailPolicy,
        skip: &SkipSet,
        epochs: u64,
    ) -> Vec<Vec<(u64, u64)>> {
        (0..dp)
            .map(|r| {
                let mut s = DistributedSampler::new(cfg(n, dp, r, b, tail)).unwrap();
                let per = s.batches_per_epoch(skip);
                let mut seen = Vec::new();
                for e in 0..epochs {
                    for _ in 0..per {
                        assert_eq!(s.epoch(skip), e);
                        for p in s.next_batch(skip).unwrap() {
                            assert_eq!(p.epoch, e);
                            seen.push((e, p.id.index));
                        }
                    }
                }
                assert_eq!(
                    s.epoch(skip),
                    epochs,
                    "the epoch ends after batches_per_epoch batches"
                );
                seen
            })
            .collect()
    }

    #[test]
    fn every_sample_exactly_once_per_epoch_for_dp_1_to_4() {
        let skip = SkipSet::new();
        for dp in 1..=4usize {
            for (n, b) in [(48u64, 3usize), (50, 2), (37, 4), (7, 1)] {
                if (n as usize) < dp * b {
                    continue;
                }
                for tail in [TailPolicy::Drop, TailPolicy::Wrap] {
                    let seen = run(n, dp, b, tail, &skip, 3);
                    // equal batch counts on every rank
                    let lens: Vec<usize> = seen.iter().map(|v| v.len()).collect();
                    assert!(lens.iter().all(|&l| l == lens[0]), "{lens:?}");
                    let g = (dp * b) as u64;
                    for e in 0..3 {
                        let mut count: HashMap<u64, usize> = HashMap::new();
                        for v in &seen {
                            for &(ep, i) in v {
                                if ep == e {
                                    assert!(i < n);
                                    *count.entry(i).or_default() += 1;
                                }
                            }
                        }
                        let rem = n % g;
                        match tail {
                            TailPolicy::Drop => {
                                // each seen once; exactly n - n mod g of them
                                assert!(count.values().all(|&c| c == 1), "dp {dp} n {n} {count:?}");
                                assert_eq!(count.len() as u64, n - rem);
                            }
                            TailPolicy::Wrap => {
                                // each seen; g - rem of them twice (when rem > 0)
                                assert_eq!(count.len() as u64, n, "dp {dp} n {n}");
                                let twice = count.values().filter(|&&c| c == 2).count() as u64;
                                assert!(count.values().all(|&c| c <= 2));
                                assert_eq!(twice, if rem == 0 { 0 } else { g - rem });
                            }
                        }
                    }
                    // the order changes between epochs
                    let e0: Vec<u64> = seen[0].iter().filter(|x| x.0 == 0).map(|x| x.1).collect();
                    let e1: Vec<u64> = seen[0].iter().filter(|x| x.0 == 1).map(|x| x.1).collect();
                    if n >= 10 {
                        assert_ne!(e0, e1);
                    }
                }
            }
        }
    }

    #[test]
    fn skipped_samples_are_never_seen_and_counts_stay_equal() {
        let mut skip = SkipSet::new();
        skip.insert_range(0, 10..15);
        skip.insert(SampleId::new(0, 33));
        skip.insert(SampleId::new(1, 3)); // another source: no effect
        for dp in 1..=4usize {
            let seen = run(50, dp, 2, TailPolicy::Drop, &skip, 2);
            let per = DistributedSampler::new(cfg(50, dp, 0, 2, TailPolicy::Drop))
                .unwrap()
                .batches_per_epoch(&skip);
            assert_eq!(per, 44 / (2 * dp as u64));
            for v in &seen {
                assert_eq!(v.len() as u64, 2 * per * 2);
                assert!(v.iter().all(|&(_, i)| !(10..15).contains(&i) && i != 33));
            }
            let mut all: Vec<(u64, u64)> = seen.concat();
            let total = all.len();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), total, "no sample twice in an epoch");
        }
    }

    #[test]
    fn cursor_restores_the_same_sequence() {
        let mut a = DistributedSampler::new(cfg(23, 2, 1, 3, TailPolicy::Wrap)).unwrap();
        let skip = SkipSet::new();
        let all: Vec<_> = (0..12).map(|_| a.next_batch(&skip).unwrap()).collect();
        for k in [0usize, 3, 4, 5, 11] {
            let mut b = DistributedSampler::new(cfg(23, 2, 1, 3, TailPolicy::Wrap)).unwrap();
            for _ in 0..k {
                b.next_batch(&skip).unwrap();
            }
            let mut c = DistributedSampler::new(cfg(23, 2, 1, 3, TailPolicy::Wrap)).unwrap();
            c.set_cursor(b.cursor());
            let rest: Vec<_> = (k..12).map(|_| c.next_batch(&skip).unwrap()).collect();
            assert_eq!(rest, all[k..]);
        }
    }

    #[test]
    fn invalid_configs_and_exhaustion_are_errors() {
        assert!(DistributedSampler::new(cfg(10, 0, 0, 1, TailPolicy::Drop)).is_err());
        assert!(DistributedSampler::new(cfg(10, 2, 2, 1, TailPolicy::Drop)).is_err());
        assert!(DistributedSampler::new(cfg(10, 2, 0, 0, TailPolicy::Drop)).is_err());
        assert!(matches!(
            DistributedSampler::new(cfg(5, 2, 0, 3, TailPolicy::Drop)),
            Err(DataError::Exhausted { needed: 6, .. })
        ));
        // Wrap fills a batch larger than the source
        let mut s = DistributedSampler::new(cfg(5, 2, 0, 3, TailPolicy::Wrap)).unwrap();
        let g = s.next_global_batch(&SkipSet::new()).unwrap();
        assert_eq!((g.samples.len(), g.wrapped), (6, 1));
        // skipping everything is an error, not a hang
        let mut skip = SkipSet::new();
        skip.insert_range(0, 0..5);
        assert!(matches!(
            s.next_batch(&skip),
            Err(DataError::Exhausted { available: 0, .. })
        ));
        let mut d = DistributedSampler::new(cfg(10, 2, 0, 2, TailPolicy::Drop)).unwrap();
        skip.insert_range(0, 0..8);
        assert!(matches!(
            d.next_batch(&skip),
            Err(DataError::Exhausted { available: 2, .. })
        ));
        let mut c = Cursor::default();
        assert!(next_carry(&mut c, 5, 1, 0, &skip).is_err());
    }
}
