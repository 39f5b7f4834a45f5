//! How the operands of one product are packed into panels for the micro-kernels: f32 values,
//! bf16 bits, or f32 values rounded to bf16 pairs on the way.

#[cfg(target_arch = "x86_64")]
use super::kernel;
use super::{has_bf16_dot, Rounding, DIRECT_B_MAX_ROWS, MR, NR, PACK_BLOCK};
use crate::dense::Mat;
use half::bf16;
use std::mem::MaybeUninit;

/// A bf16 matrix as its bits, with strides.
#[derive(Clone, Copy)]
pub(super) struct Bits<'a> {
    pub(super) data: &'a [u16],
    pub(super) rs: usize,
    pub(super) cs: usize,
}

/// The operands of one product and how they pack.
pub(super) enum Packing<'a> {
    /// f32 values, one per reduction unit, rounded to bf16 or f16 as they are packed where
    /// `round` says (both operands are then always packed).
    F32 {
        a: Mat<'a, f32>,
        b: Mat<'a, f32>,
        round: Option<Rounding>,
    },
    /// bf16 pairs along the reduction, one pair per unit.
    Bf16 { a: Bits<'a>, b: Bits<'a> },
    /// f32 values rounded to bf16 pairs (nearest even) as they are packed.
    F32AsBf16 { a: Mat<'a, f32>, b: Mat<'a, f32> },
}

