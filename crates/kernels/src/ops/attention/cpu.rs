//! The CPU kernels of the fused causal attention: one head per task (heads in parallel on
//! candle's pool), queries in blocks of [`BQ`] rows. Each block is a few small matrix
//! products ([`tile::gemm`]: register tiles, the left operand packed): the scores against the keys
//! up to the block's last row, then the probabilities times the values in the forward; in the
//! backward the scores and `dO V^T`, then `dS K`, `dS^T q` and `P^T dO`. Keys and values are
//! widened to the arithmetic type once per head, transposed to `[dh, t]` where they are a
//! product's right operand along the keys. Only a `BQ x t` block of scores exists at a time.
//!
//! On x86-64 with AVX2 and FMA the same code is compiled again with those features (`*_avx2`,
//! and `*_avx512` with AVX-512F too), where [`Float::mul_add`] is one instruction and full f32
//! tiles run on intrinsics; elsewhere it uses a separate multiply and add. The FMA copies
//! compute the same numbers (each reduction's order is fixed, whatever the tile or vector
//! width); they differ from the portable one in rounding only.

use crate::custom_op::{output_vec, par_each, Elem, Float};

mod tile;
use tile::{dot, gemm, sum, transpose, widen, NO_SIMD};
#[cfg(target_arch = "x86_64")]
use tile::{AVX2, AVX512};

/// Query rows per block. The results do not depend on it (every sum runs over its terms in
/// order, across blocks too). 32 rather than 16: the backward's key-side products (`dS^T q`,
/// `P^T dO`) reduce over the block's rows, so each tile's load and store of its sums is shared
/// by twice the multiply-adds. At d512's heads (256 positions, 64 wide) the backward of one
/// layer took 13.4 ms against 13.9 (the whole op's backward, in one process).
const BQ: usize = 32;

/// Where the rows of each head's `q`, `k`, `v` (and `o`, `dO`) lie.
#[derive(Clone, Copy)]
pub(super) enum Rows {
    /// `[heads, t, dh]` each, one head after another.
    HeadMajor,
    /// As the fused QKV projection writes them: one buffer `[b, t, 3, heads, dh]` holding q,
    /// k and v, and `o`, `dO` as `[b, t, heads, dh]`. The kernels read the rows where they
    /// are, with no permuted copy.
    Packed { heads: usize },
    /// As three projections write them for grouped-query attention: `q`, `o`, `dO` as `[b, t,
    /// heads, dh]`, `k` and `v` as `[b, t, kv_heads, dh]`; query head `h` reads key/value head
    /// `h / (heads / kv_heads)`, in place (no repeated copy).
    Split { heads: usize, kv_heads: usize },
}

/// The inputs of all heads: `q`, `k`, `v` as `rows` says (in the packed layout all three are
/// the one QKV buffer).
pub(super) struct Qkv<'a, T> {
    pub(super) q: &'a [T],
    pub(super) k: &'a [T],
    pub(super) v: &'a [T],
    pub(super) t: usize,
    pub(super) dh: usize,
    pub(super) rows: Rows,
}

/// One head's `q`, `k`, `v`: row `j` of `q` at `j * rq`, of `k` and `v` at `j * rkv`.
struct Head<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    t: usize,
    dh: usize,
    rq: usize,
    rkv: usize,
}

impl<'a, T> Qkv<'a, T> {
    /// The number of heads over the whole batch.
    fn heads(&self) -> usize {
        match self.rows {
            Rows::HeadMajor | Rows::Split { .. } => self.q.len() / (self.t * self.dh),
            Rows::Packed { .. } => self.q.len() / (3 * self.t * self.dh),
        }
    }

