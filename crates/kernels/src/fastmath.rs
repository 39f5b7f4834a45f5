//! Element-wise math the CPU kernels share: a branch-free `exp` that vectorises, and whether
//! the CPU has the vector unit the kernels' AVX-512 copies need.

/// Cephes-style `exp` for f32: `2^n * p(r)` with `x = n ln2 + r`, `|r| <= ln2 / 2`; inputs
/// are clamped to [-87.3, 88.3] so that `2^n` stays a normal float. Relative error below 4e-7
/// against f64's `exp`; no branch and no table, so loops over it auto-vectorise (the CPU
/// cross-entropy, softmax, GELU and attention kernels use it).
///
/// ```
/// let e = kiln_kernels::fastmath::exp_f32(1.0);
/// assert!((e - std::f32::consts::E).abs() < 1e-6);
/// ```
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.3);
    let z = x * LOG2E + MAGIC;
    let n = z - MAGIC;
    let ni = (z.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(((ni + 127) << 23) as u32)
}

/// `x` rounded to the nearest f16 (ties to even) and widened back to f32, as
/// `half::f16::from_f32(x).to_f32()` but branch-free, so loops over it vectorise: the
/// mantissa rounded to 10 bits, below f16's smallest normal (2^-14) to a multiple of 2^-24,
/// at 65520 and beyond to infinity; NaN stays NaN.
///
/// ```
/// use kiln_kernels::fastmath::round_f16;
/// assert_eq!(round_f16(1.0 + 1.0 / 4096.0), 1.0);
/// assert_eq!(round_f16(65504.0), 65504.0);
/// assert_eq!(round_f16(-70000.0), f32::NEG_INFINITY);
/// ```
#[inline(always)]
pub fn round_f16(x: f32) -> f32 {
    /// f16's smallest normal, 2^-14.
    const MIN_NORMAL: f32 = 6.103_515_6e-5;
    /// The f32 bits of 65536, the first value an f16 rounds to infinity.
    const OVERFLOW_BITS: u32 = 0x4780_0000;
    let a = x.abs();
    let bits = a.to_bits();
    let normal = (bits + 0x0fff + ((bits >> 13) & 1)) & !0x1fff;
    // adding and removing 0.5 rounds |x| < 2^-14 to a multiple of ulp(0.5) = 2^-24
    let subnormal = (a + 0.5) - 0.5;
    let y = if a < MIN_NORMAL {
        subnormal
    } else if normal >= OVERFLOW_BITS {
        f32::INFINITY
    } else {
        f32::from_bits(normal)
    };
    if a.is_nan() {
        x
    } else {
        y.copysign(x)
    }
}

/// `x` rounded to bf16 (to nearest even) and widened back, bitwise `half::bf16`'s round trip
/// (a NaN stays a NaN, made quiet). Branch-free, so a loop of it vectorises: the products of
/// such operands are exact in f32, so an f32 product of them is what a bf16 matrix unit with
/// f32 accumulation computes.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    // wrapping: only a NaN's bits overflow, and its sum is not used
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    let quiet = (bits | 0x0040_0000) & 0xffff_0000;
    f32::from_bits(if x.is_nan() { quiet } else { rounded })
}

