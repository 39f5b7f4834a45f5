//! Matrix multiply kernels of the CPU linear op, for AVX-512: f32 (FMA) and bf16 (the
//! `vdpbf16ps` dot product of bf16 pairs into f32).
//!
//! candle 0.11 has no bf16 CPU matmul (it widens both operands to f32, multiplies, narrows
//! the result), and gemm's f32 kernels reach about 110-160 GFLOP/s on 2 cores at the shapes
//! of a small GPT's linear layers, against about 200 at the largest. Both kernels here share
//! one structure: the operands are packed once into panels (rows of `A` in groups of 12,
//! columns of `B` in groups of 32; for bf16 each element a 32-bit pair `(x[2q], x[2q + 1])`
//! along the reduction), a 12 x 32 micro-kernel keeps its tile in 24 vector registers over a
//! block of the reduction, and blocks of `B` panels stay in L2 while the row panels of a work
//! item pass over them. Only a product of few rows reads `B` in place, and `A` is read in place
//! only where its rows are contiguous. bf16 operands come from bf16 tensors as they are, or
//! from f32 tensors rounded to nearest even (`vcvtneps2bf16`) as they are packed: f32 storage
//! with bf16 products, the hardware's double rate where it has one (see [`bf16_kernel`] and
//! [`crate::MatmulPrecision`]). Accumulation is f32; a bf16 result is rounded once at the
//! end.
//!
//! Work items (24 to 96 rows each) are shared out over candle's worker pool. Every output
//! element is summed by one thread in a fixed order (reduction blocks in order, each block's
//! terms in order), so results do not depend on the thread count or on the rows per item: the
//! same inputs give the same bits.
//!
//! Without AVX-512 (checked once at run time) f32 goes to gemm's kernels, and bf16 widens to
//! f32 first, as candle does.

use crate::dense::Mat;
use crate::fastmath::has_avx512;
use half::bf16;
use half::slice::HalfFloatSliceExt;
use std::mem::MaybeUninit;

/// Rows of `A` below which an f32 `B` with contiguous rows is read in place rather than packed:
/// packing costs a pass over `B`, which only a product of few rows (a token's at generation)
/// does not repay. Read in place, a panel's rows fall into few L1 sets where the stride is a
/// multiple of a large power of two (each unit's 128 bytes a row apart), so the B stream
/// evicted the A panel: packed, products of 1024 rows at n = 512 ran 15-25% faster on an
/// Emerald Rapids Xeon (at n = 2048 and 8192, a third faster on a Zen 4 EPYC).
const DIRECT_B_MAX_ROWS: usize = 64;
/// Rows of a micro-tile.
const MR: usize = 12;
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

/// How bf16 products are computed on this CPU (see [`bf16_kernel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// The `avx512_bf16` dot product of bf16 pairs (`vdpbf16ps`), operands rounded as they
    /// are packed: twice the f32 FMA rate on AMD Zen 4.
    Dot,
    /// The operands rounded to bf16 values as they are packed, multiplied by the f32 FMA
    /// kernel: the same exact products and f32 accumulation. On Intel Xeons without AMX (Sapphire and Emerald
    /// Rapids) `vdpbf16ps` issues once every two cycles against two FMAs a cycle, so the dot
    /// product runs at half the f32 kernel's rate there.
    Fma,
}

/// The kernel bf16 products use on this CPU, decided once: `KILN_BF16_MATMUL=dot` or `fma`
/// where set; otherwise the dot product where the CPU has `avx512_bf16` and is not an Intel
/// one, the f32 kernel on rounded operands elsewhere. Measured on 2 cores: an Emerald Rapids
/// Xeon ran 12 independent `vdpbf16ps` chains at 0.74 ns an instruction against 0.18 for
/// `vfmadd231ps` (86 against 175 GFLOP/s a core), where a Zen 4 EPYC's bf16 kernel ran at
/// about 1.9x its f32 one. Either kernel gives the same products to the accumulation order.
pub fn bf16_kernel() -> Bf16Kernel {
    static KERNEL: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        match std::env::var("KILN_BF16_MATMUL").as_deref() {
            Ok("fma") => return Bf16Kernel::Fma,
            Ok("dot") if has_bf16_dot() => return Bf16Kernel::Dot,
            _ => {}
        }
        if has_bf16_dot() && !is_intel() {
            Bf16Kernel::Dot
        } else {
            Bf16Kernel::Fma
        }
    })
}