    fn head(&self, h: usize) -> Head<'a, T> {
        let (t, dh) = (self.t, self.dh);
        match self.rows {
            Rows::HeadMajor => {
                let at = h * t * dh;
                Head {
                    q: &self.q[at..],
                    k: &self.k[at..],
                    v: &self.v[at..],
                    t,
                    dh,
                    rq: dh,
                    rkv: dh,
                }
            }
            Rows::Packed { heads } => {
                let width = heads * dh;
                let at = (h / heads) * t * 3 * width + (h % heads) * dh;
                Head {
                    q: &self.q[at..],
                    k: &self.k[at + width..],
                    v: &self.v[at + 2 * width..],
                    t,
                    dh,
                    rq: 3 * width,
                    rkv: 3 * width,
                }
            }
            Rows::Split { heads, kv_heads } => {
                let (b, h) = (h / heads, h % heads);
                let kvh = h / (heads / kv_heads);
                let (rq, rkv) = (heads * dh, kv_heads * dh);
                let at = b * t * rkv + kvh * dh;
                Head {
                    q: &self.q[b * t * rq + h * dh..],
                    k: &self.k[at..],
                    v: &self.v[at..],
                    t,
                    dh,
                    rq,
                    rkv,
                }
            }
        }
    }
}

/// The backward's further inputs: the output gradient `d_o` and output `o` (laid out as
/// `rows` says: `[heads, t, dh]` or `[b, t, heads, dh]`), and the forward's logsumexp per
/// row (`[heads, t]`).
pub(super) struct Grads<'a, T> {
    pub(super) d_o: &'a [T],
    pub(super) o: &'a [T],
    pub(super) lse: &'a [f64],
}

/// One head's `dO` and `o` (row `j` at `j * rs`) and logsumexp.
struct HeadG<'a, T> {
    d_o: &'a [T],
    o: &'a [T],
    lse: &'a [f64],
    rs: usize,
}

impl<'a, T> Grads<'a, T> {
    fn head(&self, h: usize, t: usize, dh: usize, rows: Rows) -> HeadG<'a, T> {
        let (at, rs) = match rows {
            Rows::HeadMajor => (h * t * dh, dh),
            Rows::Packed { heads } | Rows::Split { heads, .. } => {
                ((h / heads) * t * heads * dh + (h % heads) * dh, heads * dh)
            }
        };
        HeadG {
            d_o: &self.d_o[at..],
            o: &self.o[at..],
            lse: &self.lse[h * t..(h + 1) * t],
            rs,
        }
    }
}

/// Row `j` of a head's rows `rs` apart.
#[inline(always)]
fn row<T>(s: &[T], j: usize, rs: usize, dh: usize) -> &[T] {
    &s[j * rs..j * rs + dh]
}

/// Which compiled copy of the kernels runs: the portable one (separate multiply and add), or
/// one with FMA compiled for AVX2 or for AVX-512 (the same numbers, 8 or 16 lanes wide).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Simd {
    Portable,
    Avx2,
    Avx512,
}

/// The widest copy this CPU runs.
fn simd() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        let fma = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        if fma && crate::fastmath::has_avx512() {
            return Simd::Avx512;
        }
        if fma {
            return Simd::Avx2;
        }
    }
    Simd::Portable
}

/// Forward of all heads: the output, `[heads, t, dh]` one head after another whatever the
/// input layout, and each row's logsumexp of its scaled scores.
pub(super) fn forward<T: Elem>(
    x: &Qkv<'_, T>,
    scale: f64,
) -> candle_core::Result<(Vec<T>, Vec<f64>)> {
    let (t, dh) = (x.t, x.dh);
    let head = t * dh;
    let n = x.heads() * head;
    let simd = simd();
    let scale = <T::F as Float>::from_f64(scale);
    let mut o = output_vec::<T>(n);
    let mut lse = vec![0f64; n / dh];
    let items: Vec<_> = o
        .chunks_exact_mut(head)
        .zip(lse.chunks_exact_mut(t))
        .collect();
    par_each(items, t * head, Scratch::default, |w, h, (oh, lh)| {
        fwd_head(&x.head(h), scale, oh, lh, w, simd);
    })?;
    Ok((o, lse))
}

/// Backward of all heads: `[dq; dk; dv]`, each `[heads, t, dh]` one head after another
/// whatever the input layout.
pub(super) fn backward<T: Elem>(
    x: &Qkv<'_, T>,
    g: &Grads<'_, T>,
    scale: f64,
) -> candle_core::Result<Vec<T>> {
    let (t, dh) = (x.t, x.dh);
    let head = t * dh;
    let n = x.heads() * head;
    let simd = simd();
    let scale = <T::F as Float>::from_f64(scale);
    let mut out = output_vec::<T>(3 * n);
    let (dq, rest) = out.split_at_mut(n);
    let (dk, dv) = rest.split_at_mut(n);
    let items: Vec<_> = dq
        .chunks_exact_mut(head)
        .zip(dk.chunks_exact_mut(head))
        .zip(dv.chunks_exact_mut(head))
        .map(|((dq, dk), dv)| HeadGrads { dq, dk, dv })
        .collect();
    par_each(items, 3 * t * head, Scratch::default, |w, h, out| {
        let gh = g.head(h, t, dh, x.rows);
        bwd_head(&x.head(h), &gh, scale, out, w, simd);
    })?;
    Ok(out)
}

