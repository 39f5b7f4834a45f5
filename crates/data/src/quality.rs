//! The perplexity quality filter [`prepare_corpus`](crate::prepare_corpus) applies to each
//! source's training split: its configuration ([`QualityConfig`]), what it did
//! ([`QualityReport`]), and the split of a text into documents.
//!
//! A document is a paragraph: lines up to the next blank line (whitespace only), the blank
//! lines after it included (and, for the first, those before it), so the documents tile the
//! text and dropping one leaves the others separated as they were. A text without any blank line (one record per line, as the verses of
//! `web_bible`) would be a single document; its lines are its documents instead.

use crate::error::{DataError, Result};
use crate::ngram::{quantile_of, NgramLm};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// The perplexity quality filter of prepare_corpus.
///
/// For each source, [`NgramLm`]s of `order` are trained on the tokens of the source's
/// training-split documents, each document of at least `min_doc_tokens` tokens is scored by
/// its perplexity, and the documents above the `1 - drop_fraction` quantile of those
/// perplexities are left out of the training shards (CCNet's recipe, with the source itself as
/// the reference). The scoring is cross-fitted: the documents at even positions are scored by
/// a model of those at odd positions and the other way round, so no document is scored by a
/// model that has seen it (a model scoring its own training text rewards strings it saw once:
/// a paragraph of random characters, every n-gram of it unique, then scores better than
/// English). The validation split is never filtered, so validation losses stay comparable
/// between runs with and without the filter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QualityConfig {
    /// The n-gram order, 1 to 4 (default 3).
    pub order: usize,
    /// The fraction of the scored documents, those with the highest perplexity, dropped: in
    /// `[0, 1)`, default 0.02; 0 keeps all.
    pub drop_fraction: f64,
    /// Documents with fewer tokens than this are kept without being scored (default 8): a
    /// short document's perplexity says little.
    pub min_doc_tokens: usize,
}

impl Default for QualityConfig {
    fn default() -> Self {
        QualityConfig {
            order: 3,
            drop_fraction: 0.02,
            min_doc_tokens: 8,
        }
    }
}

impl QualityConfig {
    /// Checks the fields; an error names the field as `quality.<field>` (its place in a
    /// [`PrepareConfig`](crate::PrepareConfig)).
    pub fn validate(&self) -> Result<()> {
        if !(1..=4).contains(&self.order) {
            return Err(DataError::config(
                "quality.order",
                format!("{} is not in 1..=4", self.order),
            ));
        }
        if !(0.0..1.0).contains(&self.drop_fraction) {
            return Err(DataError::config(
                "quality.drop_fraction",
                format!("{} is not in [0, 1)", self.drop_fraction),
            ));
        }
        Ok(())
    }
}

/// What the quality filter did to one source's training split (recorded in the manifest).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QualityReport {
    /// The perplexity above which documents were dropped (`f64::MAX` when no document was
    /// long enough to be scored).
    pub threshold: f64,
    /// Documents kept, the unscored short ones included.
    pub docs_kept: u64,
    /// Documents dropped.
    pub docs_dropped: u64,
    /// Tokens of the kept documents (the training shards hold these plus one end-of-text).
    pub tokens_kept: u64,
    /// Tokens of the dropped documents.
    pub tokens_dropped: u64,
}

fn is_blank(line: &str) -> bool {
    line.trim().is_empty()
}

/// The documents of `lines` (each line with its `\n`) as ranges of line indices, tiling
/// `0..lines.len()`: paragraphs with their trailing blank lines, or single lines when no line
/// is blank.
pub(crate) fn documents(lines: &[&str]) -> Vec<Range<usize>> {
    if !lines.iter().any(|l| is_blank(l)) {
        return (0..lines.len()).map(|i| i..i + 1).collect();
    }
    let mut docs = Vec::new();
    let mut start = 0;
    // blank lines before the first paragraph belong to it
    let mut has_text = false;
    let mut prev_blank = false;
    for (i, line) in lines.iter().enumerate() {
        let blank = is_blank(line);
        if !blank && has_text && prev_blank {
            docs.push(start..i);
            start = i;
        }
        has_text |= !blank;
        prev_blank = blank;
    }
    if start < lines.len() {
        docs.push(start..lines.len());
    }
    docs
}