/// Whether the CPU's vendor string is `GenuineIntel`.
fn is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `cpuid` leaf 0 exists on every x86_64 CPU
        #[allow(unused_unsafe)]
        let r = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
        &vendor == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether bf16 products run on the dot-product kernel ([`bf16_kernel`]).
fn bf16_dot_pays() -> bool {
    bf16_kernel() == Bf16Kernel::Dot
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

/// An output element: f32, bf16 rounded once from the f32 sums, or a not yet written f32
/// (`MaybeUninit<f32>`: a fresh buffer the product fills, never accumulated into).
pub(crate) trait Output: Copy + Send + Sync + 'static {
    /// Runs `f` on the f32 rows it should accumulate into (`dst` itself for f32, a scratch
    /// copy for bf16, rounded back afterwards); `f` gets whether the rows hold values to add
    /// to, and writes every element.
    fn through_f32(
        dst: &mut [Self],
        accumulate: bool,
        f: impl FnOnce(&mut [MaybeUninit<f32>], bool),
    );
    /// `old + v` (or `v`) in this type.
    fn store(old: Self, v: f32, accumulate: bool) -> Self;
}

/// `f32` values seen as possibly uninitialised ones: the product only writes f32 values into
/// them, so they stay initialised.
fn as_uninit(dst: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, and every write through the result
    // stores an initialised f32 (nothing de-initialises an element)
    unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

impl Output for f32 {
    fn through_f32(
        dst: &mut [Self],
        accumulate: bool,
        f: impl FnOnce(&mut [MaybeUninit<f32>], bool),
    ) {
        f(as_uninit(dst), accumulate)
    }
    fn store(old: Self, v: f32, accumulate: bool) -> Self {
        if accumulate {
            old + v
        } else {
            v
        }
    }
}

impl Output for MaybeUninit<f32> {
    /// A fresh buffer: there is nothing to add to, whatever `accumulate` says.
    fn through_f32(
        dst: &mut [Self],
        _accumulate: bool,
        f: impl FnOnce(&mut [MaybeUninit<f32>], bool),
    ) {
        f(dst, false)
    }
    fn store(_old: Self, v: f32, _accumulate: bool) -> Self {
        MaybeUninit::new(v)
    }
}

impl Output for bf16 {
    fn through_f32(
        dst: &mut [Self],
        accumulate: bool,
        f: impl FnOnce(&mut [MaybeUninit<f32>], bool),
    ) {
        let mut acc: Vec<f32> = if accumulate {
            dst.iter().map(|v| v.to_f32()).collect()
        } else {
            vec![0f32; dst.len()]
        };
        f(as_uninit(&mut acc), accumulate);
        dst.convert_from_f32_slice(&acc);
    }
    fn store(old: Self, v: f32, accumulate: bool) -> Self {
        bf16::from_f32(if accumulate { old.to_f32() + v } else { v })
    }
}

/// The type f32 operands are rounded to before an f32 product multiplies them (to nearest
/// even; f16 beyond its range to infinity): the products of rounded operands are exact in f32,
/// so the f32 kernel then computes what a bf16 or f16 unit with f32 accumulation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rounding {
    Bf16,
    F16,
}

/// How an f32 product takes its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operands {
    /// As they are, on the f32 kernel.
    Exact,
    /// Rounded to bf16 pairs as they are packed, on the bf16 dot product.
    Bf16Dot,
    /// Rounded as they are packed (both always packed), on the f32 kernel.
    Rounded(Rounding),
}

/// The packing of `a` and `b` for `operands`, where the CPU has its kernel.
#[cfg(target_arch = "x86_64")]
fn packing<'a>(operands: Operands, a: Mat<'a, f32>, b: Mat<'a, f32>) -> Option<Packing<'a>> {
    match operands {
        Operands::Exact if has_avx512() => Some(Packing::F32 { a, b, round: None }),
        Operands::Rounded(r) if has_avx512() => Some(Packing::F32 {
            a,
            b,
            round: Some(r),
        }),
        Operands::Bf16Dot if has_bf16_dot() => Some(Packing::F32AsBf16 { a, b }),
        _ => None,
    }
}

/// `dst = a b` (`+=` with `accumulate`), `dst` row-major `m x n`, on kiln's kernel for
/// `operands` where the CPU has it; returns false (nothing done) where it has not. The operands
/// were checked to cover their products.
pub(crate) fn gemm_f32(
    dst: &mut [f32],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
    operands: Operands,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if let Some(p) = packing(operands, a, b) {
        product(dst, accumulate, (m, n, k), &p);
        return true;
    }
    let _ = (dst, accumulate, m, n, k, a, b, operands);
    false
}