/// One head's gradients, `[t, dh]` each.
struct HeadGrads<'a, T> {
    dq: &'a mut [T],
    dk: &'a mut [T],
    dv: &'a mut [T],
}

/// Buffers reused from head to head.
struct Scratch<F> {
    /// Keys, values: `[dh, t]`.
    kt: Vec<F>,
    vt: Vec<F>,
    /// Keys, values widened: `[t, dh]`.
    kw: Vec<F>,
    vw: Vec<F>,
    /// The block's (scaled) queries and output gradients, `[BQ, dh]`; one output row.
    q: Vec<F>,
    g: Vec<F>,
    orow: Vec<F>,
    /// Scores then probabilities, and `dP` then `dS`: `[BQ, t]`.
    s: Vec<F>,
    dp: Vec<F>,
    /// The block's output (or query gradient) before its last scaling: `[BQ, dh]`; and each
    /// row's factor.
    ob: Vec<F>,
    inv: Vec<F>,
    /// Key and value gradients, `[t, dh]`.
    dkw: Vec<F>,
    dvw: Vec<F>,
    /// A packed row panel of a product's left operand.
    ap: Vec<F>,
}

impl<F> Default for Scratch<F> {
    fn default() -> Self {
        Self {
            kt: Vec::new(),
            vt: Vec::new(),
            kw: Vec::new(),
            vw: Vec::new(),
            q: Vec::new(),
            g: Vec::new(),
            orow: Vec::new(),
            s: Vec::new(),
            dp: Vec::new(),
            ob: Vec::new(),
            inv: Vec::new(),
            dkw: Vec::new(),
            dvw: Vec::new(),
            ap: Vec::new(),
        }
    }
}

/// Register tile of the portable copy (SSE2 registers: 4 x 8 f32 in 8 of its 16).
const PORTABLE_TILE: (usize, usize) = (4, 8);

fn fwd_head<T: Elem>(
    x: &Head<'_, T>,
    scale: T::F,
    o: &mut [T],
    lse: &mut [f64],
    w: &mut Scratch<T::F>,
    simd: Simd,
) {
    match simd {
        // SAFETY: `simd()` chose `Avx512` only where the CPU has AVX-512F, AVX2 and FMA, all
        // that `fwd_head_avx512` needs.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => unsafe { fwd_head_avx512(x, scale, o, lse, w) },
        // SAFETY: `simd()` chose `Avx2` only where the CPU has AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { fwd_head_avx2(x, scale, o, lse, w) },
        _ => fwd_head_impl::<T, false, NO_SIMD, { PORTABLE_TILE.0 }, { PORTABLE_TILE.1 }>(
            x, scale, o, lse, w,
        ),
    }
}

/// 8 x 32 f32 tiles: 16 of the 32 AVX-512 registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn fwd_head_avx512<T: Elem>(
    x: &Head<'_, T>,
    scale: T::F,
    o: &mut [T],
    lse: &mut [f64],
    w: &mut Scratch<T::F>,
) {
    fwd_head_impl::<T, true, AVX512, 8, 32>(x, scale, o, lse, w);
}

/// 4 x 16 f32 tiles: 8 of the 16 AVX2 registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fwd_head_avx2<T: Elem>(
    x: &Head<'_, T>,
    scale: T::F,
    o: &mut [T],
    lse: &mut [f64],
    w: &mut Scratch<T::F>,
) {
    fwd_head_impl::<T, true, AVX2, 4, 16>(x, scale, o, lse, w);
}

