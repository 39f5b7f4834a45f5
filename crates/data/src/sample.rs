//! Sample identity and the set of samples a loader must skip.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

/// A sample: the window `index` of source `source` (tokens `index*ctx ..= index*ctx + ctx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SampleId {
    /// The source (index into the loader's sources).
    pub source: u32,
    /// The window index inside that source.
    pub index: u64,
}

impl SampleId {
    /// A sample id.
    pub fn new(source: u32, index: u64) -> Self {
        SampleId { source, index }
    }
}

impl fmt::Display for SampleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.source, self.index)
    }
}

/// Sample ids a loader never yields, as merged half-open index ranges per source.
///
/// Filled after a roll-back (a bad batch's samples), kept in [`crate::LoaderState`] so a resumed
/// run skips the same samples. A skipped sample is passed over where it would have been drawn;
/// the samples after it move up, so batch counts stay equal on every rank.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkipSet {
    ranges: BTreeMap<u32, Vec<(u64, u64)>>,
}

impl SkipSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one sample.
    pub fn insert(&mut self, id: SampleId) {
        self.insert_range(id.source, id.index..id.index.saturating_add(1));
    }

    /// Adds the windows `range` of `source`.
    pub fn insert_range(&mut self, source: u32, range: Range<u64>) {
        if range.start >= range.end {
            return;
        }
        let v = self.ranges.entry(source).or_default();
        v.push((range.start, range.end));
        v.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for &(s, e) in v.iter() {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        *v = merged;
    }

    /// Whether the sample is skipped.
    pub fn contains(&self, id: SampleId) -> bool {
        let Some(v) = self.ranges.get(&id.source) else {
            return false;
        };
        // the last range starting at or before index
        let k = v.partition_point(|&(s, _)| s <= id.index);
        k > 0 && id.index < v[k - 1].1
    }

    /// How many windows of `source` below `n` are skipped.
    pub fn count_below(&self, source: u32, n: u64) -> u64 {
        self.ranges.get(&source).map_or(0, |v| {
            v.iter()
                .map(|&(s, e)| e.min(n).saturating_sub(s.min(n)))
                .sum()
        })
    }

    /// Whether nothing is skipped.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The skipped ranges of `source`.
    pub fn ranges(&self, source: u32) -> impl Iterator<Item = Range<u64>> + '_ {
        self.ranges
            .get(&source)
            .into_iter()
            .flatten()
            .map(|&(s, e)| s..e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_set_matches_a_plain_set() {
        let mut s = SkipSet::new();
        let mut reference = std::collections::HashSet::new();
        for (src, r) in [
            (0u32, 5..9),
            (0, 7..12),
            (0, 20..21),
            (1, 0..3),
            (0, 12..14),
            (0, 30..30),
        ] {
            s.insert_range(src, r.clone());
            for i in r {
                reference.insert((src, i));
            }
        }
        s.insert(SampleId::new(2, 40));
        reference.insert((2, 40));
        for src in 0..3u32 {
            for i in 0..50u64 {
                assert_eq!(
                    s.contains(SampleId::new(src, i)),
                    reference.contains(&(src, i)),
                    "{src}:{i}"
                );
            }
            let below = reference
                .iter()
                .filter(|&&(s, i)| s == src && i < 13)
                .count() as u64;
            assert_eq!(s.count_below(src, 13), below);
        }
        assert_eq!(s.ranges(0).collect::<Vec<_>>(), vec![5..14, 20..21]);
    }
}
