//! Matrix multiply kernels of the CPU linear op, for AVX-512: f32 (FMA) and bf16 (the
//! `vdpbf16ps` dot product of bf16 pairs into f32).
//!
//! candle 0.11 has no bf16 CPU matmul (it widens both operands to f32, multiplies, narrows
//! the result), and gemm's f32 kernels reach about 110-160 GFLOP/s on 2 cores at the shapes
//! of a small GPT's linear layers, against about 200 at the largest. Both kernels here share
//! one structure: the operands are packed once into panels (rows of `A` in groups of 8, columns
//! of `B` in groups of 32; for bf16 each element a 32-bit pair `(x[2q], x[2q + 1])` along the
//! reduction), an 8 x 32 micro-kernel keeps its tile in 16 vector registers over a block of
//! the reduction, and blocks of `B` panels stay in L2 while the row panels of a work item pass
//! over them. bf16 operands come from bf16 tensors as they are, or from f32 tensors rounded to
//! nearest even (`vcvtneps2bf16`) as they are packed: f32 storage with bf16 products, the
//! hardware's double rate (see [`crate::tp::MatmulPrecision`]). Accumulation is f32; a bf16
//! result is rounded once at the end.
//!
//! Work items (16 to 64 rows each) are shared out over candle's worker pool. Every output
//! element is summed by one thread in a fixed order (reduction blocks in order, each block's
//! terms in order), so results do not depend on the thread count or on the rows per item: the
//! same inputs give the same bits.
//!
//! Without AVX-512 (checked once at run time) f32 goes to gemm's kernels, and bf16 widens to
//! f32 first, as candle does.

use crate::fastmath::has_avx512;
use crate::tp::dense::Mat;
use half::bf16;
use half::slice::HalfFloatSliceExt;
use std::sync::Mutex;

/// Row stride (in f32) from which `B` is packed even where its rows could be read in place:
/// a panel's rows then fall into few L1 and L2 sets (a stride of a multiple of 4 KiB maps them
/// all to one) and evict each other, which ran the product at a third of its packed speed at
/// n = 2048 and 8192.
const DIRECT_B_MAX_STRIDE: usize = 1024;
/// Rows of a micro-tile.
const MR: usize = 8;
/// Columns of a micro-tile (two vectors of 16 f32 lanes).
const NR: usize = 32;
/// Reduction units (f32 values, or bf16 pairs) of one block: a packed `B` panel block is
/// `NR * KC * 4` = 32 KiB.
const KC: usize = 256;
/// Bytes of packed `B` one pass over a work item's row panels keeps hot (about a third of a
/// 1 MiB L2).
const B_BLOCK_BYTES: usize = 384 * 1024;
/// Units of a `B` panel packed together from a transposed `B` (64 rows of the panel, 8 KiB).
const PACK_BLOCK: usize = 64;
/// Row panels one work item takes.
/// Row panels one work item takes: as many as leave about 8 items per thread, from 2 to 8.
/// An item streams all of `B` through L2 once, so more rows per item read it fewer times
/// (at n = 8192 and 2048 a product ran 30-40% faster with 8 panels than with 2).
fn panels_per_item(m: usize) -> usize {
    let threads = candle_core::utils::get_num_threads().max(1);
    (m / (MR * 8 * threads)).clamp(2, 8)
}

/// Whether the running CPU has the AVX-512 BF16 dot product (the bf16 kernel).
pub(crate) fn has_bf16_dot() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| has_avx512() && std::arch::is_x86_feature_detected!("avx512bf16"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A bf16 operand element: its value rounded to bf16 (round to nearest even).
pub(crate) trait Operand: Copy + Sync {
    /// The bf16 value, widened to f32.
    fn bf16_value(self) -> f32;
}

impl Operand for bf16 {
    #[inline(always)]
    fn bf16_value(self) -> f32 {
        self.to_f32()
    }
}

impl Operand for f32 {
    #[inline(always)]
    fn bf16_value(self) -> f32 {
        bf16::from_f32(self).to_f32()
    }
}

/// An output element: f32, or bf16 rounded once from the f32 sums.
pub(crate) trait Output: Copy + Send + Sync + 'static {
    /// Runs `f` on the f32 rows it should accumulate into (`dst` itself for f32, a scratch
    /// copy for bf16, rounded back afterwards); `f` gets whether the rows hold values to add to.
    fn through_f32(dst: &mut [Self], accumulate: bool, f: impl FnOnce(&mut [f32], bool));
    /// `old + v` (or `v`) in this type.
    fn store(old: Self, v: f32, accumulate: bool) -> Self;
}

