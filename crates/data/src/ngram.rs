//! Perplexity filtering: a small n-gram language model trained on reference text scores
//! documents, and documents scoring worse than a threshold are dropped (CCNet's recipe, with an
//! in-process interpolated Kneser-Ney model in place of KenLM).

use crate::error::{DataError, Result};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A hasher for the packed n-gram keys: a multiply-xorshift mix, several times faster than
/// the default SipHash on these keys (the keys come from the corpus, not an adversary). The
/// model's numbers never depend on the iteration order of its maps (every statistic is an
/// integer sum), so the hasher changes speed, never results.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }

    fn write_u128(&mut self, x: u128) {
        self.write_u64(x as u64);
        self.write_u64((x >> 64) as u64);
    }
}

/// A map keyed by packed n-grams.
type KeyMap<V> = HashMap<u128, V, BuildHasherDefault<KeyHasher>>;

/// Packs up to four 32-bit ids into one key (order <= 4 keeps it collision free).
#[inline]
fn pack(ids: &[u32]) -> u128 {
    ids.iter().fold(0u128, |k, &t| (k << 32) | t as u128)
}

#[derive(Debug, Clone, Default)]
struct Level {
    /// (context, word) -> count (raw at the top order, continuation counts below)
    counts: KeyMap<u64>,
    /// context -> (sum of counts, distinct followers)
    contexts: KeyMap<(u64, u64)>,
    discount: f64,
}

/// An interpolated Kneser-Ney n-gram model over token ids (order 1 to 4).
///
/// `P(w | h) = max(c(hw) - D, 0) / c(h·) + D · T(h) / c(h·) · P(w | h')`, where `h'` drops the
/// oldest token of `h`, `T(h)` counts the distinct followers of `h`, the top order uses raw
/// counts and lower orders continuation counts (the number of distinct tokens preceding the
/// n-gram), `D = n1 / (n1 + 2 n2)` per order from the count-of-counts (clamped to
/// `[0.05, 0.95]`), and the recursion ends at the uniform `1 / vocab`. A context never seen
/// backs off whole. Documents start with `order - 1` beginning-of-document symbols. The
/// distribution sums to one over the vocabulary for every context.
#[derive(Debug, Clone)]
pub struct NgramLm {
    order: usize,
    vocab: usize,
    /// levels[k - 1] holds the order-k statistics
    levels: Vec<Level>,
}

impl NgramLm {
    /// Trains on `docs` (each a token sequence, n-grams never cross documents).
    pub fn train<'a>(
        docs: impl IntoIterator<Item = &'a [u32]>,
        order: usize,
        vocab: usize,
    ) -> Result<Self> {
        if !(1..=4).contains(&order) {
            return Err(DataError::config(
                "order",
                format!("{order} is not in 1..=4"),
            ));
        }
        if vocab == 0 {
            return Err(DataError::config("vocab", "0 tokens"));
        }
        // Documents are padded on the left with order - 1 beginning-of-document symbols (id
        // `vocab`, never predicted), so every scored token has a full-length n-gram.
        let bos = vocab as u32;
        let mut top: KeyMap<u64> = KeyMap::default();
        let mut padded: Vec<u32> = Vec::new();
        for doc in docs {
            if let Some(&bad) = doc.iter().find(|&&t| t as usize >= vocab) {
                return Err(DataError::OutOfRange {
                    what: "n-gram token",
                    index: bad as u64,
                    len: vocab as u64,
                });
            }
            padded.clear();
            padded.resize(order - 1, bos);
            padded.extend_from_slice(doc);
            for gram in padded.windows(order) {
                *top.entry(pack(gram)).or_default() += 1;
            }
        }
        let mut levels: Vec<Level> = vec![Level::default(); order];
        levels[order - 1].counts = top;
        // lower orders: continuation counts, the number of distinct tokens seen before the
        // n-gram (its distinct left extensions among the keys one order up)
        for k in (1..order).rev() {
            let low_mask = (1u128 << (32 * k as u32)) - 1;
            let mut cont: KeyMap<u64> = KeyMap::default();
            for &key in levels[k].counts.keys() {
                *cont.entry(key & low_mask).or_default() += 1;
            }
            levels[k - 1].counts = cont;
        }
        for (k, level) in levels.iter_mut().enumerate() {
            let mut n1 = 0u64;
            let mut n2 = 0u64;
            for (&key, &c) in &level.counts {
                match c {
                    1 => n1 += 1,
                    2 => n2 += 1,
                    _ => {}
                }
                let ctx = if k == 0 { 0 } else { key >> 32 };
                let e = level.contexts.entry(ctx).or_default();
                e.0 += c;
                e.1 += 1;
            }
            level.discount = if n1 + n2 == 0 {
                0.5
            } else {
                (n1 as f64 / (n1 as f64 + 2.0 * n2 as f64)).clamp(0.05, 0.95)
            };
        }
        Ok(NgramLm {
            order,
            vocab,
            levels,
        })
    }

    /// The model order.
    pub fn order(&self) -> usize {
        self.order
    }

    /// The vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// `P(word | context)`, using the last `order - 1` tokens of `context`; a context shorter
    /// than that is the start of a document.
    pub fn prob(&self, context: &[u32], word: u32) -> f64 {
        let n = self.order - 1;
        let mut h = [self.vocab as u32; 3];
        let take = context.len().min(n);
        h[n - take..n].copy_from_slice(&context[context.len() - take..]);
        self.prob_rec(&h[..n], word)
    }

    fn prob_rec(&self, h: &[u32], w: u32) -> f64 {
        let lower = if h.is_empty() {
            1.0 / self.vocab as f64
        } else {
            self.prob_rec(&h[1..], w)
        };
        let level = &self.levels[h.len()];
        let ctx = pack(h);
        let Some(&(total, types)) = level.contexts.get(&ctx) else {
            return lower;
        };
        let mut key_ids = [0u32; 4];
        key_ids[..h.len()].copy_from_slice(h);
        key_ids[h.len()] = w;
        let c = level
            .counts
            .get(&pack(&key_ids[..=h.len()]))
            .copied()
            .unwrap_or(0) as f64;
        let d = level.discount;
        let total = total as f64;
        (c - d).max(0.0) / total + d * types as f64 / total * lower
    }

    /// Total natural-log probability of `doc` (each token given the tokens before it in the
    /// document).
    pub fn log_prob(&self, doc: &[u32]) -> f64 {
        (0..doc.len())
            .map(|i| {
                let lo = i.saturating_sub(self.order - 1);
                self.prob(&doc[lo..i], doc[i]).ln()
            })
            .sum()
    }

    /// `exp(-log_prob / len)`; `None` for an empty document.
    pub fn perplexity(&self, doc: &[u32]) -> Option<f64> {
        (!doc.is_empty()).then(|| (-self.log_prob(doc) / doc.len() as f64).exp())
    }
}

