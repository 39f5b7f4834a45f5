//! The host-side passes of a step over whole gradient buffers (the unscale and found-inf check,
//! the global norm's exact square sums), split into pieces on candle's worker pool. Its worker
//! is awake (spinning) right after the backward, where threads started per call competed with
//! it for the cores: the norm of `small_cpu`'s 5.3M gradients took 3.5-4.4 ms on two scoped
//! threads. Both passes give the same bits however they are split: the check is per element
//! and the square sums are exact.

use kiln_kernels::pool::{for_each_slot, slots};
use kiln_optim::SquareSum;
use kiln_precision::unscale_and_check;
use std::sync::atomic::{AtomicBool, Ordering};

/// The optimizer's step on candle's worker pool ([`kiln_optim::ParallelRunner`]).
#[derive(Debug)]
pub(super) struct PoolRunner;

impl kiln_optim::ParallelRunner for PoolRunner {
    fn run(&self, n: usize, job: &(dyn Fn(usize) + Sync)) {
        kiln_kernels::pool::run_items(n, PIECE, job);
    }
}

/// Elements of one piece of work (256 KiB of f32).
const PIECE: usize = 1 << 16;

/// Runs `f` on `values` whole when `threads <= 1` or it is one piece, else on each piece of
/// it over the pool.
fn in_pieces(values: &mut [f32], threads: usize, f: impl Fn(&mut [f32]) + Sync) {
    if threads <= 1 || values.len() <= PIECE {
        f(values);
    } else {
        for_each_slot(&slots(values, PIECE), PIECE, |_, piece| f(piece));
    }
}

/// [`unscale_and_check`] of `grads`, in pieces over the pool when `threads > 1`.
pub(super) fn unscale_and_check_par(grads: &mut [f32], inv: f32, threads: usize) -> bool {
    let found = AtomicBool::new(false);
    in_pieces(grads, threads, |piece| {
        if unscale_and_check(piece, inv) {
            found.store(true, Ordering::Relaxed);
        }
    });
    found.into_inner()
}

/// [`kiln_optim::clip_to_norm`] of `grads`, the scaling in pieces over the pool when
/// `threads > 1` (each element multiplied by the same coefficient: the same bits).
pub(super) fn clip_to_norm_par(
    grads: &mut [f32],
    norm: f64,
    max_norm: f32,
    threads: usize,
) -> kiln_optim::Result<bool> {
    // the coefficient (and the checks) of the serial function, then its scaling in pieces
    let report = kiln_optim::clip_to_norm(&mut [], norm, max_norm)?;
    if report.clipped {
        let coef = report.coef;
        in_pieces(grads, threads, |piece| {
            piece.iter_mut().for_each(|g| *g *= coef)
        });
    }
    Ok(report.clipped)
}

/// The exact square sum of each of `values` (in order), in pieces over the pool when
/// `threads > 1`.
pub(super) fn square_sums(values: &[&[f32]], threads: usize) -> Vec<SquareSum> {
    let pieces: Vec<(usize, &[f32])> = values
        .iter()
        .enumerate()
        .flat_map(|(i, v)| v.chunks(PIECE).map(move |c| (i, c)))
        .collect();
    let mut sums = vec![SquareSum::new(); pieces.len()];
    if threads > 1 {
        for_each_slot(&slots(&mut sums, 1), PIECE, |j, s| {
            s[0] = SquareSum::of(pieces[j].1)
        });
    } else {
        for (s, (_, c)) in sums.iter_mut().zip(&pieces) {
            s.add(c);
        }
    }
    let mut out = vec![SquareSum::new(); values.len()];
    for ((i, _), s) in pieces.iter().zip(&sums) {
        out[*i].merge(s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 * 1e-3 - 1.0)
            .collect()
    }

    /// Pieces on the pool give the serial results bit for bit: the square sums of buffers of
    /// many pieces and of none, and the unscaled values with the found-inf flag, with and
    /// without a NaN.
    #[test]
    fn pieces_on_the_pool_are_the_serial_results() {
        let (a, b) = (values(5 * PIECE + 17, 1), values(100, 2));
        let sums = square_sums(&[&a, &b, &[]], 2);
        assert_eq!(
            sums,
            vec![SquareSum::of(&a), SquareSum::of(&b), SquareSum::new()]
        );
        assert_eq!(square_sums(&[&a, &b], 1), sums[..2].to_vec());
        for nan_at in [None, Some(3 * PIECE + 5)] {
            let mut g = values(4 * PIECE + 3, 3);
            if let Some(i) = nan_at {
                g[i] = f32::NAN;
            }
            let mut serial = g.clone();
            let want = unscale_and_check(&mut serial, 0.25);
            assert_eq!(unscale_and_check_par(&mut g, 0.25, 2), want);
            assert_eq!(want, nan_at.is_some());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&g), bits(&serial));
        }
    }

    /// Clipping on the pool gives the serial bits, clipped or not, and the serial errors.
    #[test]
    fn clipping_on_the_pool_is_the_serial_clipping() {
        let g0 = values(3 * PIECE + 9, 6);
        for (norm, max) in [(50.0, 1.0f32), (0.5, 1.0)] {
            let (mut serial, mut pooled) = (g0.clone(), g0.clone());
            let want = kiln_optim::clip_to_norm(&mut serial, norm, max)
                .unwrap()
                .clipped;
            assert_eq!(clip_to_norm_par(&mut pooled, norm, max, 2).unwrap(), want);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&pooled), bits(&serial));
        }
        assert!(clip_to_norm_par(&mut g0.clone(), 1.0, -1.0, 2).is_err());
    }

    /// AdamW's step on the pool is bitwise its step on the calling thread.
    #[test]
    fn adamw_on_the_pool_is_bitwise_the_serial_step() {
        use kiln_optim::{AdamW, AdamWConfig, Optimizer};
        let n = 5 * PIECE + 17;
        let cfg = AdamWConfig::default();
        let (mut serial, mut pooled) = (AdamW::new(n, cfg).unwrap(), AdamW::new(n, cfg).unwrap());
        pooled.set_runner(Some(std::sync::Arc::new(PoolRunner)));
        let (mut ps, mut pp) = (values(n, 4), values(n, 4));
        for t in 0..3 {
            let g = values(n, 5 + t);
            serial.step(&mut ps, &g, 0.01).unwrap();
            pooled.step(&mut pp, &g, 0.01).unwrap();
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&pp), bits(&ps));
        assert_eq!(bits(pooled.exp_avg_sq()), bits(serial.exp_avg_sq()));
    }
}
