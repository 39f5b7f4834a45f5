//! The AVX-512 micro-kernels of [`super`] (f32 FMA and the bf16 dot product) and the
//! rounding of f32 values to bf16 pairs as they are packed.

use super::{MR, NR};
use std::arch::x86_64::*;

/// 32 bf16 held as 16 pairs.
#[inline(always)]
fn as_bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64-byte vectors of plain bits; every bit pattern is a valid bf16
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Where a kernel leaves its `MR x NR` (12 x 32) tile: rows `crs` apart from `c`, stored, or added to
/// what is there with `add` (the sums then start from those values).
pub(super) struct Dst {
    pub(super) c: *mut f32,
    pub(super) crs: usize,
    pub(super) add: bool,
}

/// The accumulators' start: the tile's values with `add`, zero otherwise.
///
/// # Safety
/// The CPU must have avx512f; with `add`, the tile must be readable.
#[inline(always)]
unsafe fn start(d: &Dst) -> [[__m512; 2]; MR] {
    // SAFETY: the CPU has avx512f (the caller's contract)
    let mut c = [[unsafe { _mm512_setzero_ps() }; 2]; MR];
    if d.add {
        for (r, cr) in c.iter_mut().enumerate() {
            // SAFETY: the tile is readable (the caller's contract)
            unsafe {
                cr[0] = _mm512_loadu_ps(d.c.add(r * d.crs));
                cr[1] = _mm512_loadu_ps(d.c.add(r * d.crs + 16));
            }
        }
    }
    c
}

/// Stores the `MR x NR` accumulators into the tile.
///
/// # Safety
/// The CPU must have avx512f; the tile must be writable.
#[inline(always)]
unsafe fn store(c: [[__m512; 2]; MR], d: &Dst) {
    for (r, cr) in c.iter().enumerate() {
        // SAFETY: the tile is writable (the caller's contract)
        unsafe {
            _mm512_storeu_ps(d.c.add(r * d.crs), cr[0]);
            _mm512_storeu_ps(d.c.add(r * d.crs + 16), cr[1]);
        }
    }
}

/// Units of `B` ahead of the one being multiplied whose two cache lines the kernels ask into
/// L1 ([`prefetch_unit`]): a packed panel block comes from L2 (the micro-tile's rows of `A`
/// stay in L1 across the block's panels), and the hardware's own prefetch left the FMAs
/// waiting on it. Measured on an Emerald Rapids Xeon, 2 threads, each product alternated
/// with and without in one process at d512's shapes: 4-8% more GFLOP/s on every forward,
/// input-gradient and weight-gradient product (for example the QKV forward 278 → 291, the
/// vocabulary product's input gradient 234 → 253); 8, 16 and 24 units ahead measured alike.
const PREFETCH_UNITS: usize = 16;

/// Asks for the 128 bytes of one unit of a `B` panel (`NR` f32 values or bf16 pairs) at `p`
/// into L1. A hint only: an address past the panel's end reads nothing and cannot fault.
#[inline(always)]
fn prefetch_unit(p: *const f32) {
    let p = p as *const i8;
    // SAFETY: `prefetcht0` has no architectural effect beyond the caches and never faults;
    // SSE is part of x86_64
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(p);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
    }
}

