//! Robust statistics over small windows: median and median absolute deviation.

/// Consistency constant that turns a MAD into a standard deviation for Gaussian data:
/// `1 / Phi^-1(3/4)`.
pub const MAD_TO_SD: f64 = 1.482_602_218_505_602;

/// Median of `v` (mean of the two middle values for an even length), reordering `v`;
/// NaN for an empty slice. The values must not be NaN.
pub fn median_in_place(v: &mut [f64]) -> f64 {
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    let (left, mid, _) = v.select_nth_unstable_by(n / 2, f64::total_cmp);
    let hi = *mid;
    if n % 2 == 1 {
        hi
    } else {
        let lo = left.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        0.5 * (lo + hi)
    }
}

/// Lower median: the element of rank `(n - 1) / 2` in sorted order (the median for odd `n`,
/// the smaller middle value for even `n`); NaN for an empty slice. Reorders `v`.
pub fn lower_median_in_place(v: &mut [f64]) -> f64 {
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    *v.select_nth_unstable_by((n - 1) / 2, f64::total_cmp).1
}

/// Median and MAD (median of absolute deviations from the median) of `values`, using
/// `scratch` as working memory.
pub fn median_mad(values: impl Iterator<Item = f64>, scratch: &mut Vec<f64>) -> (f64, f64) {
    scratch.clear();
    scratch.extend(values);
    let med = median_in_place(scratch);
    for x in scratch.iter_mut() {
        *x = (*x - med).abs();
    }
    let mad = median_in_place(scratch);
    (med, mad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted_median(v: &[f64]) -> f64 {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        }
    }

    #[test]
    fn median_matches_sorting() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for n in 1..40 {
            let v: Vec<f64> = (0..n).map(|_| rng.gen_range(-5.0..5.0)).collect();
            let mut w = v.clone();
            assert_eq!(median_in_place(&mut w), sorted_median(&v));
            let mut s = v.clone();
            s.sort_by(f64::total_cmp);
            let mut w = v.clone();
            assert_eq!(lower_median_in_place(&mut w), s[(n - 1) / 2]);
        }
        assert!(median_in_place(&mut []).is_nan());
    }

    #[test]
    fn mad_closed_form() {
        // 1..=9: median 5, deviations 0,1,1,2,2,3,3,4,4 -> MAD 2
        let mut scratch = Vec::new();
        let (m, mad) = median_mad((1..=9).map(f64::from), &mut scratch);
        assert_eq!((m, mad), (5.0, 2.0));
        // Gaussian consistency: MAD of N(0,1) is Phi^-1(3/4) = 0.6744897501960817
        assert!((MAD_TO_SD * 0.674_489_750_196_081_7 - 1.0).abs() < 1e-12);
    }
}
