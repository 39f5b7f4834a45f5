//! bf16 matrix multiply on the CPU: `vdpbf16ps` (AVX-512 BF16) dot products of bf16 pairs
//! into f32 accumulators, one rounding to bf16 per output element.
//!
//! candle 0.11 has no bf16 CPU matmul: it widens both operands to f32, multiplies, and narrows
//! the result, so bf16 compute ran slower than f32. Here the operands are packed once into
//! pair-interleaved panels (rows of `A` as `(a[m, 2q], a[m, 2q+1])` 32-bit pairs, columns of `B`
//! as 32-column panels of the same pairs) and an 8 x 32 micro-kernel accumulates the whole
//! reduction in registers (`vdpbf16ps` adds two products per f32 lane per instruction, twice
//! f32 FMA's rate), then rounds each element to bf16 once (round to nearest even). Row panels
//! are shared out over candle's worker pool; the reduction order of an element does not depend
//! on the thread count, so results are deterministic.
//!
//! Where the CPU lacks `avx512_bf16` (checked once at run time) the product widens to f32 and
//! runs gemm's f32 kernel, as candle does.

use crate::tp::dense::{matmul_into, Mat};
use half::bf16;
use half::slice::HalfFloatSliceExt;
use std::borrow::Cow;
use std::sync::Mutex;

/// Rows of a micro-tile.
const MR: usize = 8;
/// Columns of a micro-tile (two vectors of 16 f32 lanes).
const NR: usize = 32;
/// Bytes of packed `B` columns one pass over the row panels keeps hot (about half a Zen 4 or
/// Ice Lake L2).
const B_BLOCK_BYTES: usize = 384 * 1024;
/// Row panels one work item takes.
const PANELS_PER_ITEM: usize = 2;

/// Whether the running CPU has the AVX-512 BF16 dot product.
pub(crate) fn has_bf16_dot() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// An operand element: its value rounded to bf16 (round to nearest even), as bits.
pub(crate) trait Operand: Copy + Sync {
    /// The bf16 bits of the value.
    fn bf16_bits(self) -> u32;
    /// The bf16 bits of a whole slice: borrowed for bf16, converted (vectorised where the CPU
    /// has avx512_bf16) for f32.
    fn bits_of(data: &[Self]) -> Cow<'_, [u16]>;
}

impl Operand for bf16 {
    #[inline(always)]
    fn bf16_bits(self) -> u32 {
        u32::from(self.to_bits())
    }
    fn bits_of(data: &[Self]) -> Cow<'_, [u16]> {
        Cow::Borrowed(data.reinterpret_cast())
    }
}

impl Operand for f32 {
    #[inline(always)]
    fn bf16_bits(self) -> u32 {
        u32::from(bf16::from_f32(self).to_bits())
    }
    fn bits_of(data: &[Self]) -> Cow<'_, [u16]> {
        let mut out = vec![0u16; data.len()];
        #[cfg(target_arch = "x86_64")]
        if has_bf16_dot() {
            let chunk = 1 << 15;
            let slots: Vec<Mutex<Option<&mut [u16]>>> =
                out.chunks_mut(chunk).map(|c| Mutex::new(Some(c))).collect();
            run_items(slots.len(), chunk, |i| {
                if let Some(o) = slots[i].lock().ok().and_then(|mut g| g.take()) {
                    let src = &data[i * chunk..i * chunk + o.len()];
                    // SAFETY: the CPU has avx512f and avx512bf16 (checked above)
                    unsafe { kernel::round_to_bf16(src, o) };
                }
            });
            return Cow::Owned(out);
        }
        for (o, &v) in out.iter_mut().zip(data) {
            *o = bf16::from_f32(v).to_bits();
        }
        Cow::Owned(out)
    }
}

/// An output element: bf16 (rounded once) or f32.
pub(crate) trait Output: Copy + Send + Sync {
    /// `old + v` (or `v`) in this type.
    fn store(old: Self, v: f32, accumulate: bool) -> Self;
    /// The same for a full row of a tile.
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512bf16; `dst` must hold NR elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn store_row(row: &[f32; NR], dst: &mut [Self], accumulate: bool);
}