impl Packing<'_> {
    /// Reduction units of a length-`k` reduction.
    pub(super) fn units(&self, k: usize) -> usize {
        match self {
            Packing::F32 { .. } => k,
            Packing::Bf16 { .. } | Packing::F32AsBf16 { .. } => k.div_ceil(2),
        }
    }

    /// Panel `j` of `B` (`k x n`): every unit's 32 columns, zero beyond the edges. Writes
    /// every element of the panel's `units * NR` (a partial panel is zeroed first), so
    /// `panel` may hold anything.
    pub(super) fn pack_b_panel(&self, k: usize, n: usize, j: usize, panel: &mut [u32]) {
        self.pack_b_values(k, n, j, panel);
        if let Packing::F32 { round: Some(r), .. } = self {
            round_in_place(&mut panel[..k * NR], *r);
        }
    }

    /// [`Packing::pack_b_panel`] before the rounding of `F32 { round: Some(_) }`.
    fn pack_b_values(&self, k: usize, n: usize, j: usize, panel: &mut [u32]) {
        let c0 = j * NR;
        let width = NR.min(n - c0);
        if width < NR {
            panel[..self.units(k) * NR].fill(0);
        }
        match self {
            Packing::F32 { b, .. } => {
                if b.rs == 1 && b.cs != 1 && width == NR && transposed_f32_panel(b, k, c0, panel) {
                    // 8 x 8 blocks on the vector unit: done
                } else if b.rs == 1 && b.cs != 1 {
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
                } else if b.cs == 1 && width == NR {
                    // a whole unit's 32 values at a time, a length the compiler knows: two
                    // vector moves, where a run of `width` was a `memcpy` call per unit (3% of
                    // the main job's training step)
                    for (kk, dst) in panel[..k * NR].chunks_exact_mut(NR).enumerate() {
                        let src = &b.data[kk * b.rs + c0..][..NR];
                        for (d, v) in dst.iter_mut().zip(src) {
                            *d = v.to_bits();
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
                if b.cs == 1
                    && width == NR
                    && full > 0
                    && pairs_strided(&b.data[c0..], b.rs, full, NR, panel)
                {
                    // two rows of 32 columns at a time: done
                } else if b.rs == 1
                    && b.cs != 1
                    && width == NR
                    && transposed_bf16_panel(b, full, c0, panel)
                {
                    // rounded column by column, transposed in 8 x 8 blocks: done
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

    /// Rows `r0 .. r0 + MR` of `A` (`m x k`): every unit's `MR` rows (or every row's units, see
    /// [`Packing::a_rows_packed`]), zero beyond the edges. Writes every element of the
    /// panel's `units * MR` (a partial panel is zeroed first), so `out` may hold anything.
    pub(super) fn pack_a_panel(&self, m: usize, k: usize, r0: usize, out: &mut [u32]) {
        let units = self.units(k);
        let rows = MR.min(m - r0);
        if rows < MR {
            out[..units * MR].fill(0);
        }
        match self {
            Packing::F32 { a, round, .. } => {
                if self.a_rows_packed() {
                    // each row copied whole (rows `units` apart), rounded as it is copied
                    // (rows-packed only with a rounding; the rows past `rows` are zeros)
                    for (r, dst) in out.chunks_exact_mut(units).take(rows).enumerate() {
                        let row = &a.data[(r0 + r) * a.rs..][..k];
                        match round {
                            Some(r) => round_into(&mut dst[..k], row, *r),
                            None => {
                                for (d, v) in dst.iter_mut().zip(row) {
                                    *d = v.to_bits();
                                }
                            }
                        }
                    }
                    return;
                } else if a.cs == 1 {
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
                if let Some(r) = round {
                    round_in_place(&mut out[..units * MR], *r);
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
                if self.a_rows_packed() {
                    // each row's pairs are adjacent values, rounded straight into the row of
                    // the panel (rows `units` apart, see `a_rows_packed`)
                    for (r, dst) in out.chunks_exact_mut(units).take(rows).enumerate() {
                        let row = &a.data[(r0 + r) * a.rs..][..k];
                        pairs_along(&row[..2 * full], &mut dst[..full]);
                        if k % 2 == 1 {
                            dst[full] = pair_of(row[k - 1], 0.0);
                        }
                    }
                    return;
                } else if a.rs == 1
                    && rows == MR
                    && full > 0
                    && pairs_strided(&a.data[r0..], a.cs, full, MR, out)
                {
                    // the rows of a unit's two values are adjacent: done
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
    /// here it takes the item's whole run (into `run`, grown as needed). Writes the panels
    /// one after another into `out` (`rows / MR` panels of `units * MR`, every element) and
    /// returns true; false, writing nothing, where this does not apply.
    pub(super) fn pack_a_item(
        &self,
        k: usize,
        r0: usize,
        rows: usize,
        run: &mut Vec<u32>,
        out: &mut [u32],
    ) -> bool {
        if let Packing::F32 { a, round, .. } = self {
            if !transposed_f32_item(a, k, r0, rows, out) {
                return false;
            }
            if let Some(r) = round {
                round_in_place(&mut out[..rows / MR * k * MR], *r);
            }
            return true;
        }
        let Packing::F32AsBf16 { a, .. } = self else {
            return false;
        };
        let full = k / 2;
        let units = k.div_ceil(2);
        if a.rs != 1
            || a.cs == 1
            || rows == 0
            || rows % MR != 0
            || full == 0
            || out.len() < rows / MR * units * MR
        {
            return false;
        }
        if run.len() < full * rows {
            run.resize(full * rows, 0);
        }
        let run = &mut run[..full * rows];
        let Some(src) = a.data.get(r0..) else {
            return false;
        };
        if !pairs_strided(src, a.cs, full, rows, run) {
            return false;
        }
        let panels = out.chunks_exact_mut(units * MR).take(rows / MR);
        for (p, panel) in panels.enumerate() {
            for (q, unit) in run.chunks_exact(rows).enumerate() {
                panel[q * MR..(q + 1) * MR].copy_from_slice(&unit[p * MR..(p + 1) * MR]);
            }
            if k % 2 == 1 {
                for r in 0..MR {
                    let v = a.data[r0 + p * MR + r + (k - 1) * a.cs];
                    panel[full * MR + r] = pair_of(v, 0.0);
                }
            }
        }
        true
    }

    /// Whether packed panels of `A` hold their rows one after another (`[MR][units]`, rows
    /// `units` apart) rather than unit by unit (`[units][MR]`): f32 rows rounded to bf16
    /// pairs, or to bf16 or f16 values, each row rounded in one contiguous run with no scatter
    /// (the kernel takes any row and unit stride).
    pub(super) fn a_rows_packed(&self) -> bool {
        match self {
            Packing::F32AsBf16 { a, .. }
            | Packing::F32 {
                a, round: Some(_), ..
            } => a.cs == 1,
            _ => false,
        }
    }

    /// Whether a full panel of `A` can be read in place (no packing): f32 rows whose values are
    /// adjacent (a transposed `A`, `dy^T` of a weight gradient, read in place took 32 or 48
    /// bytes a unit from rows far apart: packed, those products ran 10-15% faster), bf16 when
    /// pairs are adjacent (`cs == 1`, `k` even).
    pub(super) fn a_direct(&self, k: usize) -> bool {
        match self {
            Packing::F32 { a, round, .. } => a.cs == 1 && round.is_none(),
            Packing::Bf16 { a, .. } => a.cs == 1 && k % 2 == 0,
            Packing::F32AsBf16 { .. } => false,
        }
    }

    /// Whether full-width panels of `B` can be read in place in a product of `m` rows: f32 with
    /// contiguous rows, where `A` has too few rows to repay packing (see
    /// [`DIRECT_B_MAX_ROWS`](super::DIRECT_B_MAX_ROWS)).
    pub(super) fn b_direct(&self, m: usize) -> bool {
        match self {
            Packing::F32 { b, round, .. } => b.cs == 1 && m < DIRECT_B_MAX_ROWS && round.is_none(),
            Packing::Bf16 { .. } | Packing::F32AsBf16 { .. } => false,
        }
    }

    /// The tile `A[r0 .. r0 + MR, units u0 .. u1] B[units u0 .. u1, c0 .. c0 + NR]` with `A`
    /// from `pa` (packed, `units * MR` elements) or read in place, and `B` from `pb` (a packed
    /// panel, `units * NR` elements) or read in place, stored into (or, with `add`, added to)
    /// the `MR x NR` tile of `c` whose rows are `crs` apart (initialised where `add`). Returns
    /// false, computing nothing,
    /// if an in-place read would leave its slice (which the callers' choices rule out) or the
    /// tile would leave `c`.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn tile(
        &self,
        (u0, u1): (usize, usize),
        r0: usize,
        pa: Option<&[u32]>,
        c0: usize,
        pb: Option<&[u32]>,
        units: usize,
        (c, crs, add): (&mut [MaybeUninit<f32>], usize, bool),
    ) -> bool {
        let len = u1 - u0;
        if len == 0 || crs < NR || (MR - 1) * crs + NR > c.len() {
            return false;
        }
        let dst = kernel::Dst {
            c: c.as_mut_ptr() as *mut f32,
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
            Packing::F32 { a, b, .. } => {
                let (ap, aavail, ars, aks): (*const f32, usize, usize, usize) = match pa {
                    Some(p) if self.a_rows_packed() => {
                        let s = &p[u0..units * MR];
                        (s.as_ptr() as *const f32, s.len(), units, 1)
                    }
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
                    (Some(p), _) if self.a_rows_packed() => {
                        let s = &p[u0..units * MR];
                        (s.as_ptr() as *const u16, 2 * s.len(), 2 * units, 2)
                    }
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

/// A full panel of a transposed f32 `B` (`rs == 1`: each of the panel's 32 columns is a
/// contiguous run of `k` values `cs` apart from the next) through
/// [`crate::fastmath::transpose_f32`]. Returns false, writing nothing, where that does not
/// apply (the caller then packs value by value; the scalar transpose's strided stores took 2.4%
/// of a d512 f32 step).
fn transposed_f32_panel(b: &Mat<'_, f32>, k: usize, c0: usize, panel: &mut [u32]) -> bool {
    let Some(cols) = b.data.get(c0 * b.cs..) else {
        return false;
    };
    crate::fastmath::transpose_f32(cols, (NR, k, b.cs), bits_as_f32(panel), NR)
}

/// `panel[q * NR + c] = rows[c * rs + q]` for the 32 rows `c` and `q < units`: a transpose
/// ([`crate::fastmath::transpose_f32`], 8 x 8 blocks on the vector unit) of the values as bits.
/// Returns false, writing nothing, where the rows leave `rows` or the panel is short.
fn panel_from_rows(rows: &[u32], rs: usize, units: usize, panel: &mut [u32]) -> bool {
    // SAFETY: u32 and f32 have one size and alignment and every bit pattern is valid in both;
    // the view covers the slice exactly and lives no longer than its borrow
    let src = unsafe { std::slice::from_raw_parts(rows.as_ptr() as *const f32, rows.len()) };
    crate::fastmath::transpose_f32(src, (NR, units, rs), bits_as_f32(panel), NR)
}

/// Bit patterns seen as f32 values, to be moved (a copy keeps every bit pattern).
fn bits_as_f32(bits: &mut [u32]) -> &mut [f32] {
    // SAFETY: u32 and f32 have one size and alignment and every bit pattern is valid in both;
    // the view covers the slice exactly and takes over its borrow
    unsafe { std::slice::from_raw_parts_mut(bits.as_mut_ptr() as *mut f32, bits.len()) }
}

thread_local! {
    /// A panel's 32 columns rounded to bf16 pairs, before their transpose into the panel.
    static PAIR_ROWS: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A full panel of a transposed f32 `B` rounded to bf16 pairs: each column's pairs rounded in
/// one run (its values are adjacent), then the 32 runs transposed by [`panel_from_rows`].
/// Returns false, writing nothing, where that does not apply. (Each pair went to the panel by
/// a strided scalar store.)
fn transposed_bf16_panel(b: &Mat<'_, f32>, full: usize, c0: usize, panel: &mut [u32]) -> bool {
    if full < 8 || (c0 + NR - 1) * b.cs + 2 * full > b.data.len() {
        return false;
    }
    let mut runs = PAIR_ROWS.take();
    if runs.len() < NR * full {
        runs.resize(NR * full, 0);
    }
    for (c, run) in runs.chunks_exact_mut(full).take(NR).enumerate() {
        pairs_along(&b.data[(c0 + c) * b.cs..][..2 * full], run);
    }
    let done = panel_from_rows(&runs[..NR * full], full, full, panel);
    PAIR_ROWS.set(runs);
    done
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

/// The row panels of `rows` rows from `r0` of a transposed f32 `A` (`rs == 1`: a reduction
/// index's values of all rows adjacent), all at once: for each reduction index, the item's
/// run of `rows` values read once and cut into the panels' `MR` values (`[units][MR]` per
/// panel, panels one after another in `out`). Panel by panel, each of `k` reads took 48 bytes
/// of a run and the next panel read the same cache lines again (2.6% of a d512 training
/// step's CPU time). Returns false, writing nothing, where this does not apply.
fn transposed_f32_item(
    a: &Mat<'_, f32>,
    k: usize,
    r0: usize,
    rows: usize,
    out: &mut [u32],
) -> bool {
    let panel_len = k * MR;
    if a.rs != 1
        || a.cs == 1
        || rows == 0
        || rows % MR != 0
        || k == 0
        || out.len() < rows / MR * panel_len
        || r0 + (k - 1) * a.cs + rows > a.data.len()
    {
        return false;
    }
    let out = &mut out[..rows / MR * panel_len];
    for kk in 0..k {
        let run = &a.data[r0 + kk * a.cs..][..rows];
        for (p, vals) in run.chunks_exact(MR).enumerate() {
            let dst = &mut out[p * panel_len + kk * MR..][..MR];
            for (d, v) in dst.iter_mut().zip(vals) {
                *d = v.to_bits();
            }
        }
    }
    true
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
    if has_bf16_dot() {
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

/// `src` rounded to bf16 or f16 values (widened back to f32) into `dst` as bits: bitwise a copy
/// and [`round_in_place`], in one pass (the copy of a rows-packed `A` had been 1.7% of the
/// main job's training step, the rounding after it 1.8%).
pub(super) fn round_into(dst: &mut [u32], src: &[f32], r: Rounding) {
    #[cfg(target_arch = "x86_64")]
    if r == Rounding::F16 && crate::fastmath::has_avx512() {
        // SAFETY: the CPU has avx512f (checked)
        unsafe { kernel::round_f16_into(dst, src) };
        return;
    }
    crate::simd_dispatch!(round_into_avx512, round_into_impl, (dst, src, r))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn round_into_avx512(dst: &mut [u32], src: &[f32], r: Rounding) {
    round_into_impl(dst, src, r)
}

#[inline(always)]
fn round_into_impl(dst: &mut [u32], src: &[f32], r: Rounding) {
    let pairs = dst.iter_mut().zip(src);
    match r {
        Rounding::Bf16 => pairs.for_each(|(d, &v)| *d = crate::fastmath::round_bf16(v).to_bits()),
        Rounding::F16 => pairs.for_each(|(d, &v)| *d = crate::fastmath::round_f16(v).to_bits()),
    }
}

/// f32 bits rounded in place to bf16 or f16 values (widened back to f32), one vectorised
/// pass over a packed panel that is still in cache.
pub(super) fn round_in_place(bits: &mut [u32], r: Rounding) {
    #[cfg(target_arch = "x86_64")]
    if r == Rounding::F16 && crate::fastmath::has_avx512() {
        // SAFETY: the CPU has avx512f (checked)
        unsafe { kernel::round_f16_in_place(bits) };
        return;
    }
    crate::simd_dispatch!(round_in_place_avx512, round_in_place_impl, (bits, r))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn round_in_place_avx512(bits: &mut [u32], r: Rounding) {
    round_in_place_impl(bits, r)
}

#[inline(always)]
fn round_in_place_impl(bits: &mut [u32], r: Rounding) {
    match r {
        Rounding::Bf16 => bits
            .iter_mut()
            .for_each(|b| *b = crate::fastmath::round_bf16(f32::from_bits(*b)).to_bits()),
        Rounding::F16 => bits
            .iter_mut()
            .for_each(|b| *b = crate::fastmath::round_f16(f32::from_bits(*b)).to_bits()),
    }
}