/// Scores `docs` (token ids below `vocab`), each by a model of the other half (cross-fitted:
/// even positions by a model of the odd ones, odd by one of the even), and decides which to
/// keep: returns one flag per document and the counts.
pub(crate) fn filter_documents(
    cfg: &QualityConfig,
    docs: &[Vec<u32>],
    vocab: usize,
) -> Result<(Vec<bool>, QualityReport)> {
    cfg.validate()?;
    let mut scores: Vec<Option<f64>> = vec![None; docs.len()];
    for fold in 0..2 {
        let others = docs.iter().skip(1 - fold).step_by(2).map(|d| &d[..]);
        let lm = NgramLm::train(others, cfg.order, vocab)?;
        for i in (fold..docs.len()).step_by(2) {
            if docs[i].len() >= cfg.min_doc_tokens {
                scores[i] = lm.perplexity(&docs[i]);
            }
        }
    }
    let threshold = quantile_of(
        scores.iter().flatten().copied().collect(),
        1.0 - cfg.drop_fraction,
    )
    .unwrap_or(f64::MAX);
    let keep: Vec<bool> = scores
        .iter()
        .map(|s| s.is_none_or(|p| p <= threshold))
        .collect();
    let mut report = QualityReport {
        threshold,
        docs_kept: 0,
        docs_dropped: 0,
        tokens_kept: 0,
        tokens_dropped: 0,
    };
    for (d, &k) in docs.iter().zip(&keep) {
        let n = d.len() as u64;
        if k {
            report.docs_kept += 1;
            report.tokens_kept += n;
        } else {
            report.docs_dropped += 1;
            report.tokens_dropped += n;
        }
    }
    Ok((keep, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_are_paragraphs_with_their_blank_lines() {
        let text = "\nA1\nA2\n\n  \nB1\n\nC1\n";
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        let docs = documents(&lines);
        let pieces: Vec<String> = docs.iter().map(|r| lines[r.clone()].concat()).collect();
        assert_eq!(pieces, ["\nA1\nA2\n\n  \n", "B1\n\n", "C1\n"]);
        // without a blank line, every line is a document
        let lines = ["v1\n", "v2\n", "v3"];
        assert_eq!(documents(&lines), [0..1, 1..2, 2..3]);
        assert!(documents(&[]).is_empty());
    }

    #[test]
    fn the_threshold_is_the_quantile_and_short_documents_are_kept() {
        // a repetitive pattern, many times, and one document of other tokens
        let mut docs: Vec<Vec<u32>> = (0..49).map(|_| [1, 2, 3, 4].repeat(5)).collect();
        docs.push((0..20).map(|i| (i * 7 + 5) % 16).collect());
        docs.push(vec![15, 14]); // too short to score
        let cfg = QualityConfig {
            drop_fraction: 0.02,
            ..QualityConfig::default()
        };
        let (keep, r) = filter_documents(&cfg, &docs, 16).unwrap();
        assert_eq!(keep.iter().filter(|k| !**k).count(), 1);
        assert!(!keep[49] && keep[50]);
        assert_eq!((r.docs_kept, r.docs_dropped), (50, 1));
        assert_eq!((r.tokens_kept, r.tokens_dropped), (49 * 20 + 2, 20));
        let (keep, r) = filter_documents(
            &QualityConfig {
                drop_fraction: 0.0,
                ..cfg.clone()
            },
            &docs,
            16,
        )
        .unwrap();
        assert!(keep.iter().all(|k| *k));
        assert_eq!(r.docs_dropped, 0);
        // nothing long enough to score: nothing dropped
        let (keep, r) = filter_documents(
            &QualityConfig {
                min_doc_tokens: 100,
                ..cfg
            },
            &docs,
            16,
        )
        .unwrap();
        assert!(keep.iter().all(|k| *k));
        assert_eq!(r.threshold, f64::MAX);
    }
}