/// One head: per block of query rows `i`, the scores `s_ij = scale q_i.k_j` for the keys up to
/// the block's last row, `p_ij = exp(s_ij - max_i)` on `j <= i` (zero beyond),
/// `o_i = sum_j p_ij v_j / sum_j p_ij`, `L_i = max_i + ln(sum_j p_ij)`. The scores and the
/// weighted sum of values are two small products ([`gemm`]) per block.
#[inline(always)]
fn fwd_head_impl<T: Elem, const FMA: bool, const X86: u8, const MR: usize, const NR: usize>(
    x: &Head<'_, T>,
    scale: T::F,
    o: &mut [T],
    lse: &mut [f64],
    w: &mut Scratch<T::F>,
) {
    let (t, dh) = (x.t, x.dh);
    let (zero, one) = (<T::F as Float>::ZERO, <T::F as Float>::ONE);
    transpose(x.k, t, dh, x.rkv, &mut w.kt);
    widen(x.v, 0..t, x.rkv, dh, one, &mut w.vw);
    w.s.resize(BQ * t, zero);
    w.ob.resize(BQ * dh, zero);
    for (b, ob) in o.chunks_mut(BQ * dh).enumerate() {
        let i0 = b * BQ;
        let rows = ob.len() / dh;
        let nk = i0 + rows;
        widen(x.q, i0..nk, x.rq, dh, scale, &mut w.q);
        gemm::<_, FMA, X86, MR, NR>(
            &mut w.s,
            t,
            (rows, nk, dh),
            (&w.q, dh, 1),
            (&w.kt, t),
            false,
            &mut w.ap,
        );
        w.inv.clear();
        for (r, li) in lse[i0..nk].iter_mut().enumerate() {
            let n = i0 + r + 1;
            let (p, masked) = w.s[r * t..r * t + nk].split_at_mut(n);
            let max = p
                .iter()
                .fold(<T::F as Float>::NEG_INFINITY, |m, &v| m.max(v));
            for pj in p.iter_mut() {
                *pj = (*pj - max).fast_exp();
            }
            masked.fill(zero);
            let sum = sum(p);
            w.inv.push(one / sum);
            *li = (max + sum.ln()).to_f64();
        }
        gemm::<_, FMA, X86, MR, NR>(
            &mut w.ob,
            dh,
            (rows, dh, nk),
            (&w.s, t, 1),
            (&w.vw, dh),
            false,
            &mut w.ap,
        );
        for ((orow, acc), &inv) in ob
            .chunks_exact_mut(dh)
            .zip(w.ob.chunks_exact(dh))
            .zip(&w.inv)
        {
            for (y, &v) in orow.iter_mut().zip(acc) {
                *y = T::store(v * inv);
            }
        }
    }
}

