//! The fused unscale-and-check kernels: one pass over the gradients that multiplies by the
//! inverse loss scale and detects inf and NaN.

use crate::error::{PrecisionError, Result};
use crate::policy::ComputeElem;
use kiln_comm::{CommExt, Communicator, ReduceOp};

/// Exponent bits of an f32: all ones means inf or NaN.
const EXP_MASK: u32 = 0x7f80_0000;
/// Elements per block of the hot loops: long enough to vectorise, short enough to stay in L1.
const BLOCK: usize = 1024;

#[inline(always)]
fn non_finite(x: f32) -> u32 {
    ((x.to_bits() & EXP_MASK) == EXP_MASK) as u32
}

#[inline]
fn unscale_block(block: &mut [f32], inv_scale: f32) -> u32 {
    let mut bad = 0u32;
    for x in block.iter_mut() {
        let y = *x * inv_scale;
        bad |= non_finite(y);
        *x = y;
    }
    bad
}

#[inline]
fn check_block(block: &[f32]) -> u32 {
    block.iter().fold(0u32, |bad, &x| bad | non_finite(x))
}

/// True when any element is inf or NaN (vectorised, no early exit so the time does not depend
/// on the data).
pub fn has_non_finite(values: &[f32]) -> bool {
    let mut bad = 0u32;
    let mut blocks = values.chunks_exact(BLOCK);
    for b in &mut blocks {
        bad |= check_block(b);
    }
    bad |= check_block(blocks.remainder());
    bad != 0
}

/// Multiplies every gradient by `inv_scale` in place and returns true when any result is inf or
/// NaN: one pass over the data.
///
/// The check is on the unscaled value, so it also catches a finite gradient that overflows when
/// unscaled by a scale below 1 (torch checks the input only; for scales of 1 and above the two
/// agree). An `inv_scale` of exactly 1 only checks, writing nothing, as torch does.
pub fn unscale_and_check(grads: &mut [f32], inv_scale: f32) -> bool {
    if inv_scale == 1.0 {
        return has_non_finite(grads);
    }
    let mut bad = 0u32;
    let mut blocks = grads.chunks_exact_mut(BLOCK);
    for b in &mut blocks {
        bad |= unscale_block(b, inv_scale);
    }
    bad |= unscale_block(blocks.into_remainder(), inv_scale);
    bad != 0
}

/// Casts compute-type gradients to f32, multiplies by `inv_scale` and checks for inf and NaN in
/// one pass: the fused form of [`crate::cast_to_master`] followed by [`unscale_and_check`].
/// `out` must have the length of `grads`.
pub fn unscale_and_check_from<T: ComputeElem>(
    grads: &[T],
    out: &mut [f32],
    inv_scale: f32,
) -> Result<bool> {
    if grads.len() != out.len() {
        return Err(PrecisionError::LengthMismatch {
            op: "unscale_and_check_from",
            what: "output",
            expected: grads.len(),
            got: out.len(),
        });
    }
    let mut bad = 0u32;
    for (src, dst) in grads.chunks(BLOCK).zip(out.chunks_mut(BLOCK)) {
        T::to_f32_slice(src, dst);
        bad |= if inv_scale == 1.0 {
            check_block(dst)
        } else {
            unscale_block(dst, inv_scale)
        };
    }
    Ok(bad != 0)
}

/// All-reduces a found-inf flag with MAX over the ranks of `comm`, so that every rank skips the
/// optimizer step together when any rank saw an inf or NaN.
pub fn all_reduce_found_inf(comm: &dyn Communicator, found_inf: bool) -> Result<bool> {
    let any = comm.all_reduce_scalar(found_inf as u32, ReduceOp::Max)?;
    Ok(any != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn finds_every_kind_of_non_finite_anywhere() {
        for n in [1usize, 7, BLOCK, BLOCK + 3, 3 * BLOCK + 17] {
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN] {
                for pos in [0, n / 2, n - 1] {
                    let mut g: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
                    g[pos] = bad;
                    assert!(has_non_finite(&g));
                    assert!(unscale_and_check(&mut g, 0.5));
                }
            }
            let mut g: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
            g[n - 1] = f32::MAX; // finite
            assert!(!has_non_finite(&g));
        }
    }

    #[test]
    fn unscales_exactly() {
        let mut g: Vec<f32> = (0..3000).map(|i| (i as f32 - 1500.0) * 1024.0).collect();
        let expected: Vec<f32> = g.iter().map(|&x| x / 1024.0).collect();
        assert!(!unscale_and_check(&mut g, 1.0 / 1024.0));
        assert_eq!(g, expected);
    }

    #[test]
    fn overflow_from_unscaling_is_caught() {
        let mut g = vec![1.0f32, f32::MAX / 2.0];
        assert!(unscale_and_check(&mut g, 4.0));
    }

    #[test]
    fn fused_cast_matches_two_passes() {
        let src: Vec<f16> = (0..2500)
            .map(|i| f16::from_f32(i as f32 * 3.0 - 10.0))
            .collect();
        let mut a = vec![0f32; src.len()];
        assert!(!unscale_and_check_from(&src, &mut a, 0.125).unwrap());
        let mut b = vec![0f32; src.len()];
        crate::cast_to_master(&src, &mut b).unwrap();
        b.iter_mut().for_each(|x| *x *= 0.125);
        assert_eq!(a, b);
        let mut src = src;
        src[2000] = f16::INFINITY;
        assert!(unscale_and_check_from(&src, &mut a, 1.0).unwrap());
        assert!(unscale_and_check_from(&src, &mut a[..3], 1.0).is_err());
    }
}
