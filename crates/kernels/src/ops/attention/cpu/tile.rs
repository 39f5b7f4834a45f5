//! The small matrix products and reductions the head kernels are built from: `MR x NR`
//! register tiles ([`gemm`], on AVX2 or AVX-512 intrinsics for full f32 tiles), the operand
//! copies (rows widened to the arithmetic type, transposed to `[dh, t]`), and sums and dot
//! products in independent lanes. Every element is one chain of multiply-adds in a fixed
//! order, so the tile size and the vector width never change a result.

use super::row;
use crate::custom_op::{Elem, Float};

/// Which vector kernel [`gemm`] may use for full f32 tiles: none, AVX2 + FMA (4 x 16 tiles)
/// or AVX-512F (8 x 32 tiles). The copies compiled for those features pass theirs.
pub(super) const NO_SIMD: u8 = 0;
#[cfg(target_arch = "x86_64")]
pub(super) const AVX2: u8 = 1;
#[cfg(target_arch = "x86_64")]
pub(super) const AVX512: u8 = 2;

/// Runs a full `MR x NR` tile (`acc` holds its start) over the `k` units of `ap` and of `b`'s
/// columns `j0 ..` on the vector kernel `x86` names, if there is one for `F` and the tile;
/// returns whether it ran. Each element is the same chain of fused multiply-adds as the
/// generic loop's.
#[inline(always)]
fn simd_tile<F: Float, const MR: usize, const NR: usize>(
    x86: u8,
    (c, crs, add): (&mut [F], usize, bool),
    ap: &[F],
    (b, bks): (&[F], usize),
    j0: usize,
    k: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::any::TypeId;
        let shape = match x86 {
            AVX512 => (8, 32),
            AVX2 => (4, 16),
            _ => return false,
        };
        if (MR, NR) != shape || TypeId::of::<F>() != TypeId::of::<f32>() || k == 0 {
            return false;
        }
        // the last unit's columns must lie inside `b`, `ap` hold `k` units, and the tile
        // (rows `crs` apart) lie inside `c`
        if (k - 1) * bks + j0 + NR > b.len()
            || ap.len() < k * MR
            || crs < NR
            || (MR - 1) * crs + NR > c.len()
        {
            return false;
        }
        let (cp, app, bp) = (
            c.as_mut_ptr() as *mut f32,
            ap.as_ptr() as *const f32,
            // SAFETY: j0 + NR <= b.len() (checked above)
            unsafe { b.as_ptr().add(j0) } as *const f32,
        );
        // SAFETY: `F` is f32 (checked), so the casts keep types; every read lies in `ap` or
        // `b` and the tile inside `c` (checked above); `x86` is AVX2 or AVX512 only in the
        // copies compiled for those features, which `simd()` chose for this CPU
        unsafe {
            if x86 == AVX512 {
                kernels::tile_8x32(cp, crs, add, app, bp, bks, k);
            } else {
                kernels::tile_4x16(cp, crs, add, app, bp, bks, k);
            }
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x86, c, crs, add, ap, b, bks, j0, k);
        false
    }
}

/// The f32 tile kernels of [`gemm`].
#[cfg(target_arch = "x86_64")]
mod kernels {
    use std::arch::x86_64::*;

