//! Test helpers shared by kiln's crates: run a closure on N ranks, compare float slices with a
//! tolerance and report the worst element.
//!
//! ```
//! use kiln_testkit::{assert_close, run_ranks};
//! use kiln_comm::{CommExt, Communicator, ReduceOp};
//!
//! let out = run_ranks(2, |comm| {
//!     let mut v = [comm.rank() as f32 + 0.5];
//!     comm.all_reduce(&mut v, ReduceOp::Sum)?;
//!     Ok(v[0])
//! });
//! assert_close(&out, &[2.0, 2.0], 0.0, 0.0);
//! ```
#![deny(missing_docs)]
#![allow(clippy::panic)] // assertion helpers report failures by panicking, like assert_eq!

use kiln_comm::{spawn_with, ThreadComm, ThreadCommConfig};
use std::time::Duration;

/// The timeout tests give communicators: long enough for a loaded 2-core machine, short enough
/// that a hang fails the test quickly.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f` on `world` thread ranks (timeout [`TEST_TIMEOUT`]) and returns the results in rank
/// order; panics with the failing rank's message if any rank fails.
pub fn run_ranks<R, F>(world: usize, f: F) -> Vec<R>
where
    F: Fn(ThreadComm) -> anyhow::Result<R> + Sync,
    R: Send,
{
    try_run_ranks(world, TEST_TIMEOUT, f).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `f` on `world` thread ranks with the given timeout; the first failure is returned.
pub fn try_run_ranks<R, F>(
    world: usize,
    timeout: Duration,
    f: F,
) -> Result<Vec<R>, kiln_comm::RankError<anyhow::Error>>
where
    F: Fn(ThreadComm) -> anyhow::Result<R> + Sync,
    R: Send,
{
    spawn_with(ThreadCommConfig::with_timeout(timeout), world, f)
}

/// The largest difference between two slices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorstDiff {
    /// Index of the worst element.
    pub index: usize,
    /// Value in the first slice.
    pub actual: f64,
    /// Value in the second slice.
    pub expected: f64,
    /// |actual - expected|.
    pub abs: f64,
    /// |actual - expected| / max(|expected|, tiny).
    pub rel: f64,
}

/// Finds the element where `actual` and `expected` differ most relative to the tolerance
/// `atol + rtol * |expected|`; `None` for empty slices. NaN anywhere counts as infinitely far
/// unless both sides are NaN.
pub fn worst_diff(actual: &[f64], expected: &[f64], atol: f64, rtol: f64) -> Option<WorstDiff> {
    let mut worst: Option<(f64, WorstDiff)> = None;
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let abs = if a.is_nan() && e.is_nan() || a == e {
            0.0
        } else if a.is_nan() || e.is_nan() {
            f64::INFINITY
        } else {
            (a - e).abs()
        };
        let rel = abs / e.abs().max(f64::MIN_POSITIVE);
        let score = abs / (atol + rtol * e.abs()).max(f64::MIN_POSITIVE);
        let d = WorstDiff {
            index: i,
            actual: a,
            expected: e,
            abs,
            rel,
        };
        if worst.as_ref().is_none_or(|(s, _)| score > *s) {
            worst = Some((score, d));
        }
    }
    worst.map(|(_, d)| d)
}

/// Asserts `|actual - expected| <= atol + rtol * |expected|` element-wise (and equal lengths),
/// reporting the worst element. Works on any float slice convertible to f64.
pub fn assert_close<A: Copy + Into<f64>, B: Copy + Into<f64>>(
    actual: &[A],
    expected: &[B],
    atol: f64,
    rtol: f64,
) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "length differs: actual {} vs expected {}",
        actual.len(),
        expected.len()
    );
    let a: Vec<f64> = actual.iter().map(|&x| x.into()).collect();
    let e: Vec<f64> = expected.iter().map(|&x| x.into()).collect();
    if let Some(w) = worst_diff(&a, &e, atol, rtol) {
        let ok = w.abs <= atol + rtol * w.expected.abs();
        assert!(
            ok,
            "slices differ beyond atol {atol:e} rtol {rtol:e}: worst at index {} of {}: actual {} \
             expected {} (abs {:e}, rel {:e})",
            w.index,
            a.len(),
            w.actual,
            w.expected,
            w.abs,
            w.rel
        );
    }
}

/// Asserts two f32 slices are bitwise identical, reporting the first differing element.
pub fn assert_bitwise_eq(actual: &[f32], expected: &[f32]) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "length differs: actual {} vs expected {}",
        actual.len(),
        expected.len()
    );
    if let Some((i, (a, e))) = actual
        .iter()
        .zip(expected)
        .enumerate()
        .find(|(_, (a, e))| a.to_bits() != e.to_bits())
    {
        panic!(
            "not bitwise equal: first difference at index {i} of {}: {a:e} vs {e:e}",
            actual.len()
        );
    }
}

/// The maximum relative difference `|a - e| / max(|e|, 1e-30)` over two slices (for reports).
pub fn max_rel_diff(actual: &[f32], expected: &[f32]) -> f64 {
    actual
        .iter()
        .zip(expected)
        .map(|(&a, &e)| ((a as f64 - e as f64).abs()) / (e as f64).abs().max(1e-30))
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_diff_finds_the_worst() {
        let w = worst_diff(&[1.0, 2.0, 3.5], &[1.0, 2.1, 3.0], 0.0, 1e-3).unwrap();
        assert_eq!(w.index, 2);
        assert!((w.abs - 0.5).abs() < 1e-12);
    }

    #[test]
    #[should_panic(expected = "worst at index 1")]
    fn assert_close_reports_index() {
        assert_close(&[1.0f32, 5.0], &[1.0f32, 4.0], 1e-6, 1e-6);
    }

    #[test]
    fn nan_is_far() {
        let w = worst_diff(&[f64::NAN], &[1.0], 1.0, 1.0).unwrap();
        assert!(w.abs.is_infinite());
    }
}