/// The `quantile` (0..=1) of `values`: the element at rank `round((n - 1) * quantile)` in
/// increasing order; `None` when there is none.
pub(crate) fn quantile_of(mut values: Vec<f64>, quantile: f64) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let last = values.len().checked_sub(1)?;
    let i = ((last as f64 * quantile).round() as usize).min(last);
    values.get(i).copied()
}

/// Keeps documents whose perplexity under a reference model is at most a threshold.
#[derive(Debug, Clone)]
pub struct PerplexityFilter {
    lm: NgramLm,
    threshold: f64,
}

impl PerplexityFilter {
    /// A filter with a fixed threshold.
    pub fn new(lm: NgramLm, threshold: f64) -> Self {
        PerplexityFilter { lm, threshold }
    }

    /// A filter whose threshold is the `quantile` (0..=1) of the perplexities of `docs`
    /// (CCNet keeps its "head" and "middle" buckets by such quantiles of a reference).
    pub fn with_quantile<'a>(
        lm: NgramLm,
        docs: impl IntoIterator<Item = &'a [u32]>,
        quantile: f64,
    ) -> Result<Self> {
        if !(0.0..=1.0).contains(&quantile) {
            return Err(DataError::config(
                "quantile",
                format!("{quantile} is not in 0..=1"),
            ));
        }
        let p: Vec<f64> = docs.into_iter().filter_map(|d| lm.perplexity(d)).collect();
        let threshold = quantile_of(p, quantile)
            .ok_or_else(|| DataError::config("docs", "no non-empty reference document"))?;
        Ok(PerplexityFilter { lm, threshold })
    }

    /// The threshold.
    pub fn threshold(&self) -> f64 {
        self.threshold
    }

    /// The model.
    pub fn lm(&self) -> &NgramLm {
        &self.lm
    }

    /// The document's perplexity (`None` when empty).
    pub fn score(&self, doc: &[u32]) -> Option<f64> {
        self.lm.perplexity(doc)
    }

    /// Whether to keep the document: non-empty and perplexity at most the threshold.
    pub fn keep(&self, doc: &[u32]) -> bool {
        self.score(doc).is_some_and(|p| p <= self.threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn corpus(seed: u64, docs: usize, vocab: u32) -> Vec<Vec<u32>> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..docs)
            .map(|_| {
                let len = rng.gen_range(0..40);
                // skewed: small ids far more frequent, with some repeated structure
                (0..len)
                    .map(|i| {
                        if i % 3 == 0 {
                            1
                        } else {
                            rng.gen_range(0..vocab).min(rng.gen_range(0..vocab))
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn distributions_sum_to_one_for_every_order() {
        let docs = corpus(1, 60, 12);
        for order in 1..=4 {
            let lm = NgramLm::train(docs.iter().map(|d| &d[..]), order, 12).unwrap();
            let mut contexts: Vec<Vec<u32>> = vec![vec![], vec![1], vec![3, 1], vec![11, 11, 11]];
            for d in docs.iter().take(20) {
                for i in 0..d.len() {
                    contexts.push(d[i.saturating_sub(3)..i].to_vec());
                }
            }
            for h in &contexts {
                let s: f64 = (0..12).map(|w| lm.prob(h, w)).sum();
                assert!((s - 1.0).abs() < 1e-12, "order {order} context {h:?}: {s}");
                assert!((0..12).all(|w| lm.prob(h, w) > 0.0));
            }
        }
    }

    #[test]
    fn bigram_matches_a_direct_computation() {
        // The same model computed naively: scan the padded corpus for every count.
        let v = 6usize;
        let docs = corpus(2, 30, v as u32);
        let lm = NgramLm::train(docs.iter().map(|d| &d[..]), 2, v).unwrap();
        let bos = v as u32;
        let pairs: Vec<(u32, u32)> = docs
            .iter()
            .flat_map(|d| {
                let mut p = vec![bos];
                p.extend_from_slice(d);
                p.windows(2).map(|w| (w[0], w[1])).collect::<Vec<_>>()
            })
            .collect();
        let distinct: Vec<(u32, u32)> = {
            let mut d = pairs.clone();
            d.sort_unstable();
            d.dedup();
            d
        };
        let count = |h: u32, w: u32| pairs.iter().filter(|&&p| p == (h, w)).count() as f64;
        let discount = |counts: Vec<f64>| {
            let n1 = counts.iter().filter(|&&c| c == 1.0).count() as f64;
            let n2 = counts.iter().filter(|&&c| c == 2.0).count() as f64;
            if n1 + n2 == 0.0 {
                0.5
            } else {
                (n1 / (n1 + 2.0 * n2)).clamp(0.05, 0.95)
            }
        };
        let d2 = discount(distinct.iter().map(|&(h, w)| count(h, w)).collect());
        // continuation count of w: distinct h with (h, w) seen
        let cont = |w: u32| distinct.iter().filter(|p| p.1 == w).count() as f64;
        let d1 = discount((0..v as u32).map(cont).filter(|&c| c > 0.0).collect());
        let cont_total: f64 = (0..v as u32).map(cont).sum();
        let cont_types = (0..v as u32).filter(|&w| cont(w) > 0.0).count() as f64;
        let p1 =
            |w: u32| (cont(w) - d1).max(0.0) / cont_total + d1 * cont_types / cont_total / v as f64;
        for h in 0..=v as u32 {
            let total: f64 = (0..v as u32).map(|w| count(h, w)).sum();
            let types = (0..v as u32).filter(|&w| count(h, w) > 0.0).count() as f64;
            for w in 0..v as u32 {
                let want = if total == 0.0 {
                    p1(w)
                } else {
                    (count(h, w) - d2).max(0.0) / total + d2 * types / total * p1(w)
                };
                let ctx: &[u32] = if h == bos { &[] } else { &[h] };
                let got = lm.prob(ctx, w);
                assert!(
                    (got - want).abs() < 1e-12,
                    "P({w}|{h}) = {got}, want {want}"
                );
            }
        }
        // perplexity is the exp of the mean negative log-probability
        let doc = &docs[0];
        let lp: f64 = (0..doc.len())
            .map(|i| lm.prob(&doc[i.saturating_sub(1)..i], doc[i]).ln())
            .sum();
        let ppl = lm.perplexity(doc).unwrap();
        assert!((ppl - (-lp / doc.len() as f64).exp()).abs() < 1e-9);
        assert_eq!(lm.perplexity(&[]), None);
    }

    #[test]
    fn bad_arguments_are_errors() {
        let d: Vec<u32> = vec![1, 2, 9];
        assert!(NgramLm::train([&d[..]], 0, 10).is_err());
        assert!(NgramLm::train([&d[..]], 5, 10).is_err());
        assert!(matches!(
            NgramLm::train([&d[..]], 2, 5),
            Err(DataError::OutOfRange { index: 9, .. })
        ));
        let lm = NgramLm::train([&d[..]], 2, 10).unwrap();
        assert!(PerplexityFilter::with_quantile(lm.clone(), [&d[..]], 1.5).is_err());
        let empty: [&[u32]; 1] = [&[]];
        assert!(PerplexityFilter::with_quantile(lm, empty, 0.5).is_err());
    }
}