/// Whether this CPU has AVX-512F: kernels then run a copy of their loops compiled for it
/// (`#[target_feature(enable = "avx512f")]`), 16 lanes wide instead of the baseline's 4. Rust
/// never contracts a multiply and an add into one instruction on its own, so the copies
/// compute the same numbers.
#[inline]
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst[c * ds + r] = src[r * ss + c]` for `r < rows`, `c < cols`: a `rows x cols` block
/// (rows `ss` apart) transposed into `dst` (rows `ds` apart). Whole 8 x 8 blocks go through
/// AVX2 shuffles where the CPU has AVX-512F (and so AVX2), the edges value by value (scalar,
/// one value from each of eight rows per output row, they cost about two instructions a
/// value). Returns false, writing nothing, where `src` or `dst` is too short.
pub fn transpose_f32(
    src: &[f32],
    (rows, cols, ss): (usize, usize, usize),
    dst: &mut [f32],
    ds: usize,
) -> bool {
    if rows == 0 || cols == 0 {
        return true;
    }
    if (rows - 1) * ss + cols > src.len() || (cols - 1) * ds + rows > dst.len() {
        return false;
    }
    let (r8, c8) = (rows / 8 * 8, cols / 8 * 8);
    #[cfg(target_arch = "x86_64")]
    let vector = has_avx512();
    #[cfg(not(target_arch = "x86_64"))]
    let vector = false;
    let (r_vec, c_vec) = if vector { (r8, c8) } else { (0, 0) };
    #[cfg(target_arch = "x86_64")]
    for r0 in (0..r_vec).step_by(8) {
        for c0 in (0..c_vec).step_by(8) {
            // SAFETY: the CPU has AVX2 (AVX-512F checked); rows r0 .. r0 + 8 <= rows of `src`
            // hold columns c0 .. c0 + 8 <= cols, and rows c0 .. c0 + 8 of `dst` hold columns
            // r0 .. r0 + 8 (both extents checked above)
            unsafe {
                transpose_8x8(
                    src.as_ptr().add(r0 * ss + c0),
                    ss,
                    dst.as_mut_ptr().add(c0 * ds + r0),
                    ds,
                )
            };
        }
    }
    // what the blocks left: the columns past `c_vec` of the blocks' rows, then the rows past
    // `r_vec`
    for r in 0..rows {
        let from = if r < r_vec { c_vec } else { 0 };
        for c in from..cols {
            dst[c * ds + r] = src[r * ss + c];
        }
    }
    true
}

/// The 8 x 8 block of f32 values `src[i * ss + j]` (`i, j < 8`) transposed into
/// `dst[j * ds + i]`: the classic unpack, shuffle and lane-permute sequence.
///
/// # Safety
/// The CPU must have AVX2; `src` must hold 8 readable values at each `i * ss` and `dst` 8
/// writable ones at each `j * ds`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn transpose_8x8(src: *const f32, ss: usize, dst: *mut f32, ds: usize) {
    use std::arch::x86_64::*;
    // SAFETY: in bounds by the caller's contract
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * ss)));
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xee>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xee>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xee>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xee>(t5, t7);
        let rows = [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ];
        for (j, row) in rows.iter().enumerate() {
            _mm256_storeu_ps(dst.add(j * ds), *row);
        }
    }
}

/// The body of a kernel function that runs `$avx512(args)`, a copy compiled with
/// `#[target_feature(enable = "avx512f")]`, where the CPU has AVX-512F ([`has_avx512`]), and
/// `$portable(args)` elsewhere. Both copies call one `#[inline(always)]` implementation, so the
/// loops are the same code and compute the same numbers; the copy only vectorises wider. The
/// arguments are names of variables, so no expression is evaluated inside the `unsafe` call.
///
/// ```
/// fn double_all(x: &mut [f32]) {
///     kiln_kernels::simd_dispatch!(double_all_avx512, double_all_impl, (x))
/// }
/// #[cfg(target_arch = "x86_64")]
/// #[target_feature(enable = "avx512f")]
/// unsafe fn double_all_avx512(x: &mut [f32]) {
///     double_all_impl(x)
/// }
/// #[inline(always)]
/// fn double_all_impl(x: &mut [f32]) {
///     x.iter_mut().for_each(|v| *v *= 2.0)
/// }
/// let mut v = vec![1f32; 40];
/// double_all(&mut v);
/// assert!(v.iter().all(|&x| x == 2.0));
/// ```
#[macro_export]
macro_rules! simd_dispatch {
    ($avx512:ident, $portable:ident, ($($arg:ident),* $(,)?)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if $crate::fastmath::has_avx512() {
                // SAFETY: the CPU has AVX-512F, all that the copy was compiled for.
                #[allow(unused_unsafe)]
                return unsafe { $avx512($($arg),*) };
            }
        }
        $portable($($arg),*)
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape around the 8 x 8 blocks, strides wider than the block, bit for bit against
    /// the index formula; the untouched parts of `dst` keep their values; short slices are
    /// refused with nothing written.
    #[test]
    fn transpose_moves_every_value_once() {
        for rows in [0, 1, 7, 8, 9, 16, 23, 64] {
            for cols in [0, 1, 5, 8, 15, 32, 64, 67] {
                let (ss, ds) = (cols + 3, rows + 5);
                let src: Vec<f32> = (0..rows * ss).map(|i| i as f32 * 0.5 - 7.0).collect();
                let mut dst = vec![f32::NAN; cols.max(1) * ds];
                assert!(transpose_f32(&src, (rows, cols, ss), &mut dst, ds));
                for (i, &v) in dst.iter().enumerate() {
                    let (c, r) = (i / ds, i % ds);
                    if r < rows && c < cols {
                        assert_eq!(
                            v.to_bits(),
                            src[r * ss + c].to_bits(),
                            "{rows}x{cols} r{r} c{c}"
                        );
                    } else {
                        assert!(v.is_nan(), "{rows}x{cols}: wrote outside at r{r} c{c}");
                    }
                }
            }
        }
        let src = vec![1f32; 8 * 8];
        let mut dst = vec![0f32; 8 * 8];
        assert!(!transpose_f32(&src[1..], (8, 8, 8), &mut dst, 8));
        assert!(!transpose_f32(&src, (8, 8, 8), &mut dst[1..], 8));
        assert!(dst.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn exp_against_f64() {
        let mut worst = 0f64;
        for i in -87_000..88_000 {
            let x = i as f32 * 1e-3;
            let e = exp_f32(x) as f64;
            let r = (x as f64).exp();
            worst = worst.max((e - r).abs() / r);
        }
        assert!(worst < 4e-7, "exp relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NEG_INFINITY) < 1e-37 && exp_f32(-1e30) >= 0.0);
        assert!(exp_f32(100.0).is_finite());
    }

    /// `round_f16` is `half`'s conversion there and back, bit for bit, on every f32 whose
    /// top 20 bits vary with the rest from a pattern (over a million values: all exponents,
    /// both signs, ties and their neighbours), and on the edge cases.
    #[test]
    fn round_bf16_is_halfs_round_trip() {
        let check = |x: f32| {
            let want = half::bf16::from_f32(x).to_f32();
            let got = round_bf16(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x:e} ({:#010x}): {got:e} vs {want:e}",
                x.to_bits()
            );
        };
        // every upper half, with the lower halves at and around the rounding boundaries
        for hi in 0u32..1 << 16 {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xabcd, 0xffff] {
                check(f32::from_bits(hi << 16 | lo));
            }
        }
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_bf16(-0.0).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn round_f16_is_halfs_round_trip() {
        let check = |x: f32| {
            let want = half::f16::from_f32(x).to_f32();
            let got = round_f16(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x:e} ({:#010x}): {got:e} vs {want:e}",
                x.to_bits()
            );
        };
        for hi in 0u32..1 << 20 {
            for lo in [0u32, 0x0fff, 0x1000, 0x1001, 0x0800, 0x0abc, 0x1fff] {
                check(f32::from_bits(hi << 12 | lo));
            }
        }
        for x in [
            0.0, -0.0, 65504.0, 65519.0, 65520.0, 6.1e-5, 5.96e-8, 2.98e-8, 1e-9,
        ] {
            check(x);
            check(-x);
        }
        check(f32::INFINITY);
        check(f32::NAN);
    }
}
