//! The host-side passes of a step over whole gradient buffers (the unscale and found-inf check,
//! the global norm's exact square sums), split into pieces on candle's worker pool. Its worker
//! is awake (spinning) right after the backward, where threads started per call competed with
//! it for the cores: the norm of `small_cpu`'s 5.3M gradients took 3.5-4.4 ms on two scoped
//! threads. Both passes give the same bits however they are split: the check is per element
//! and the square sums are exact.

use crate::tp::{for_each_slot, slots};
use kiln_optim::SquareSum;
use kiln_precision::unscale_and_check;
use std::sync::atomic::{AtomicBool, Ordering};

/// Elements of one piece of work (256 KiB of f32).
const PIECE: usize = 1 << 16;

/// [`unscale_and_check`] of `grads`, in pieces over the pool when `threads > 1`.
pub(super) fn unscale_and_check_par(grads: &mut [f32], inv: f32, threads: usize) -> bool {
    if threads <= 1 || grads.len() <= PIECE {
        return unscale_and_check(grads, inv);
    }
    let found = AtomicBool::new(false);
    for_each_slot(&slots(grads, PIECE), PIECE, |_, piece| {
        if unscale_and_check(piece, inv) {
            found.store(true, Ordering::Relaxed);
        }
    });
    found.into_inner()
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
}