impl Output for f32 {
    fn through_f32(dst: &mut [Self], accumulate: bool, f: impl FnOnce(&mut [f32], bool)) {
        f(dst, accumulate)
    }
    fn store(old: Self, v: f32, accumulate: bool) -> Self {
        if accumulate {
            old + v
        } else {
            v
        }
    }
}

impl Output for bf16 {
    fn through_f32(dst: &mut [Self], accumulate: bool, f: impl FnOnce(&mut [f32], bool)) {
        let mut acc: Vec<f32> = if accumulate {
            dst.iter().map(|v| v.to_f32()).collect()
        } else {
            vec![0f32; dst.len()]
        };
        f(&mut acc, accumulate);
        dst.convert_from_f32_slice(&acc);
    }
    fn store(old: Self, v: f32, accumulate: bool) -> Self {
        bf16::from_f32(if accumulate { old.to_f32() + v } else { v })
    }
}

/// `dst = a b` (`+=` with `accumulate`), `dst` row-major `m x n`, on the f32 kernel where the
/// CPU has AVX-512; returns false (nothing done) where it has not. The operands were checked
/// to cover their products.
pub(crate) fn gemm_f32_exact(
    dst: &mut [f32],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        if m > 0 && n > 0 {
            if k == 0 {
                if !accumulate {
                    dst[..m * n].fill(0.0);
                }
            } else {
                blocked(dst, accumulate, (m, n, k), &Packing::F32 { a, b });
            }
        }
        return true;
    }
    let _ = (dst, accumulate, m, n, k, a, b);
    false
}

/// `dst = a b` (`+=` with `accumulate`) for bf16 tensors, one rounding per element.
pub(crate) fn gemm_bf16(
    dst: &mut [bf16],
    accumulate: bool,
    mnk: (usize, usize, usize),
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
) {
    gemm_pairs(dst, accumulate, mnk, a, b)
}

/// `dst = a b` (`+=` with `accumulate`) for f32 tensors with both operands rounded to bf16
/// and the products accumulated in f32 (see [`crate::tp::MatmulPrecision::Bf16`]).
pub(crate) fn gemm_f32_bf16(
    dst: &mut [f32],
    accumulate: bool,
    mnk: (usize, usize, usize),
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
) {
    let (m, n, k) = mnk;
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_bf16_dot() && k > 0 {
        // rounded to bf16 pairs as they are packed: no rounded copy of either operand
        blocked(dst, accumulate, mnk, &Packing::F32AsBf16 { a, b });
        return;
    }
    widened(dst, accumulate, mnk, a, b);
}

fn gemm_pairs<O: Output>(
    dst: &mut [O],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_bf16_dot() && k > 0 {
        let (ab, bb): (&[u16], &[u16]) = (a.data.reinterpret_cast(), b.data.reinterpret_cast());
        let a = Bits {
            data: ab,
            rs: a.rs,
            cs: a.cs,
        };
        let b = Bits {
            data: bb,
            rs: b.rs,
            cs: b.cs,
        };
        blocked(dst, accumulate, (m, n, k), &Packing::Bf16 { a, b });
        return;
    }
    widened(dst, accumulate, (m, n, k), a, b);
}

/// The fallback without avx512_bf16: both operands' bf16 values widened whole, an f32 product.
fn widened<A: Operand, O: Output>(
    dst: &mut [O],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, A>,
    b: Mat<'_, A>,
) {
    let wide = |x: &Mat<'_, A>| -> Vec<f32> { x.data.iter().map(|v| v.bf16_value()).collect() };
    let (aw, bw) = (wide(&a), wide(&b));
    let mut out = vec![0f32; m * n];
    let ok = crate::tp::dense::matmul_into(
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

/// A bf16 matrix as its bits, with strides.
#[derive(Clone, Copy)]
struct Bits<'a> {
    data: &'a [u16],
    rs: usize,
    cs: usize,
}

/// The operands of one product and how they pack.
enum Packing<'a> {
    /// f32 values, one per reduction unit.
    F32 { a: Mat<'a, f32>, b: Mat<'a, f32> },
    /// bf16 pairs along the reduction, one pair per unit.
    Bf16 { a: Bits<'a>, b: Bits<'a> },
    /// f32 values rounded to bf16 pairs (nearest even) as they are packed.
    F32AsBf16 { a: Mat<'a, f32>, b: Mat<'a, f32> },
}