fn bwd_head<T: Elem>(
    x: &Head<'_, T>,
    g: &HeadG<'_, T>,
    scale: T::F,
    out: HeadGrads<'_, T>,
    w: &mut Scratch<T::F>,
    simd: Simd,
) {
    match simd {
        // SAFETY: `simd()` chose `Avx512` only where the CPU has AVX-512F, AVX2 and FMA, all
        // that `bwd_head_avx512` needs.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => unsafe { bwd_head_avx512(x, g, scale, out, w) },
        // SAFETY: `simd()` chose `Avx2` only where the CPU has AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { bwd_head_avx2(x, g, scale, out, w) },
        _ => bwd_head_impl::<T, false, NO_SIMD, { PORTABLE_TILE.0 }, { PORTABLE_TILE.1 }>(
            x, g, scale, out, w,
        ),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn bwd_head_avx512<T: Elem>(
    x: &Head<'_, T>,
    g: &HeadG<'_, T>,
    scale: T::F,
    out: HeadGrads<'_, T>,
    w: &mut Scratch<T::F>,
) {
    bwd_head_impl::<T, true, AVX512, 8, 32>(x, g, scale, out, w);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn bwd_head_avx2<T: Elem>(
    x: &Head<'_, T>,
    g: &HeadG<'_, T>,
    scale: T::F,
    out: HeadGrads<'_, T>,
    w: &mut Scratch<T::F>,
) {
    bwd_head_impl::<T, true, AVX2, 4, 16>(x, g, scale, out, w);
}

/// One head, per block of query rows `i`: `p_ij = exp(scale q_i.k_j - L_i)` and
/// `ds_ij = p_ij (dO_i.v_j - D_i)` with `D_i = dO_i.o_i` for `j <= i` (zero beyond), then
/// `dq_i = scale sum_j ds_ij k_j`, `dk_j += scale sum_i ds_ij q_i`, `dv_j += sum_i p_ij dO_i`:
/// five small products ([`gemm`]) per block.
#[inline(always)]
fn bwd_head_impl<T: Elem, const FMA: bool, const X86: u8, const MR: usize, const NR: usize>(
    x: &Head<'_, T>,
    g: &HeadG<'_, T>,
    scale: T::F,
    out: HeadGrads<'_, T>,
    w: &mut Scratch<T::F>,
) {
    let (t, dh) = (x.t, x.dh);
    let (zero, one) = (<T::F as Float>::ZERO, <T::F as Float>::ONE);
    transpose(x.k, t, dh, x.rkv, &mut w.kt);
    transpose(x.v, t, dh, x.rkv, &mut w.vt);
    widen(x.k, 0..t, x.rkv, dh, one, &mut w.kw);
    for buf in [&mut w.dkw, &mut w.dvw] {
        buf.clear();
        buf.resize(t * dh, zero);
    }
    w.s.resize(BQ * t, zero);
    w.dp.resize(BQ * t, zero);
    w.ob.resize(BQ * dh, zero);
    let HeadGrads { dq, dk, dv } = out;
    for (b, dqb) in dq.chunks_mut(BQ * dh).enumerate() {
        let i0 = b * BQ;
        let rows = dqb.len() / dh;
        let nk = i0 + rows;
        // q carries the scale, as in the forward, so the scores are computed identically
        widen(x.q, i0..nk, x.rq, dh, scale, &mut w.q);
        widen(g.d_o, i0..nk, g.rs, dh, one, &mut w.g);
        let prod = (rows, nk, dh);
        gemm::<_, FMA, X86, MR, NR>(
            &mut w.s,
            t,
            prod,
            (&w.q, dh, 1),
            (&w.kt, t),
            false,
            &mut w.ap,
        );
        gemm::<_, FMA, X86, MR, NR>(
            &mut w.dp,
            t,
            prod,
            (&w.g, dh, 1),
            (&w.vt, t),
            false,
            &mut w.ap,
        );
        for r in 0..rows {
            let i = i0 + r;
            widen(g.o, i..i + 1, g.rs, dh, one, &mut w.orow);
            let delta = dot::<_, FMA>(&w.g[r * dh..(r + 1) * dh], &w.orow);
            let l = <T::F as Float>::from_f64(g.lse[i]);
            let (p, ds) = (&mut w.s[r * t..r * t + nk], &mut w.dp[r * t..r * t + nk]);
            let (pv, pm) = p.split_at_mut(i + 1);
            let (dsv, dsm) = ds.split_at_mut(i + 1);
            for (pj, dsj) in pv.iter_mut().zip(dsv.iter_mut()) {
                let e = (*pj - l).fast_exp();
                *pj = e;
                *dsj = e * (*dsj - delta);
            }
            // the masked keys of the block's diagonal add nothing below
            pm.fill(zero);
            dsm.fill(zero);
        }
        gemm::<_, FMA, X86, MR, NR>(
            &mut w.ob,
            dh,
            (rows, dh, nk),
            (&w.dp, t, 1),
            (&w.kw, dh),
            false,
            &mut w.ap,
        );
        for (y, &v) in dqb.iter_mut().zip(&w.ob) {
            *y = T::store(v * scale);
        }
        // dk[j] += sum_r ds[r][j] (scale q_r), dv[j] += sum_r p[r][j] dO_r over keys < nk
        let keys = (nk, dh, rows);
        gemm::<_, FMA, X86, MR, NR>(
            &mut w.dkw,
            dh,
            keys,
            (&w.dp, 1, t),
            (&w.q, dh),
            true,
            &mut w.ap,
        );
        gemm::<_, FMA, X86, MR, NR>(
            &mut w.dvw,
            dh,
            keys,
            (&w.s, 1, t),
            (&w.g, dh),
            true,
            &mut w.ap,
        );
    }
    for (dst, src) in [(dk, &w.dkw), (dv, &w.dvw)] {
        for (y, &v) in dst.iter_mut().zip(src.iter()) {
            *y = T::store(v);
        }
    }
}

#[cfg(test)]
mod tests;