/// `tile (+)= A B` over `units` bf16 pairs: pair `(r, q)` of `A` is the u32 at u16 offset
/// `r * ars + q * aqs` from `a`, unit `q` of `B` the 32 pairs at `b + q * NR`.
///
/// # Safety
/// The CPU must have avx512f and avx512bf16; every pair and unit read must lie inside one
/// allocation, and the tile of `dst` be readable and writable.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn tile_bf16(
    units: usize,
    a: *const u16,
    ars: usize,
    aqs: usize,
    b: *const u32,
    dst: Dst,
) {
    // SAFETY: the tile is readable (the caller's contract)
    let mut c = unsafe { start(&dst) };
    for q in 0..units {
        // SAFETY: in bounds by the caller's contract
        let (b0, b1) = unsafe {
            (
                as_bh(_mm512_loadu_si512(b.add(q * NR) as *const __m512i)),
                as_bh(_mm512_loadu_si512(b.add(q * NR + 16) as *const __m512i)),
            )
        };
        prefetch_unit(b.wrapping_add((q + PREFETCH_UNITS) * NR) as *const f32);
        for (r, cr) in c.iter_mut().enumerate() {
            // SAFETY: in bounds by the caller's contract; the pair may be unaligned
            let pair = unsafe { (a.add(r * ars + q * aqs) as *const u32).read_unaligned() };
            let av = as_bh(_mm512_set1_epi32(pair as i32));
            cr[0] = _mm512_dpbf16_ps(cr[0], av, b0);
            cr[1] = _mm512_dpbf16_ps(cr[1], av, b1);
        }
    }
    // SAFETY: the tile is writable (the caller's contract)
    unsafe { store(c, &dst) };
}

/// `tile (+)= A B` over `units` f32 values, one FMA per product: `A[r, kk]` at
/// `a + r * ars + kk * aks`, row `kk` of `B` the 32 values at `b + kk * bks`.
///
/// # Safety
/// The CPU must have avx512f; every element read must lie inside one allocation, and the
/// tile of `dst` be readable and writable.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_f32(
    units: usize,
    a: *const f32,
    ars: usize,
    aks: usize,
    b: *const f32,
    bks: usize,
    dst: Dst,
) {
    // SAFETY: the tile is readable (the caller's contract)
    let mut c = unsafe { start(&dst) };
    for kk in 0..units {
        // SAFETY: in bounds by the caller's contract
        let (b0, b1) = unsafe {
            (
                _mm512_loadu_ps(b.add(kk * bks)),
                _mm512_loadu_ps(b.add(kk * bks + 16)),
            )
        };
        prefetch_unit(b.wrapping_add((kk + PREFETCH_UNITS) * bks));
        for (r, cr) in c.iter_mut().enumerate() {
            // SAFETY: in bounds by the caller's contract
            let av = _mm512_set1_ps(unsafe { *a.add(r * ars + kk * aks) });
            cr[0] = _mm512_fmadd_ps(av, b0, cr[0]);
            cr[1] = _mm512_fmadd_ps(av, b1, cr[1]);
        }
    }
    // SAFETY: the tile is writable (the caller's contract)
    unsafe { store(c, &dst) };
}

/// 16 values rounded to bf16 (nearest even), each zero-extended to a 32-bit lane.
///
/// # Safety
/// The CPU must have avx512f and avx512bf16.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_lanes(v: __m512) -> __m512i {
    // SAFETY: both are 32-byte vectors of plain bits
    let h = unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v)) };
    _mm512_cvtepu16_epi32(h)
}

/// `out[q] = (bf16(src[2q]), bf16(src[2q + 1]))` as u32 pairs, 16 pairs at a time;
/// returns how many pairs it wrote (the rest are the caller's).
///
/// # Safety
/// The CPU must have avx512f and avx512bf16; `src` must hold `2 out.len()` values.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn pairs_along(src: &[f32], out: &mut [u32]) -> usize {
    let n = out.len().min(src.len() / 2) / 16 * 16;
    let mut q = 0;
    while q < n {
        // SAFETY: 2q + 32 <= src.len() and q + 16 <= out.len()
        unsafe {
            let v0 = _mm512_loadu_ps(src.as_ptr().add(2 * q));
            let v1 = _mm512_loadu_ps(src.as_ptr().add(2 * q + 16));
            // lanes 0..16 from v0, 16..32 from v1: the values in order, read as pairs
            let r = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(v1, v0));
            _mm512_storeu_si512(out.as_mut_ptr().add(q) as *mut __m512i, r);
        }
        q += 16;
    }
    n
}