impl Packing<'_> {
    /// Reduction units of a length-`k` reduction.
    fn units(&self, k: usize) -> usize {
        match self {
            Packing::F32 { .. } => k,
            Packing::Bf16 { .. } | Packing::F32AsBf16 { .. } => k.div_ceil(2),
        }
    }

    /// Panel `j` of `B` (`k x n`): every unit's 32 columns, zero beyond the edges.
    fn pack_b_panel(&self, k: usize, n: usize, j: usize, panel: &mut [u32]) {
        let c0 = j * NR;
        let width = NR.min(n - c0);
        match self {
            Packing::F32 { b, .. } => {
                if b.rs == 1 && b.cs != 1 {
                    // each column's k run is contiguous: a transpose, in blocks of units whose
                    // panel rows stay in L1 while every column writes into them
                    for kk0 in (0..k).step_by(PACK_BLOCK) {
                        let kn = PACK_BLOCK.min(k - kk0);
                        let rows = &mut panel[kk0 * NR..(kk0 + kn) * NR];
                        for c in 0..width {
                            let col = &b.data[(c0 + c) * b.cs + kk0..][..kn];
                            for (dst, v) in rows.chunks_exact_mut(NR).zip(col) {
                                dst[c] = v.to_bits();
                            }
                        }
                    }
                } else if b.cs == 1 {
                    for kk in 0..k {
                        let src = &b.data[kk * b.rs + c0..][..width];
                        for (d, v) in panel[kk * NR..kk * NR + width].iter_mut().zip(src) {
                            *d = v.to_bits();
                        }
                    }
                } else {
                    for kk in 0..k {
                        let dst = &mut panel[kk * NR..kk * NR + width];
                        for (c, d) in dst.iter_mut().enumerate() {
                            *d = b.data[kk * b.rs + (c0 + c) * b.cs].to_bits();
                        }
                    }
                }
            }
            Packing::Bf16 { b, .. } => {
                let full = k / 2;
                let at = |r: usize, c: usize| u32::from(b.data[r * b.rs + c * b.cs]);
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
                } else {
                    for q in 0..k.div_ceil(2) {
                        let dst = &mut panel[q * NR..q * NR + width];
                        for (c, d) in dst.iter_mut().enumerate() {
                            let hi = if 2 * q + 1 < k {
                                at(2 * q + 1, c0 + c)
                            } else {
                                0
                            };
                            *d = at(2 * q, c0 + c) | (hi << 16);
                        }
                    }
                }
            }
            Packing::F32AsBf16 { b, .. } => {
                let full = k / 2;
                if width < NR {
                    panel[..k.div_ceil(2) * NR].fill(0);
                }
                if b.cs == 1
                    && width == NR
                    && full > 0
                    && pairs_strided(&b.data[c0..], b.rs, full, NR, panel)
                {
                    // two rows of 32 columns at a time: done
                } else if b.rs == 1 && b.cs != 1 {
                    // each column's k run is contiguous: its pairs are adjacent values
                    let mut run = vec![0u32; full];
                    for c in 0..width {
                        pairs_along(&b.data[(c0 + c) * b.cs..][..2 * full], &mut run);
                        for (q, &pair) in run.iter().enumerate() {
                            panel[q * NR + c] = pair;
                        }
                    }
                } else {
                    for q in 0..full {
                        for c in 0..width {
                            let at = |r: usize| b.data[r * b.rs + (c0 + c) * b.cs];
                            panel[q * NR + c] = pair_of(at(2 * q), at(2 * q + 1));
                        }
                    }
                }
                if k % 2 == 1 {
                    for c in 0..width {
                        let v = b.data[(k - 1) * b.rs + (c0 + c) * b.cs];
                        panel[full * NR + c] = pair_of(v, 0.0);
                    }
                }
            }
        }
    }

    /// Rows `r0 .. r0 + MR` of `A` (`m x k`): every unit's 8 rows, zero beyond the edges.
    fn pack_a_panel(&self, m: usize, k: usize, r0: usize, out: &mut [u32]) {
        let units = self.units(k);
        let rows = MR.min(m - r0);
        if rows < MR {
            out[..units * MR].fill(0);
        }
        match self {
            Packing::F32 { a, .. } => {
                if a.cs == 1 {
                    for r in 0..rows {
                        let row = &a.data[(r0 + r) * a.rs..][..k];
                        for (kk, v) in row.iter().enumerate() {
                            out[kk * MR + r] = v.to_bits();
                        }
                    }
                } else {
                    for kk in 0..k {
                        let dst = &mut out[kk * MR..kk * MR + rows];
                        for (r, d) in dst.iter_mut().enumerate() {
                            *d = a.data[(r0 + r) * a.rs + kk * a.cs].to_bits();
                        }
                    }
                }
            }
            Packing::Bf16 { a, .. } => {
                let full = k / 2;
                let at = |r: usize, c: usize| u32::from(a.data[r * a.rs + c * a.cs]);
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
                    for q in 0..units {
                        let dst = &mut out[q * MR..q * MR + rows];
                        for (r, d) in dst.iter_mut().enumerate() {
                            let hi = if 2 * q + 1 < k {
                                at(r0 + r, 2 * q + 1)
                            } else {
                                0
                            };
                            *d = at(r0 + r, 2 * q) | (hi << 16);
                        }
                    }
                }
            }
            Packing::F32AsBf16 { a, .. } => {
                let full = k / 2;
                if a.cs == 1 {
                    // each row's pairs are adjacent values
                    let mut run = vec![0u32; full];
                    for r in 0..rows {
                        pairs_along(&a.data[(r0 + r) * a.rs..][..2 * full], &mut run);
                        for (q, &pair) in run.iter().enumerate() {
                            out[q * MR + r] = pair;
                        }
                    }
                } else if a.rs == 1
                    && rows == MR
                    && full > 0
                    && pairs_strided(&a.data[r0..], a.cs, full, MR, out)
                {
                    // the 8 rows of a unit's two values are adjacent: done
                } else {
                    for q in 0..full {
                        for r in 0..rows {
                            let at = |c: usize| a.data[(r0 + r) * a.rs + c * a.cs];
                            out[q * MR + r] = pair_of(at(2 * q), at(2 * q + 1));
                        }
                    }
                }
                if k % 2 == 1 {
                    for r in 0..rows {
                        out[full * MR + r] = pair_of(a.data[(r0 + r) * a.rs + (k - 1) * a.cs], 0.0);
                    }
                }
            }
        }
    }

    /// All the row panels of a work item's `rows` rows from `r0` at once, where that reads
    /// memory better than panel by panel: f32 rounded to bf16 from a transposed `A`, whose
    /// `rows` values of one reduction index are adjacent. Panel by panel, each read took 32
    /// bytes of a row that may lie 32 KiB from the next (the vocabulary product's gradient);
    /// here it takes the item's whole run. `None` where this does not apply.
    fn pack_a_item(&self, k: usize, r0: usize, rows: usize) -> Option<Vec<Vec<u32>>> {
        let Packing::F32AsBf16 { a, .. } = self else {
            return None;
        };
        let full = k / 2;
        if a.rs != 1 || a.cs == 1 || rows == 0 || rows % MR != 0 || full == 0 {
            return None;
        }
        let mut run = vec![0u32; full * rows];
        if !pairs_strided(a.data.get(r0..)?, a.cs, full, rows, &mut run) {
            return None;
        }
        let units = k.div_ceil(2);
        let mut panels = vec![vec![0u32; units * MR]; rows / MR];
        for (q, unit) in run.chunks_exact(rows).enumerate() {
            for (panel, vals) in panels.iter_mut().zip(unit.chunks_exact(MR)) {
                panel[q * MR..(q + 1) * MR].copy_from_slice(vals);
            }
        }
        if k % 2 == 1 {
            for (p, panel) in panels.iter_mut().enumerate() {
                for r in 0..MR {
                    let v = a.data[r0 + p * MR + r + (k - 1) * a.cs];
                    panel[full * MR + r] = pair_of(v, 0.0);
                }
            }
        }
        Some(panels)
    }

    /// Whether a full panel of `A` can be read in place (no packing): always for f32 (the
    /// kernel takes both strides), for bf16 when pairs are adjacent (`cs == 1`, `k` even).
    fn a_direct(&self, k: usize) -> bool {
        match self {
            Packing::F32 { .. } => true,
            Packing::Bf16 { a, .. } => a.cs == 1 && k % 2 == 0,
            Packing::F32AsBf16 { .. } => false,
        }
    }

    /// Whether full-width panels of `B` can be read in place: f32 with contiguous rows a short
    /// stride apart.
    fn b_direct(&self) -> bool {
        match self {
            Packing::F32 { b, .. } => b.cs == 1 && b.rs < DIRECT_B_MAX_STRIDE,
            Packing::Bf16 { .. } | Packing::F32AsBf16 { .. } => false,
        }
    }

    /// The tile `A[r0 .. r0 + MR, units u0 .. u1] B[units u0 .. u1, c0 .. c0 + NR]` with `A`
    /// from `pa` (packed, `units * MR` elements) or read in place, and `B` from `pb` (a packed
    /// panel, `units * NR` elements) or read in place, stored into (or, with `add`, added to)
    /// the `MR x NR` tile of `c` whose rows are `crs` apart. Returns false, computing nothing,
    /// if an in-place read would leave its slice (which the callers' choices rule out) or the
    /// tile would leave `c`.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    fn tile(
        &self,
        (u0, u1): (usize, usize),
        r0: usize,
        pa: Option<&[u32]>,
        c0: usize,
        pb: Option<&[u32]>,
        units: usize,
        (c, crs, add): (&mut [f32], usize, bool),
    ) -> bool {
        let len = u1 - u0;
        if len == 0 || crs < NR || (MR - 1) * crs + NR > c.len() {
            return false;
        }
        let dst = kernel::Dst {
            c: c.as_mut_ptr(),
            crs,
            add,
        };
        // (pointer, its slice's length from the pointer, row stride, unit stride): the largest
        // offset a kernel reads is (MR - 1) * row stride + (len - 1) * unit stride (+1 for a
        // bf16 pair)
        let fits = |avail: usize, rs: usize, ks: usize, rows: usize, extra: usize| {
            (rows - 1) * rs + (len - 1) * ks + extra < avail
        };
        match self {
            Packing::F32 { a, b } => {
                let (ap, aavail, ars, aks): (*const f32, usize, usize, usize) = match pa {
                    Some(p) => {
                        let s = &p[u0 * MR..units * MR];
                        (s.as_ptr() as *const f32, s.len(), 1, MR)
                    }
                    None => {
                        let off = r0 * a.rs + u0 * a.cs;
                        let Some(s) = a.data.get(off..) else {
                            return false;
                        };
                        (s.as_ptr(), s.len(), a.rs, a.cs)
                    }
                };
                let (bp, bavail, bks): (*const f32, usize, usize) = match pb {
                    Some(p) => {
                        let s = &p[u0 * NR..units * NR];
                        (s.as_ptr() as *const f32, s.len(), NR)
                    }
                    None => {
                        let off = u0 * b.rs + c0;
                        let Some(s) = b.data.get(off..) else {
                            return false;
                        };
                        (s.as_ptr(), s.len(), b.rs)
                    }
                };
                if !fits(aavail, ars, aks, MR, 0) || !fits(bavail, bks, bks, 1, NR - 1) {
                    return false;
                }
                // SAFETY: the CPU has avx512f (the caller checked); every element the kernel
                // reads lies inside the slices checked just above, and the tile it writes inside
                // `c` (checked on entry); u32 and f32 share size and alignment
                unsafe { kernel::tile_f32(len, ap, ars, aks, bp, bks, dst) };
                true
            }
            Packing::Bf16 { .. } | Packing::F32AsBf16 { .. } => {
                let (ap, aavail, ars, aqs): (*const u16, usize, usize, usize) = match (pa, self) {
                    (Some(p), _) => {
                        let s = &p[u0 * MR..units * MR];
                        (s.as_ptr() as *const u16, 2 * s.len(), 2, 2 * MR)
                    }
                    (None, Packing::F32AsBf16 { .. } | Packing::F32 { .. }) => return false,
                    (None, Packing::Bf16 { a, .. }) => {
                        let off = r0 * a.rs + 2 * u0;
                        let Some(s) = a.data.get(off..) else {
                            return false;
                        };
                        (s.as_ptr(), s.len(), a.rs, 2)
                    }
                };
                let Some(p) = pb else {
                    return false;
                };
                let bs = &p[u0 * NR..units * NR];
                if !fits(aavail, ars, aqs, MR, 1) || bs.len() < len * NR {
                    return false;
                }
                // SAFETY: the CPU has avx512f and avx512bf16 (the caller checked); every pair
                // the kernel reads lies inside the slices checked just above, and the tile it
                // writes inside `c` (checked on entry)
                unsafe { kernel::tile_bf16(len, ap, ars, aqs, bs.as_ptr(), dst) };
                true
            }
        }
    }
}