    /// One tile kernel: `t[r][c] = fma(ap[kk * MR + r], b[kk * bks + c], t[r][c])` for `kk`
    /// in `0..k`, in order, over an `MR x 2 LANES` tile held in two vectors per row, starting
    /// from the tile at `c` (rows `crs` apart) with `add`, from zero otherwise, and stored
    /// there.
    macro_rules! tile_kernel {
        ($(#[$doc:meta])* $name:ident, $feat:literal, $mr:literal, $lanes:literal,
         $zero:ident, $load:ident, $store:ident, $set1:ident, $fma:ident) => {
            $(#[$doc])*
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $name(
                acc: *mut f32,
                crs: usize,
                add: bool,
                ap: *const f32,
                b: *const f32,
                bks: usize,
                k: usize,
            ) {
                // SAFETY: in bounds by the caller's contract
                unsafe {
                    let mut c = [[$zero(); 2]; $mr];
                    if add {
                        for (r, cr) in c.iter_mut().enumerate() {
                            cr[0] = $load(acc.add(r * crs));
                            cr[1] = $load(acc.add(r * crs + $lanes));
                        }
                    }
                    for kk in 0..k {
                        let b0 = $load(b.add(kk * bks));
                        let b1 = $load(b.add(kk * bks + $lanes));
                        for (r, cr) in c.iter_mut().enumerate() {
                            let av = $set1(*ap.add(kk * $mr + r));
                            cr[0] = $fma(av, b0, cr[0]);
                            cr[1] = $fma(av, b1, cr[1]);
                        }
                    }
                    for (r, cr) in c.iter().enumerate() {
                        $store(acc.add(r * crs), cr[0]);
                        $store(acc.add(r * crs + $lanes), cr[1]);
                    }
                }
            }
        };
    }

    tile_kernel!(
        /// An 8 x 32 tile.
        ///
        /// # Safety
        /// The CPU must have AVX-512F; `acc` must hold 32 values at each `r * crs` (`r < 8`),
        /// `ap` `8 k`, and `b` 32 at each `kk * bks`.
        tile_8x32, "avx512f", 8, 16,
        _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps
    );

    tile_kernel!(
        /// A 4 x 16 tile.
        ///
        /// # Safety
        /// The CPU must have AVX2 and FMA; `acc` must hold 16 values at each `r * crs` (`r <
        /// 4`), `ap` `4 k`, and `b` 16 at each `kk * bks`.
        tile_4x16, "avx2,fma", 4, 8,
        _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps
    );
}

/// `a * b + c`, fused when `FMA`.
#[inline(always)]
fn madd<F: Float, const FMA: bool>(a: F, b: F, c: F) -> F {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `c[i][j] = sum_kk a[i][kk] b[kk][j]` (`+=` with `accumulate`) for `i < m`, `j < n`,
/// `kk < k`: rows of `c` are `crs` apart, `a[i][kk]` lies at `i * ars + kk * acs` of `a.0`
/// (`a = (data, ars, acs)`), and row `kk` of `b` at `kk * b.1` of `b.0`, its columns
/// contiguous.
///
/// `MR x NR` tiles of `c` stay in registers over the whole reduction (through intrinsics for
/// f32 where `X86` says the CPU has them: the compiler does not vectorise the generic loop),
/// with `MR` rows of `a` packed into `ap` once for all the tiles of their rows, so each loaded
/// value feeds `MR` or `NR / lanes` multiply-adds (the kernels this replaced fed one or two).
/// Every element is one
/// chain of (fused, with `FMA`) multiply-adds over `kk` in order, from zero or from its old
/// value: the result does not depend on the tile sizes, so the AVX2 and AVX-512 copies agree
/// bitwise.
#[inline(always)]
pub(super) fn gemm<F: Float, const FMA: bool, const X86: u8, const MR: usize, const NR: usize>(
    c: &mut [F],
    crs: usize,
    (m, n, k): (usize, usize, usize),
    (ad, ars, acs): (&[F], usize, usize),
    (b, bks): (&[F], usize),
    accumulate: bool,
    ap: &mut Vec<F>,
) {
    for i0 in (0..m).step_by(MR) {
        let rows = MR.min(m - i0);
        ap.clear();
        ap.resize(k * MR, F::ZERO);
        if ars == 1 {
            // a transposed operand (`dS^T`, `P^T`): a unit's rows are adjacent, one copy
            for (kk, apk) in ap.chunks_exact_mut(MR).enumerate() {
                apk[..rows].copy_from_slice(&ad[i0 + kk * acs..][..rows]);
            }
        } else if acs == 1
            && match (as_f32(&ad[i0 * ars..]), as_f32_mut(ap)) {
                // rows with their units adjacent (`q`, `dO`, `P`, `dS`): a transpose
                (Some(a), Some(p)) => crate::fastmath::transpose_f32(a, (rows, k, ars), p, MR),
                _ => false,
            }
        {
            // packed by the transpose
        } else {
            for (kk, apk) in ap.chunks_exact_mut(MR).enumerate() {
                for (r, v) in apk.iter_mut().enumerate().take(rows) {
                    *v = ad[(i0 + r) * ars + kk * acs];
                }
            }
        }
        for j0 in (0..n).step_by(NR) {
            let cols = NR.min(n - j0);
            // a whole tile runs on the vector kernel straight in `c` (no copy in and out)
            if rows == MR && cols == NR {
                let tile = (&mut c[i0 * crs + j0..], crs, accumulate);
                if simd_tile::<F, MR, NR>(X86, tile, ap, (b, bks), j0, k) {
                    continue;
                }
            }
            let mut acc = [[F::ZERO; NR]; MR];
            if accumulate {
                for (r, accr) in acc.iter_mut().enumerate().take(rows) {
                    accr[..cols].copy_from_slice(&c[(i0 + r) * crs + j0..][..cols]);
                }
            }
            // a partial tile runs whole on the vector kernel where `b` has the columns to read
            // (the extra ones land in `acc` only): each element's chain is the same
            let tile = (acc.as_flattened_mut(), NR, true);
            if simd_tile::<F, MR, NR>(X86, tile, ap, (b, bks), j0, k) {
                // done by the vector kernel
            } else if cols == NR {
                for (kk, apk) in ap.chunks_exact(MR).enumerate() {
                    let brow = &b[kk * bks + j0..][..NR];
                    for (accr, &av) in acc.iter_mut().zip(apk) {
                        for (y, &bv) in accr.iter_mut().zip(brow) {
                            *y = madd::<F, FMA>(av, bv, *y);
                        }
                    }
                }
            } else {
                for (kk, apk) in ap.chunks_exact(MR).enumerate() {
                    let brow = &b[kk * bks + j0..][..cols];
                    for (accr, &av) in acc.iter_mut().zip(apk) {
                        for (y, &bv) in accr.iter_mut().zip(brow) {
                            *y = madd::<F, FMA>(av, bv, *y);
                        }
                    }
                }
            }
            for (r, accr) in acc.iter().enumerate().take(rows) {
                c[(i0 + r) * crs + j0..][..cols].copy_from_slice(&accr[..cols]);
            }
        }
    }
}

/// `dst = scale * src` for the rows `rows` of `src` (`rs` apart) in the arithmetic type,
/// `[rows, dh]` contiguous.
#[inline(always)]
pub(super) fn widen<T: Elem>(
    src: &[T],
    rows: std::ops::Range<usize>,
    rs: usize,
    dh: usize,
    scale: T::F,
    dst: &mut Vec<T::F>,
) {
    dst.clear();
    for j in rows {
        dst.extend(row(src, j, rs, dh).iter().map(|&x| x.load() * scale));
    }
}

/// `t` rows of `dh` (`rs` apart) to `[dh, t]`, widened: blocks of 16 rows, each output row
/// written 16 contiguous values at a time (row by row, every value went to its own cache
/// line: the scalar stores were a quarter of the attention backward's own time).
#[inline(always)]
pub(super) fn transpose<T: Elem>(src: &[T], t: usize, dh: usize, rs: usize, dst: &mut Vec<T::F>) {
    const BLOCK: usize = 16;
    dst.clear();
    dst.resize(t * dh, <T::F as Float>::ZERO);
    // f32 rows need no widening: 8 x 8 blocks on the vector unit
    if let (Some(s), Some(d)) = (as_f32(src), as_f32_mut(dst)) {
        if crate::fastmath::transpose_f32(s, (t, dh, rs), d, t) {
            return;
        }
    }
    for j0 in (0..t).step_by(BLOCK) {
        let jn = BLOCK.min(t - j0);
        let mut rows: [&[T]; BLOCK] = [&[]; BLOCK];
        for (i, r) in rows.iter_mut().enumerate().take(jn) {
            *r = row(src, j0 + i, rs, dh);
        }
        for (d, out) in dst.chunks_exact_mut(t).enumerate() {
            for (o, r) in out[j0..j0 + jn].iter_mut().zip(&rows) {
                *o = r[d].load();
            }
        }
    }
}

/// `x` as f32 values, where its element type is f32.
#[inline(always)]
fn as_f32<T: 'static>(x: &[T]) -> Option<&[f32]> {
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>())
        // SAFETY: `T` is f32 (the type ids are equal): same layout, same length
        .then(|| unsafe { std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()) })
}

/// `x` as mutable f32 values, where its element type is f32.
#[inline(always)]
fn as_f32_mut<T: 'static>(x: &mut [T]) -> Option<&mut [f32]> {
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
        // SAFETY: `T` is f32 (the type ids are equal): same layout, same length, and the
        // borrow of `x` is moved into the result
        Some(unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut f32, x.len()) })
    } else {
        None
    }
}

/// Sum in eight independent lanes.
#[inline(always)]
pub(super) fn sum<F: Float>(x: &[F]) -> F {
    let mut acc = [F::ZERO; 8];
    let c = x.chunks_exact(8);
    let mut s = F::ZERO;
    for &v in c.remainder() {
        s += v;
    }
    for c in c {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    for a in acc {
        s += a;
    }
    s
}

/// Dot product in sixteen independent lanes.
#[inline(always)]
pub(super) fn dot<F: Float, const FMA: bool>(a: &[F], b: &[F]) -> F {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [F::ZERO; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let mut s = F::ZERO;
    for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
        s = madd::<F, FMA>(x, y, s);
    }
    for (x, y) in ca.zip(cb) {
        for ((a, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *a = madd::<F, FMA>(x, y, *a);
        }
    }
    for a in acc {
        s += a;
    }
    s
}