/// `out[q * width + i] = (bf16(src[2q rs + i]), bf16(src[(2q + 1) rs + i]))` for
/// `q < units`, `i < width`, 16 values at a time (a last part through masks).
///
/// # Safety
/// The CPU must have avx512f and avx512bf16; `src` must hold
/// `(2 units - 1) rs + width` values and `out` `units * width` pairs.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn pairs_strided(
    src: *const f32,
    rs: usize,
    units: usize,
    width: usize,
    out: *mut u32,
) {
    for q in 0..units {
        // SAFETY: in bounds by the caller's contract
        let (lo, hi, o) = unsafe {
            (
                src.add(2 * q * rs),
                src.add((2 * q + 1) * rs),
                out.add(q * width),
            )
        };
        let mut i = 0;
        while i + 16 <= width {
            // SAFETY: i + 16 <= width values of each row and pairs of `o`
            unsafe {
                let l = bf16_lanes(_mm512_loadu_ps(lo.add(i)));
                let h = bf16_lanes(_mm512_loadu_ps(hi.add(i)));
                let p = _mm512_or_si512(l, _mm512_slli_epi32::<16>(h));
                _mm512_storeu_si512(o.add(i) as *mut __m512i, p);
            }
            i += 16;
        }
        if i < width {
            // SAFETY: the last `width - i` (< 16) values of each row and pairs of `o`, through
            // masks: lanes beyond them are neither read nor stored
            unsafe {
                let mask: __mmask16 = ((1u32 << (width - i)) - 1) as u16;
                let l = bf16_lanes(_mm512_maskz_loadu_ps(mask, lo.add(i)));
                let h = bf16_lanes(_mm512_maskz_loadu_ps(mask, hi.add(i)));
                let p = _mm512_or_si512(l, _mm512_slli_epi32::<16>(h));
                _mm512_mask_storeu_epi32(o.add(i) as *mut i32, mask, p);
            }
        }
    }
}

/// f32 values (as bits) rounded in place to f16 values (nearest even, beyond f16's range to
/// infinity) and widened back, 16 at a time through the hardware conversions
/// (`vcvtps2ph`, `vcvtph2ps`); NaN lanes are kept as they are, so every lane is bitwise
/// [`crate::fastmath::round_f16`]'s result, which the tail uses.
///
/// # Safety
/// The CPU must have avx512f.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn round_f16_in_place(bits: &mut [u32]) {
    let p = bits.as_mut_ptr();
    // SAFETY: `bits` holds `len` values, read and written through the one pointer
    unsafe { round_f16_raw(p as *const f32, p, bits.len()) }
}

/// [`round_f16_in_place`] from `src` into `dst` (as bits; the shorter's length): a copy and
/// the rounding in one pass.
///
/// # Safety
/// The CPU must have avx512f.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn round_f16_into(dst: &mut [u32], src: &[f32]) {
    let len = dst.len().min(src.len());
    // SAFETY: both slices hold `len` values; a `&mut` and a `&` never overlap
    unsafe { round_f16_raw(src.as_ptr(), dst.as_mut_ptr(), len) }
}

/// The rounding of [`round_f16_in_place`] from `len` values at `src` to `len` bit patterns at
/// `dst` (the same memory, or apart): each group of 16 is read whole before it is written.
///
/// # Safety
/// The CPU must have avx512f; `src` must hold `len` readable values and `dst` `len` writable
/// ones, either the same memory or not overlapping.
#[target_feature(enable = "avx512f")]
unsafe fn round_f16_raw(src: *const f32, dst: *mut u32, len: usize) {
    let done = len - len % 16;
    for i in (0..done).step_by(16) {
        // SAFETY: values i .. i + 16 <= len lie in both (the caller's contract)
        unsafe {
            let v = _mm512_loadu_ps(src.add(i));
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            _mm512_storeu_ps(
                dst.add(i) as *mut f32,
                _mm512_mask_blend_ps(nan, _mm512_cvtph_ps(h), v),
            );
        }
    }
    for i in done..len {
        // SAFETY: i < len (the caller's contract)
        unsafe { *dst.add(i) = crate::fastmath::round_f16(*src.add(i)).to_bits() };
    }
}