/// The bf16 pair `(lo, hi)` (each rounded to nearest even) as one u32, `lo` in the low half.
fn pair_of(lo: f32, hi: f32) -> u32 {
    u32::from(bf16::from_f32(lo).to_bits()) | (u32::from(bf16::from_f32(hi).to_bits()) << 16)
}

/// `out[q] = pair_of(src[2q], src[2q + 1])` for `q < out.len()` (`src` holds `2 out.len()`).
fn pairs_along(src: &[f32], out: &mut [u32]) {
    let n = out.len().min(src.len() / 2);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_bf16_dot() {
        // SAFETY: the CPU has avx512f and avx512bf16 (checked); the kernel reads `2 n` values
        // and writes `n` pairs, which the slices hold
        done = unsafe { kernel::pairs_along(&src[..2 * n], &mut out[..n]) };
    }
    for q in done..n {
        out[q] = pair_of(src[2 * q], src[2 * q + 1]);
    }
}

/// `out[q * width + i] = pair_of(src[2q rs + i], src[(2q + 1) rs + i])` for `q < units`,
/// `i < width`: pairs of rows `rs` apart, `width` values each. Returns false, writing nothing,
/// where `src` or `out` is too short (the callers then pack element by element).
fn pairs_strided(src: &[f32], rs: usize, units: usize, width: usize, out: &mut [u32]) -> bool {
    let reach = (2 * units).saturating_sub(1) * rs + width;
    if units == 0 || src.len() < reach || out.len() < units * width {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if has_bf16_dot() && width % 8 == 0 {
        // SAFETY: the CPU has avx512f and avx512bf16 (checked); every row read lies inside
        // `src` and every pair written inside `out` (both checked above)
        unsafe { kernel::pairs_strided(src.as_ptr(), rs, units, width, out.as_mut_ptr()) };
        return true;
    }
    for q in 0..units {
        for i in 0..width {
            out[q * width + i] = pair_of(src[2 * q * rs + i], src[(2 * q + 1) * rs + i]);
        }
    }
    true
}

/// Mutex slots handing out disjoint chunks of `data` to work items.
pub(crate) fn slots<T>(data: &mut [T], chunk: usize) -> Vec<Mutex<Option<&mut [T]>>> {
    data.chunks_mut(chunk.max(1))
        .map(|c| Mutex::new(Some(c)))
        .collect()
}

/// The chunk of a slot, once.
pub(crate) fn take<'a, T>(slot: &Mutex<Option<&'a mut [T]>>) -> Option<&'a mut [T]> {
    slot.lock().ok().and_then(|mut g| g.take())
}