/// [`gemm_f32`] with the operands as they are.
pub(crate) fn gemm_f32_exact(
    dst: &mut [f32],
    accumulate: bool,
    mnk: (usize, usize, usize),
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
) -> bool {
    gemm_f32(dst, accumulate, mnk, a, b, Operands::Exact)
}

/// `dst = a b` (`+=` with `accumulate`) on the blocked kernels, a product of nothing (`k ==
/// 0`) giving zeros.
#[cfg(target_arch = "x86_64")]
fn product<O: Output>(
    dst: &mut [O],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    packing: &Packing<'_>,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k > 0 {
        blocked(dst, accumulate, (m, n, k), packing);
    } else if !accumulate {
        for d in &mut dst[..m * n] {
            *d = O::store(*d, 0.0, false);
        }
    }
}

/// `dst = a b` into a fresh buffer of `m * n` elements, which it initialises whole, on kiln's
/// kernel for `operands`; returns false (nothing written) where the CPU lacks it. No zero fill
/// comes first: a product's output is written once.
pub(crate) fn gemm_f32_fresh(
    dst: &mut [MaybeUninit<f32>],
    operands: Operands,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= m * n {
        if let Some(p) = packing(operands, a, b) {
            product(dst, false, (m, n, k), &p);
            return true;
        }
    }
    let _ = (dst, operands, m, n, k, a, b);
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
    gemm_pairs(dst, accumulate, mnk, a, b, bf16_dot_pays())
}

/// `dst = a b` (`+=` with `accumulate`) for f32 tensors with both operands rounded to bf16
/// and the products accumulated in f32 (see [`crate::MatmulPrecision::Bf16`]), on the
/// dot-product kernel where the CPU has it (the caller chose it: [`bf16_kernel`]).
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