impl Output for bf16 {
    #[inline(always)]
    fn store(old: Self, v: f32, accumulate: bool) -> Self {
        bf16::from_f32(if accumulate { old.to_f32() + v } else { v })
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn store_row(row: &[f32; NR], dst: &mut [Self], accumulate: bool) {
        // SAFETY: forwarded from the caller
        unsafe { kernel::store_row_bf16(row, dst, accumulate) }
    }
}

impl Output for f32 {
    #[inline(always)]
    fn store(old: Self, v: f32, accumulate: bool) -> Self {
        if accumulate {
            old + v
        } else {
            v
        }
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn store_row(row: &[f32; NR], dst: &mut [Self], accumulate: bool) {
        for (d, &v) in dst[..NR].iter_mut().zip(row) {
            *d = if accumulate { *d + v } else { v };
        }
    }
}

/// `dst = a b` (`+=` with `accumulate`), `dst` row-major `m x n`; the operands were checked
/// to cover their products.
pub(crate) fn gemm(
    dst: &mut [bf16],
    accumulate: bool,
    mnk: (usize, usize, usize),
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
) {
    gemm_any(dst, accumulate, mnk, a, b)
}

/// `dst = a b` (`+=` with `accumulate`) for f32 tensors with both operands rounded to bf16
/// and the products accumulated in f32 (see [`crate::tp::MatmulPrecision::Bf16`]).
pub(crate) fn gemm_f32(
    dst: &mut [f32],
    accumulate: bool,
    mnk: (usize, usize, usize),
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
) {
    gemm_any(dst, accumulate, mnk, a, b)
}

fn gemm_any<A: Operand, O: Output>(
    dst: &mut [O],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, A>,
    b: Mat<'_, A>,
) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_bf16_dot() && k > 0 {
        let (ab, bb) = (A::bits_of(a.data), A::bits_of(b.data));
        let a = Bits {
            data: &ab,
            rs: a.rs,
            cs: a.cs,
        };
        let b = Bits {
            data: &bb,
            rs: b.rs,
            cs: b.cs,
        };
        gemm_dot(dst, accumulate, (m, n, k), a, b);
        return;
    }
    widened(dst, accumulate, (m, n, k), a, b);
}

/// The f32 fallback: both operands' bf16 values widened whole, gemm's f32 kernel.
fn widened<A: Operand, O: Output>(
    dst: &mut [O],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, A>,
    b: Mat<'_, A>,
) {
    let wide = |x: &Mat<'_, A>| -> Vec<f32> {
        x.data
            .iter()
            .map(|v| f32::from_bits(v.bf16_bits() << 16))
            .collect()
    };
    let (aw, bw) = (wide(&a), wide(&b));
    let mut out = vec![0f32; m * n];
    let ok = matmul_into(
        &mut out,
        false,
        (m, n, k),
        Mat {
            data: &aw,
            rs: a.rs,
            cs: a.cs,
        },
        Mat {
            data: &bw,
            rs: b.rs,
            cs: b.cs,
        },
    );
    // the operands were checked already; the f32 copies have the same extents
    debug_assert!(ok.is_ok());
    for (d, v) in dst.iter_mut().zip(out) {
        *d = O::store(*d, v, accumulate);
    }
}

/// A `bf16` matrix as its bits, with strides.
#[derive(Clone, Copy)]
struct Bits<'a> {
    data: &'a [u16],
    rs: usize,
    cs: usize,
}

impl Bits<'_> {
    /// Element `(r, c)`, 0 past `limit` rows of the reduction (odd `k`).
    #[inline(always)]
    fn at(&self, r: usize, c: usize) -> u32 {
        u32::from(self.data[r * self.rs + c * self.cs])
    }
}