/// Runs `f(i)` for `i` in `0..n` on candle's worker pool when the work is large enough.
pub(crate) fn run_items(n: usize, work_per_item: usize, f: impl Fn(usize) + Sync) {
    if n <= 1 || n * work_per_item < 1 << 16 {
        (0..n).for_each(f);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(n, |range| range.for_each(&f));
    }
}

/// The blocked product: `B` packed once (in parallel), then work items of 16 to 64 rows, each
/// packing its `A` rows and running the micro-kernel over reduction blocks, `B` panel blocks,
/// its row panels and the panels of the block, in that order.
#[cfg(target_arch = "x86_64")]
fn blocked<O: Output>(
    dst: &mut [O],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    packing: &Packing<'_>,
) {
    let units = packing.units(k);
    let n_panels = n.div_ceil(NR);
    // B is packed where it cannot be read in place: every panel, or only a partial last one
    let b_direct = packing.b_direct();
    let first_packed = if b_direct { n / NR } else { 0 };
    let mut packed_b = vec![0u32; (n_panels - first_packed) * units * NR];
    {
        let panels = slots(&mut packed_b, units * NR);
        run_items(panels.len(), units * NR * 2, |j| {
            if let Some(panel) = take(&panels[j]) {
                packing.pack_b_panel(k, n, first_packed + j, panel);
            }
        });
    }
    let kc = KC.min(units);
    // column panels per block: the block's B stays in L2 while every row panel of a work
    // item passes over it
    let block = (B_BLOCK_BYTES / (kc * NR * 4)).clamp(1, n_panels);
    let rows_per_item = MR * panels_per_item(m);
    let a_direct = packing.a_direct(k);
    let items = slots(&mut dst[..m * n], rows_per_item * n);
    run_items(items.len(), rows_per_item * n * k, |i| {
        let Some(out) = take(&items[i]) else {
            return;
        };
        let r_first = i * rows_per_item;
        let item_rows = out.len() / n;
        let panels = item_rows.div_ceil(MR);
        // A is packed where it cannot be read in place: a partial last panel, or bf16 pairs
        // that are not adjacent
        let packed_a: Vec<Option<Vec<u32>>> = match packing.pack_a_item(k, r_first, item_rows) {
            Some(panels) => panels.into_iter().map(Some).collect(),
            None => (0..panels)
                .map(|p| {
                    let rows = MR.min(item_rows - p * MR);
                    (!a_direct || rows < MR).then(|| {
                        let mut v = vec![0u32; units * MR];
                        packing.pack_a_panel(m, k, r_first + p * MR, &mut v);
                        v
                    })
                })
                .collect(),
        };
        let mut tile = [[0f32; NR]; MR];
        O::through_f32(out, accumulate, |acc, accumulate| {
            for u0 in (0..units).step_by(kc) {
                let u1 = (u0 + kc).min(units);
                let add = accumulate || u0 > 0;
                for j0 in (0..n_panels).step_by(block) {
                    for (p, pa) in packed_a.iter().enumerate() {
                        let rows = MR.min(item_rows - p * MR);
                        for j in j0..(j0 + block).min(n_panels) {
                            let pb = (j >= first_packed).then(|| {
                                &packed_b[(j - first_packed) * units * NR..][..units * NR]
                            });
                            let cols = NR.min(n - j * NR);
                            let o = p * MR * n + j * NR;
                            // a whole tile goes straight into the rows; an edge tile through
                            // `tile`
                            let direct = rows == MR
                                && cols == NR
                                && packing.tile(
                                    (u0, u1),
                                    r_first + p * MR,
                                    pa.as_deref(),
                                    j * NR,
                                    pb,
                                    units,
                                    (&mut acc[o..], n, add),
                                );
                            if direct {
                                continue;
                            }
                            let scratch = (tile.as_flattened_mut(), NR, false);
                            let done = packing.tile(
                                (u0, u1),
                                r_first + p * MR,
                                pa.as_deref(),
                                j * NR,
                                pb,
                                units,
                                scratch,
                            );
                            if !done {
                                // unreachable by the choices above; packed operands always fit
                                let mut a2 = vec![0u32; units * MR];
                                packing.pack_a_panel(m, k, r_first + p * MR, &mut a2);
                                let mut b2 = vec![0u32; units * NR];
                                packing.pack_b_panel(k, n, j, &mut b2);
                                packing.tile(
                                    (u0, u1),
                                    r_first + p * MR,
                                    Some(&a2),
                                    j * NR,
                                    Some(&b2),
                                    units,
                                    (tile.as_flattened_mut(), NR, false),
                                );
                            }
                            for (r, trow) in tile.iter().enumerate().take(rows) {
                                let dr = &mut acc[o + r * n..o + r * n + cols];
                                if add {
                                    for (d, &v) in dr.iter_mut().zip(trow) {
                                        *d += v;
                                    }
                                } else {
                                    dr.copy_from_slice(&trow[..cols]);
                                }
                            }
                        }
                    }
                }
            }
        });
    });
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// 32 bf16 held as 16 pairs.
    #[inline(always)]
    fn as_bh(v: __m512i) -> __m512bh {
        // SAFETY: both are 64-byte vectors of plain bits; every bit pattern is a valid bf16
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// Where a kernel leaves its 8 x 32 tile: rows `crs` apart from `c`, stored, or added to
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

    /// Stores the 8 x 32 accumulators into the tile.
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
    /// `q < units`, `i < width`, 16 (or a last 8) values at a time.
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512bf16; `width` must be a multiple of 8, `src` hold
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
                // SAFETY: the last 8 of `width` (a multiple of 8); the upper lanes are zero
                // and not stored
                unsafe {
                    let l = bf16_lanes(_mm512_zextps256_ps512(_mm256_loadu_ps(lo.add(i))));
                    let h = bf16_lanes(_mm512_zextps256_ps512(_mm256_loadu_ps(hi.add(i))));
                    let p = _mm512_or_si512(l, _mm512_slli_epi32::<16>(h));
                    _mm256_storeu_si256(o.add(i) as *mut __m256i, _mm512_castsi512_si256(p));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0) as f32
            })
            .collect()
    }

    /// `a b` in f64 over the given values.
    fn reference<T: Copy>(
        (m, n, k): (usize, usize, usize),
        a: &Mat<'_, T>,
        b: &Mat<'_, T>,
        val: impl Fn(T) -> f64,
    ) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|kk| val(a.data[i * a.rs + kk * a.cs]) * val(b.data[kk * b.rs + j * b.cs]))
                    .sum();
            }
        }
        out
    }

    const SHAPES: [(usize, usize, usize); 7] = [
        (1, 1, 1),
        (9, 1100, 40),
        (3, 5, 7),
        (8, 32, 2),
        (17, 33, 9),
        (40, 70, 129),
        (19, 45, 600),
    ];

    /// Both operands in each of their two layouts.
    fn layouts<'a, T>(
        av: &'a [T],
        bv: &'a [T],
        (m, n, k): (usize, usize, usize),
    ) -> Vec<(Mat<'a, T>, Mat<'a, T>)> {
        let mut out = Vec::new();
        for ta in [false, true] {
            for tb in [false, true] {
                let a = if ta {
                    Mat {
                        data: av,
                        rs: 1,
                        cs: m,
                    }
                } else {
                    Mat {
                        data: av,
                        rs: k,
                        cs: 1,
                    }
                };
                let b = if tb {
                    Mat {
                        data: bv,
                        rs: 1,
                        cs: k,
                    }
                } else {
                    Mat {
                        data: bv,
                        rs: n,
                        cs: 1,
                    }
                };
                out.push((a, b));
            }
        }
        out
    }

    /// The f32 kernel against f64 sums, every layout and edge size, with and without
    /// accumulation (more than one reduction block at k = 600).
    #[test]
    fn f32_kernel_matches_f64_for_every_layout() {
        if !has_avx512() {
            println!("this CPU has no AVX-512: the f32 kernel was not exercised");
            return;
        }
        for &(m, n, k) in &SHAPES {
            let (av, bv, init) = (rand(m * k, 1), rand(k * n, 2), rand(m * n, 3));
            for (a, b) in layouts(&av, &bv, (m, n, k)) {
                let want = reference((m, n, k), &a, &b, f64::from);
                for accumulate in [false, true] {
                    let mut dst = init.clone();
                    assert!(gemm_f32_exact(&mut dst, accumulate, (m, n, k), a, b));
                    for (i, (&got, &w)) in dst.iter().zip(&want).enumerate() {
                        let w = w + if accumulate { f64::from(init[i]) } else { 0.0 };
                        let tol = 1e-6 * k as f64;
                        assert!(
                            (f64::from(got) - w).abs() <= tol,
                            "{m}x{n}x{k} acc={accumulate} [{i}]: {got} vs {w}"
                        );
                    }
                }
            }
        }
    }

    /// bf16 products, of bf16 tensors and of f32 tensors, against f64 sums of the bf16 values:
    /// within the f32 accumulation (plus one bf16 rounding of a bf16 result).
    #[test]
    fn bf16_kernels_match_f64_for_every_layout() {
        for &(m, n, k) in &SHAPES {
            let (av, bv, init) = (rand(m * k, 4), rand(k * n, 5), rand(m * n, 6));
            let (ah, bh): (Vec<bf16>, Vec<bf16>) = (
                av.iter().map(|&v| bf16::from_f32(v)).collect(),
                bv.iter().map(|&v| bf16::from_f32(v)).collect(),
            );
            for ((a, b), (a32, b32)) in
                layouts(&ah, &bh, (m, n, k))
                    .into_iter()
                    .zip(layouts(&av, &bv, (m, n, k)))
            {
                let want = reference((m, n, k), &a, &b, |v: bf16| v.to_f64());
                for accumulate in [false, true] {
                    let mut d16: Vec<bf16> = init.iter().map(|&v| bf16::from_f32(v)).collect();
                    let start16 = d16.clone();
                    gemm_bf16(&mut d16, accumulate, (m, n, k), a, b);
                    let mut d32 = init.clone();
                    gemm_f32_bf16(&mut d32, accumulate, (m, n, k), a32, b32);
                    for i in 0..m * n {
                        let base16 = if accumulate { start16[i].to_f64() } else { 0.0 };
                        let base32 = if accumulate { f64::from(init[i]) } else { 0.0 };
                        let (w16, w32) = (want[i] + base16, want[i] + base32);
                        let acc_tol = 1e-6 * k as f64;
                        let got16 = d16[i].to_f64();
                        assert!(
                            (got16 - w16).abs() <= w16.abs() * 2f64.powi(-8) + acc_tol,
                            "bf16 {m}x{n}x{k} acc={accumulate} [{i}]: {got16} vs {w16}"
                        );
                        let got32 = f64::from(d32[i]);
                        assert!(
                            (got32 - w32).abs() <= acc_tol,
                            "f32-bf16 {m}x{n}x{k} acc={accumulate} [{i}]: {got32} vs {w32}"
                        );
                    }
                }
            }
        }
        if !has_bf16_dot() {
            println!("this CPU has no avx512_bf16: the dot-product kernel was not exercised");
        }
    }

    /// The dot-product kernel and the widened fallback agree to the accumulation order, and
    /// the kernel gives the same bits on every run.
    #[test]
    fn bf16_kernel_and_fallback_agree() {
        let (m, n, k) = (37, 70, 300);
        let (av, bv) = (rand(m * k, 7), rand(k * n, 8));
        let a = Mat {
            data: &av,
            rs: k,
            cs: 1,
        };
        let b = Mat {
            data: &bv,
            rs: n,
            cs: 1,
        };
        let mut fast = vec![0f32; m * n];
        gemm_f32_bf16(&mut fast, false, (m, n, k), a, b);
        let mut again = vec![0f32; m * n];
        gemm_f32_bf16(&mut again, false, (m, n, k), a, b);
        assert_eq!(fast, again);
        let mut slow = vec![0f32; m * n];
        widened(&mut slow, false, (m, n, k), a, b);
        let worst = fast
            .iter()
            .zip(&slow)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-4, "worst {worst}");
    }
}