/// A product of bf16 tensors: on the dot-product kernel with `dot` (where the CPU has it), the
/// f32 kernel on the widened values otherwise.
fn gemm_pairs<O: Output>(
    dst: &mut [O],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
    dot: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if dot && has_bf16_dot() && k > 0 {
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

/// Without the dot product (or where it does not pay, [`bf16_kernel`]): both operands' bf16
/// values widened whole, an f32 product.
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
    let ok = crate::dense::matmul_into(
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

mod pack;
use pack::{Bits, Packing};

mod items;
use crate::pool::{for_each_slot, pool_threads, run_items, slots, take};
#[cfg(test)]
use items::A_ITEM_BYTES;
use items::{item_panels, slots_at};

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
    let b_direct = packing.b_direct(m);
    let first_packed = if b_direct { n / NR } else { 0 };
    // the panels side by side in a buffer kept from earlier products (no allocation and no
    // zero fill: packing writes every element), packed in parallel
    let panel_len = units * NR;
    let b_len = (n_panels - first_packed) * panel_len;
    let mut b_buf = scratch::take_b(b_len);
    for_each_slot(
        &slots(&mut b_buf[..b_len], panel_len),
        panel_len * 2,
        |j, panel| packing.pack_b_panel(k, n, first_packed + j, panel),
    );
    let packed_b: Vec<&[u32]> = b_buf[..b_len].chunks(panel_len.max(1)).collect();
    let kc = KC.min(units);
    // column panels per block: the block's B stays in L2 while every row panel of a work
    // item passes over it
    let block = (B_BLOCK_BYTES / (kc * NR * 4)).clamp(1, n_panels);
    let a_direct = packing.a_direct(k);
    let starts = item_panels(m, units, !a_direct, pool_threads());
    let items = slots_at(&mut dst[..m * n], &starts, MR * n);
    let work = (m * n * k) / items.len().max(1);
    run_items(items.len(), work, |i| {
        let Some(out) = take(&items[i]) else {
            return;
        };
        let r_first = starts[i] * MR;
        let item_rows = out.len() / n;
        let panels = item_rows.div_ceil(MR);
        // A is packed where it cannot be read in place: a partial last panel, or bf16 pairs
        // that are not adjacent; into this thread's buffers kept from earlier items
        let per_panel = units * MR;
        let (mut a_buf, mut run) = scratch::take_a(panels * per_panel);
        let whole_item = packing.pack_a_item(k, r_first, item_rows, &mut run, &mut a_buf);
        let is_packed = |p: usize| whole_item || !a_direct || MR.min(item_rows - p * MR) < MR;
        if !whole_item {
            for p in (0..panels).filter(|&p| is_packed(p)) {
                let panel = &mut a_buf[p * per_panel..(p + 1) * per_panel];
                packing.pack_a_panel(m, k, r_first + p * MR, panel);
            }
        }
        let packed_a: Vec<Option<&[u32]>> = (0..panels)
            .map(|p| is_packed(p).then(|| &a_buf[p * per_panel..(p + 1) * per_panel]))
            .collect();
        let mut tile = [[0f32; NR]; MR];
        O::through_f32(out, accumulate, |acc, accumulate| {
            for u0 in (0..units).step_by(kc) {
                let u1 = (u0 + kc).min(units);
                let add = accumulate || u0 > 0;
                for j0 in (0..n_panels).step_by(block) {
                    for (p, pa) in packed_a.iter().enumerate() {
                        let rows = MR.min(item_rows - p * MR);
                        for j in j0..(j0 + block).min(n_panels) {
                            let pb = (j >= first_packed).then(|| packed_b[j - first_packed]);
                            let cols = NR.min(n - j * NR);
                            let o = p * MR * n + j * NR;
                            // a whole tile goes straight into the rows; an edge tile through
                            // `tile`
                            let direct = rows == MR
                                && cols == NR
                                && packing.tile(
                                    (u0, u1),
                                    r_first + p * MR,
                                    *pa,
                                    j * NR,
                                    pb,
                                    units,
                                    (&mut acc[o..], n, add),
                                );
                            if direct {
                                continue;
                            }
                            let edge = (as_uninit(tile.as_flattened_mut()), NR, false);
                            let done = packing.tile(
                                (u0, u1),
                                r_first + p * MR,
                                *pa,
                                j * NR,
                                pb,
                                units,
                                edge,
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
                                    (as_uninit(tile.as_flattened_mut()), NR, false),
                                );
                            }
                            for (r, trow) in tile.iter().enumerate().take(rows) {
                                let dr = &mut acc[o + r * n..o + r * n + cols];
                                for (d, &v) in dr.iter_mut().zip(trow) {
                                    *d = MaybeUninit::new(if add {
                                        // SAFETY: with `add` the element holds the caller's
                                        // value or this item's sum over earlier blocks
                                        (unsafe { d.assume_init() }) + v
                                    } else {
                                        v
                                    });
                                }
                            }
                        }
                    }
                }
            }
        });
        drop(packed_a);
        scratch::put_a(a_buf, run);
    });
    drop(packed_b);
    scratch::put_b(b_buf);
}

/// Packing buffers kept from one product to the next: a product's `B` panels and a work
/// item's `A` panels are written whole by the packing (partial panels zeroed first), so a
/// buffer is reused as it is, with no allocation and no zero fill. Before, every product
/// allocated zero-filled panels, a fill of every packed byte (about 1.6% of a bf16 training
/// step's CPU time, where every operand is packed).
#[cfg(target_arch = "x86_64")]
mod scratch {
    use std::cell::Cell;
    use std::sync::Mutex;

    /// `B` buffers not in use: one per product running at the same time (rank threads each
    /// multiply), each grown to the largest it has packed.
    static B_FREE: Mutex<Vec<Vec<u32>>> = Mutex::new(Vec::new());

    thread_local! {
        /// This thread's `A` panels and the run [`super::Packing::pack_a_item`] reads into.
        static A: Cell<(Vec<u32>, Vec<u32>)> = const { Cell::new((Vec::new(), Vec::new())) };
    }

    /// `v` with at least `len` elements (grown with zeros only the first time).
    fn at_least(mut v: Vec<u32>, len: usize) -> Vec<u32> {
        if v.len() < len {
            v.resize(len, 0);
        }
        v
    }

    /// A buffer of at least `len` elements for a product's `B` panels.
    pub(super) fn take_b(len: usize) -> Vec<u32> {
        let v = B_FREE
            .lock()
            .map(|mut free| free.pop())
            .unwrap_or_default()
            .unwrap_or_default();
        at_least(v, len)
    }

    /// Returns a `B` buffer for the next product.
    pub(super) fn put_b(v: Vec<u32>) {
        if let Ok(mut free) = B_FREE.lock() {
            free.push(v);
        }
    }

    /// This thread's `A` buffer (at least `len` elements) and run buffer.
    pub(super) fn take_a(len: usize) -> (Vec<u32>, Vec<u32>) {
        let (a, run) = A.take();
        (at_least(a, len), run)
    }

    /// Returns this thread's `A` buffers for its next work item.
    pub(super) fn put_a(a: Vec<u32>, run: Vec<u32>) {
        A.set((a, run));
    }
}

#[cfg(target_arch = "x86_64")]
mod kernel;

#[cfg(test)]
mod tests;