/// `B` (`k x n`) as `ceil(n / 32)` panels, each `ceil(k / 2)` rows of 32 column pairs
/// `(b[2q, c], b[2q + 1, c])`, zero beyond the edges.
fn pack_b(b: Bits<'_>, k: usize, n: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let full = k / 2;
    let panels = n.div_ceil(NR);
    let mut out = vec![0u32; panels * kp * NR];
    let slots: Vec<Mutex<Option<&mut [u32]>>> = out
        .chunks_mut(kp * NR)
        .map(|c| Mutex::new(Some(c)))
        .collect();
    let pack_panel = |j: usize, panel: &mut [u32]| {
        let c0 = j * NR;
        let width = NR.min(n - c0);
        if b.rs == 1 && b.cs != 1 {
            // each column's k run is contiguous: walk down columns
            for c in 0..width {
                let col = &b.data[(c0 + c) * b.cs..];
                for (q, pair) in col[..2 * full].chunks_exact(2).enumerate() {
                    panel[q * NR + c] = u32::from(pair[0]) | (u32::from(pair[1]) << 16);
                }
                if k % 2 == 1 {
                    panel[full * NR + c] = u32::from(col[k - 1]);
                }
            }
        } else if b.cs == 1 {
            // rows are contiguous: interleave two rows at a time
            for q in 0..kp {
                let lo = &b.data[2 * q * b.rs + c0..][..width];
                let dst = &mut panel[q * NR..q * NR + width];
                if 2 * q + 1 < k {
                    let hi = &b.data[(2 * q + 1) * b.rs + c0..][..width];
                    for ((d, &l), &h) in dst.iter_mut().zip(lo).zip(hi) {
                        *d = u32::from(l) | (u32::from(h) << 16);
                    }
                } else {
                    for (d, &l) in dst.iter_mut().zip(lo) {
                        *d = u32::from(l);
                    }
                }
            }
        } else {
            for q in 0..kp {
                for c in 0..width {
                    let hi = if 2 * q + 1 < k {
                        b.at(2 * q + 1, c0 + c)
                    } else {
                        0
                    };
                    panel[q * NR + c] = b.at(2 * q, c0 + c) | (hi << 16);
                }
            }
        }
    };
    run_items(slots.len(), kp * NR * 2, |j| {
        if let Some(panel) = slots[j].lock().ok().and_then(|mut g| g.take()) {
            pack_panel(j, panel);
        }
    });
    out
}

/// Rows `r0 .. r0 + MR` of `A` (`m x k`) as `ceil(k / 2)` groups of `MR` pairs
/// `(a[r, 2q], a[r, 2q + 1])`, zero beyond the edges.
fn pack_a(a: Bits<'_>, m: usize, k: usize, r0: usize, out: &mut [u32]) {
    let kp = k.div_ceil(2);
    let full = k / 2;
    let rows = MR.min(m - r0);
    if rows < MR {
        out[..kp * MR].fill(0);
    }
    if a.cs == 1 {
        for r in 0..rows {
            let row = &a.data[(r0 + r) * a.rs..];
            for (q, pair) in row[..2 * full].chunks_exact(2).enumerate() {
                out[q * MR + r] = u32::from(pair[0]) | (u32::from(pair[1]) << 16);
            }
            if k % 2 == 1 {
                out[full * MR + r] = u32::from(row[k - 1]);
            }
        }
    } else {
        for q in 0..kp {
            let dst = &mut out[q * MR..q * MR + rows];
            for (r, d) in dst.iter_mut().enumerate() {
                let hi = if 2 * q + 1 < k {
                    a.at(r0 + r, 2 * q + 1)
                } else {
                    0
                };
                *d = a.at(r0 + r, 2 * q) | (hi << 16);
            }
        }
    }
}

/// Runs `f(i)` for `i` in `0..n` on candle's worker pool when the work is large enough.
fn run_items(n: usize, work_per_item: usize, f: impl Fn(usize) + Sync) {
    if n <= 1 || n * work_per_item < 1 << 16 {
        (0..n).for_each(f);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(n, |range| range.for_each(&f));
    }
}

#[cfg(target_arch = "x86_64")]
fn gemm_dot<O: Output>(
    dst: &mut [O],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Bits<'_>,
    b: Bits<'_>,
) {
    let kp = k.div_ceil(2);
    let packed_b = pack_b(b, k, n);
    let n_panels = n.div_ceil(NR);
    // column panels per block: the block's packed B stays in L2 while every row panel of a
    // work item passes over it
    let block = (B_BLOCK_BYTES / (kp * NR * 4)).clamp(1, n_panels);
    let rows_per_item = MR * PANELS_PER_ITEM;
    let items: Vec<Mutex<Option<&mut [O]>>> = dst[..m * n]
        .chunks_mut(rows_per_item * n)
        .map(|c| Mutex::new(Some(c)))
        .collect();
    let item_work = rows_per_item * n * k;
    run_items(items.len(), item_work, |i| {
        let Some(out) = items[i].lock().ok().and_then(|mut g| g.take()) else {
            return;
        };
        let r_first = i * rows_per_item;
        let panels = (out.len() / n).div_ceil(MR);
        let mut pa = vec![0u32; panels * kp * MR];
        for (p, chunk) in pa.chunks_mut(kp * MR).enumerate() {
            pack_a(a, m, k, r_first + p * MR, chunk);
        }
        let mut tile = [[0f32; NR]; MR];
        for j0 in (0..n_panels).step_by(block) {
            for (p, pap) in pa.chunks(kp * MR).enumerate() {
                let rows = MR.min(out.len() / n - p * MR);
                for j in j0..(j0 + block).min(n_panels) {
                    let pb = &packed_b[j * kp * NR..(j + 1) * kp * NR];
                    let cols = NR.min(n - j * NR);
                    // SAFETY: the CPU has avx512f and avx512bf16 (checked by the caller);
                    // `pap` holds kp * MR and `pb` kp * NR packed pairs
                    unsafe { kernel::tile(kp, pap, pb, &mut tile) };
                    for (r, trow) in tile.iter().enumerate().take(rows) {
                        let o = (p * MR + r) * n + j * NR;
                        let dr = &mut out[o..o + cols];
                        if cols == NR {
                            // SAFETY: as above; `dr` holds NR elements
                            unsafe { O::store_row(trow, dr, accumulate) };
                        } else {
                            for (d, &v) in dr.iter_mut().zip(trow) {
                                *d = O::store(*d, v, accumulate);
                            }
                        }
                    }
                }
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use super::{MR, NR};
    use half::bf16;
    use std::arch::x86_64::*;

    /// 32 bf16 held as 16 pairs.
    #[inline(always)]
    fn as_bh(v: __m512i) -> __m512bh {
        // SAFETY: both are 64-byte vectors of plain bits; every bit pattern is a valid bf16
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// `tile = A_panel B_panel` over `kp` pairs.
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512bf16; `a` must hold `kp * MR` and `b` `kp * NR`
    /// elements.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn tile(kp: usize, a: &[u32], b: &[u32], tile: &mut [[f32; NR]; MR]) {
        debug_assert!(a.len() >= kp * MR && b.len() >= kp * NR);
        let mut c = [[_mm512_setzero_ps(); 2]; MR];
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        for q in 0..kp {
            // SAFETY: q < kp, so both reads stay inside the slices (checked above)
            let (b0, b1) = unsafe {
                (
                    _mm512_loadu_si512(bp.add(q * NR) as *const __m512i),
                    _mm512_loadu_si512(bp.add(q * NR + 16) as *const __m512i),
                )
            };
            let (b0, b1) = (as_bh(b0), as_bh(b1));
            for (r, cr) in c.iter_mut().enumerate() {
                // SAFETY: q * MR + r < kp * MR
                let pair = unsafe { *ap.add(q * MR + r) } as i32;
                let av = as_bh(_mm512_set1_epi32(pair));
                cr[0] = _mm512_dpbf16_ps(cr[0], av, b0);
                cr[1] = _mm512_dpbf16_ps(cr[1], av, b1);
            }
        }
        for (out, cr) in tile.iter_mut().zip(c) {
            // SAFETY: each row of the tile holds NR = 32 f32
            unsafe {
                _mm512_storeu_ps(out.as_mut_ptr(), cr[0]);
                _mm512_storeu_ps(out.as_mut_ptr().add(16), cr[1]);
            }
        }
    }

    /// `out[i] = bits(round_bf16(src[i]))`, round to nearest even.
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512bf16; `out` must be as long as `src`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn round_to_bf16(src: &[f32], out: &mut [u16]) {
        let n = src.len().min(out.len());
        let full = n / 16 * 16;
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n for both slices
            unsafe {
                let v = _mm512_loadu_ps(src.as_ptr().add(i));
                let r = _mm512_cvtneps_pbh(v);
                _mm256_storeu_si256(
                    out.as_mut_ptr().add(i) as *mut __m256i,
                    std::mem::transmute::<__m256bh, __m256i>(r),
                );
            }
            i += 16;
        }
        for (o, &v) in out[full..n].iter_mut().zip(&src[full..n]) {
            *o = bf16::from_f32(v).to_bits();
        }
    }

    /// `dst = round(row)` (or `round(dst + row)`), 32 elements, round to nearest even.
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512bf16; `dst` must hold NR elements.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn store_row_bf16(row: &[f32; NR], dst: &mut [bf16], accumulate: bool) {
        debug_assert!(dst.len() >= NR);
        for h in 0..2 {
            // SAFETY: h * 16 + 16 <= NR for both the row and dst
            unsafe {
                let mut v = _mm512_loadu_ps(row.as_ptr().add(16 * h));
                let d = dst.as_mut_ptr().add(16 * h) as *mut __m256i;
                if accumulate {
                    let old = _mm512_cvtepu16_epi32(_mm256_loadu_si256(d));
                    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(old)));
                }
                let r = _mm512_cvtneps_pbh(v);
                _mm256_storeu_si256(d, std::mem::transmute::<__m256bh, __m256i>(r));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(n: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                bf16::from_f64(((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0)
            })
            .collect()
    }

    /// Every stride pattern and edge size against an f64 product of the same bf16 values:
    /// within one bf16 rounding of the exact sum (plus f32 accumulation).
    #[test]
    fn bf16_gemm_matches_f64_for_every_layout() {
        for &(m, n, k) in &[(1, 1, 1), (3, 5, 7), (8, 32, 2), (17, 33, 9), (40, 70, 129)] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let av = rand(m * k, 1);
                let bv = rand(k * n, 2);
                let a = if ta {
                    Mat {
                        data: &av,
                        rs: 1,
                        cs: m,
                    }
                } else {
                    Mat {
                        data: &av,
                        rs: k,
                        cs: 1,
                    }
                };
                let b = if tb {
                    Mat {
                        data: &bv,
                        rs: 1,
                        cs: k,
                    }
                } else {
                    Mat {
                        data: &bv,
                        rs: n,
                        cs: 1,
                    }
                };
                for accumulate in [false, true] {
                    let init = rand(m * n, 3);
                    let mut dst = init.clone();
                    gemm(&mut dst, accumulate, (m, n, k), a, b);
                    for i in 0..m {
                        for j in 0..n {
                            let mut exact = if accumulate {
                                init[i * n + j].to_f64()
                            } else {
                                0.0
                            };
                            for kk in 0..k {
                                exact += a.data[i * a.rs + kk * a.cs].to_f64()
                                    * b.data[kk * b.rs + j * b.cs].to_f64();
                            }
                            let got = dst[i * n + j].to_f64();
                            let tol = exact.abs() * 2f64.powi(-8) + 1e-5 * k as f64;
                            assert!(
                                (got - exact).abs() <= tol,
                                "{m}x{n}x{k} ta={ta} tb={tb} acc={accumulate} [{i},{j}]: {got} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The dot-product kernel and the widened fallback agree to a rounding, and each is
    /// deterministic.
    #[test]
    fn kernel_and_fallback_agree() {
        let (m, n, k) = (37, 70, 300);
        let (av, bv) = (rand(m * k, 4), rand(k * n, 5));
        let a = Mat {
            data: &av,
            rs: k,
            cs: 1,
        };
        let b = Mat {
            data: &bv,
            rs: 1,
            cs: k,
        };
        let mut fast = vec![bf16::ZERO; m * n];
        gemm(
            &mut fast,
            false,
            (m, n, k),
            a,
            Mat {
                data: &bv,
                rs: n,
                cs: 1,
            },
        );
        let mut again = vec![bf16::ZERO; m * n];
        gemm(
            &mut again,
            false,
            (m, n, k),
            a,
            Mat {
                data: &bv,
                rs: n,
                cs: 1,
            },
        );
        assert_eq!(fast, again);
        let mut slow = vec![bf16::ZERO; m * n];
        widened(
            &mut slow,
            false,
            (m, n, k),
            a,
            Mat {
                data: &bv,
                rs: n,
                cs: 1,
            },
        );
        let worst = fast
            .iter()
            .zip(&slow)
            .map(|(x, y)| (x.to_f32() - y.to_f32()).abs() / y.to_f32().abs().max(1.0))
            .fold(0f32, f32::max);
        assert!(worst <= 2f32.powi(-7), "worst {worst}");
        let _ = b;
        if !has_bf16_dot() {
            println!("this CPU has no avx512_bf16: the dot-product kernel was not exercised");
        }
    }
}
