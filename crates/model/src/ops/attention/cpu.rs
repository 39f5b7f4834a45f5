//! The CPU kernels of the fused causal attention: one head per task (heads in parallel on
//! candle's pool), queries in blocks of [`BQ`] rows. Keys and values are widened to the
//! arithmetic type and transposed to `[dh, t]` once per head, so that every inner loop runs
//! along the keys over contiguous memory: scores are `dh` scaled additions of key columns, and
//! each output element is one long dot product. Only a `BQ x t` block of scores exists at a
//! time.
//!
//! On x86-64 with AVX2 and FMA the same code is compiled again with those features (`*_avx2`,
//! and `*_avx512` with AVX-512F too), where [`Float::mul_add`] is one instruction; elsewhere it
//! uses a separate multiply and add. The FMA copies compute the same numbers (each reduction's
//! lanes are explicit); they differ from the portable one in rounding only.

use crate::kernel::{output_vec, par_each, Elem, Float};

/// Query rows per block.
const BQ: usize = 16;

/// Where the rows of each head's `q`, `k`, `v` (and `o`, `dO`) lie.
#[derive(Clone, Copy)]
pub(super) enum Rows {
    /// `[heads, t, dh]` each, one head after another.
    HeadMajor,
    /// As the fused QKV projection writes them: one buffer `[b, t, 3, heads, dh]` holding q,
    /// k and v, and `o`, `dO` as `[b, t, heads, dh]`. The kernels read the rows where they
    /// are, with no permuted copy.
    Packed { heads: usize },
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

/// One head's `q`, `k`, `v`: row `j` of each at `j * rs`.
struct Head<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    t: usize,
    dh: usize,
    rs: usize,
}

impl<'a, T> Qkv<'a, T> {
    /// The number of heads over the whole batch.
    fn heads(&self) -> usize {
        match self.rows {
            Rows::HeadMajor => self.q.len() / (self.t * self.dh),
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
                    rs: dh,
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
                    rs: 3 * width,
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
            Rows::Packed { heads } => ((h / heads) * t * heads * dh + (h % heads) * dh, heads * dh),
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
        if fma && kiln_parallel::fastmath::has_avx512() {
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
    /// The block's (scaled) queries and output gradients, `[BQ, dh]`; one output row.
    q: Vec<F>,
    g: Vec<F>,
    orow: Vec<F>,
    /// Scores then probabilities, and `dP` then `dS`: `[BQ, t]`.
    s: Vec<F>,
    dp: Vec<F>,
    /// Key and value gradients, `[dh, t]`.
    dkt: Vec<F>,
    dvt: Vec<F>,
}

impl<F> Default for Scratch<F> {
    fn default() -> Self {
        Self {
            kt: Vec::new(),
            vt: Vec::new(),
            q: Vec::new(),
            g: Vec::new(),
            orow: Vec::new(),
            s: Vec::new(),
            dp: Vec::new(),
            dkt: Vec::new(),
            dvt: Vec::new(),
        }
    }
}

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
        _ => fwd_head_impl::<T, false>(x, scale, o, lse, w),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn fwd_head_avx512<T: Elem>(
    x: &Head<'_, T>,
    scale: T::F,
    o: &mut [T],
    lse: &mut [f64],
    w: &mut Scratch<T::F>,
) {
    fwd_head_impl::<T, true>(x, scale, o, lse, w);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fwd_head_avx2<T: Elem>(
    x: &Head<'_, T>,
    scale: T::F,
    o: &mut [T],
    lse: &mut [f64],
    w: &mut Scratch<T::F>,
) {
    fwd_head_impl::<T, true>(x, scale, o, lse, w);
}

/// One head: per block of query rows `i`, the scores `s_ij = scale q_i.k_j` for the keys up to
/// the block's last row, `p_ij = exp(s_ij - max_i)` on `j <= i`, `o_i = sum_j p_ij v_j / sum_j
/// p_ij`, `L_i = max_i + ln(sum_j p_ij)`.
#[inline(always)]
fn fwd_head_impl<T: Elem, const FMA: bool>(
    x: &Head<'_, T>,
    scale: T::F,
    o: &mut [T],
    lse: &mut [f64],
    w: &mut Scratch<T::F>,
) {
    let (t, dh) = (x.t, x.dh);
    let (zero, one) = (<T::F as Float>::ZERO, <T::F as Float>::ONE);
    transpose(x.k, t, dh, x.rs, &mut w.kt);
    transpose(x.v, t, dh, x.rs, &mut w.vt);
    w.s.resize(BQ * t, zero);
    for (b, ob) in o.chunks_mut(BQ * dh).enumerate() {
        let i0 = b * BQ;
        let rows = ob.len() / dh;
        let nk = i0 + rows;
        widen(x.q, i0..nk, x.rs, dh, scale, &mut w.q);
        scores::<_, FMA>(&w.q, &w.kt, dh, t, nk, &mut w.s);
        for (r, (orow, li)) in ob
            .chunks_exact_mut(dh)
            .zip(lse[i0..nk].iter_mut())
            .enumerate()
        {
            let n = i0 + r + 1;
            let p = &mut w.s[r * t..r * t + n];
            let max = p
                .iter()
                .fold(<T::F as Float>::NEG_INFINITY, |m, &v| m.max(v));
            for pj in p.iter_mut() {
                *pj = (*pj - max).fast_exp();
            }
            let sum = sum(p);
            let inv = one / sum;
            for (y, vt) in orow.iter_mut().zip(w.vt.chunks_exact(t)) {
                *y = T::store(dot::<_, FMA>(p, &vt[..n]) * inv);
            }
            *li = (max + sum.ln()).to_f64();
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
        _ => bwd_head_impl::<T, false>(x, g, scale, out, w),
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
    bwd_head_impl::<T, true>(x, g, scale, out, w);
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
    bwd_head_impl::<T, true>(x, g, scale, out, w);
}

/// One head, per block of query rows `i`: `p_ij = exp(scale q_i.k_j - L_i)` and
/// `ds_ij = p_ij (dO_i.v_j - D_i)` with `D_i = dO_i.o_i` for `j <= i` (zero beyond), then
/// `dq_i = scale sum_j ds_ij k_j`, `dk_j += scale sum_i ds_ij q_i`, `dv_j += sum_i p_ij dO_i`.
#[inline(always)]
fn bwd_head_impl<T: Elem, const FMA: bool>(
    x: &Head<'_, T>,
    g: &HeadG<'_, T>,
    scale: T::F,
    out: HeadGrads<'_, T>,
    w: &mut Scratch<T::F>,
) {
    let (t, dh) = (x.t, x.dh);
    let (zero, one) = (<T::F as Float>::ZERO, <T::F as Float>::ONE);
    transpose(x.k, t, dh, x.rs, &mut w.kt);
    transpose(x.v, t, dh, x.rs, &mut w.vt);
    for buf in [&mut w.dkt, &mut w.dvt] {
        buf.clear();
        buf.resize(dh * t, zero);
    }
    w.s.resize(BQ * t, zero);
    w.dp.resize(BQ * t, zero);
    let HeadGrads { dq, dk, dv } = out;
    for (b, dqb) in dq.chunks_mut(BQ * dh).enumerate() {
        let i0 = b * BQ;
        let rows = dqb.len() / dh;
        let nk = i0 + rows;
        // q carries the scale, as in the forward, so the scores are computed identically
        widen(x.q, i0..nk, x.rs, dh, scale, &mut w.q);
        widen(g.d_o, i0..nk, g.rs, dh, one, &mut w.g);
        scores::<_, FMA>(&w.q, &w.kt, dh, t, nk, &mut w.s);
        scores::<_, FMA>(&w.g, &w.vt, dh, t, nk, &mut w.dp);
        for (r, dqrow) in dqb.chunks_exact_mut(dh).enumerate() {
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
            for (y, kt) in dqrow.iter_mut().zip(w.kt.chunks_exact(t)) {
                *y = T::store(dot::<_, FMA>(dsv, &kt[..i + 1]) * scale);
            }
        }
        // dk^T[d] += sum_r (scale q_r)[d] ds_r, dv^T[d] += sum_r dO_r[d] p_r over keys < nk
        for (d, (dkt, dvt)) in w
            .dkt
            .chunks_exact_mut(t)
            .zip(w.dvt.chunks_exact_mut(t))
            .enumerate()
        {
            rows_into::<_, FMA>(&mut dkt[..nk], &w.q, &w.dp, d, dh, t, rows);
            rows_into::<_, FMA>(&mut dvt[..nk], &w.g, &w.s, d, dh, t, rows);
        }
    }
    for (dst, src) in [(dk, &w.dkt), (dv, &w.dvt)] {
        for (j, row) in dst.chunks_exact_mut(dh).enumerate() {
            for (d, y) in row.iter_mut().enumerate() {
                *y = T::store(src[d * t + j]);
            }
        }
    }
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

/// `dst = scale * src` for the rows `rows` of `src` (`rs` apart) in the arithmetic type,
/// `[rows, dh]` contiguous.
#[inline(always)]
fn widen<T: Elem>(
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

/// `t` rows of `dh` (`rs` apart) to `[dh, t]`, widened.
#[inline(always)]
fn transpose<T: Elem>(src: &[T], t: usize, dh: usize, rs: usize, dst: &mut Vec<T::F>) {
    dst.clear();
    dst.resize(t * dh, <T::F as Float>::ZERO);
    for j in 0..t {
        for (d, &x) in row(src, j, rs, dh).iter().enumerate() {
            dst[d * t + j] = x.load();
        }
    }
}

/// Sum in eight independent lanes.
#[inline(always)]
fn sum<F: Float>(x: &[F]) -> F {
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
fn dot<F: Float, const FMA: bool>(a: &[F], b: &[F]) -> F {
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

/// `y += a0 x0 + a1 x1 + a2 x2 + a3 x3`, element-wise over `y`.
#[inline(always)]
fn axpy4<F: Float, const FMA: bool>(y: &mut [F], a: [F; 4], x: [&[F]; 4]) {
    let n = y.len();
    let (x0, x1, x2, x3) = (&x[0][..n], &x[1][..n], &x[2][..n], &x[3][..n]);
    for j in 0..n {
        let mut v = madd::<F, FMA>(a[0], x0[j], y[j]);
        v = madd::<F, FMA>(a[1], x1[j], v);
        v = madd::<F, FMA>(a[2], x2[j], v);
        y[j] = madd::<F, FMA>(a[3], x3[j], v);
    }
}

/// `s[r][..nk] = sum_d a[r][d] bt[d][..nk]` for the rows `r` of `a` (`[rows, dh]`), with `bt`
/// `[dh, t]` and rows of `s` `t` apart.
#[inline(always)]
fn scores<F: Float, const FMA: bool>(
    a: &[F],
    bt: &[F],
    dh: usize,
    t: usize,
    nk: usize,
    s: &mut [F],
) {
    for (ar, sr) in a.chunks_exact(dh).zip(s.chunks_exact_mut(t)) {
        let sr = &mut sr[..nk];
        sr.fill(F::ZERO);
        let quads = ar.chunks_exact(4);
        let rest = quads.remainder();
        for (c, q) in quads.enumerate() {
            let d = 4 * c;
            axpy4::<F, FMA>(
                sr,
                [q[0], q[1], q[2], q[3]],
                [
                    &bt[d * t..],
                    &bt[(d + 1) * t..],
                    &bt[(d + 2) * t..],
                    &bt[(d + 3) * t..],
                ],
            );
        }
        let d0 = dh - rest.len();
        for (e, &av) in rest.iter().enumerate() {
            let bd = &bt[(d0 + e) * t..(d0 + e) * t + nk];
            for (y, &b) in sr.iter_mut().zip(bd) {
                *y = madd::<F, FMA>(av, b, *y);
            }
        }
    }
}

/// `y += sum_r a[r][d] m[r][..len(y)]` over the `rows` rows of `a` (`[rows, dh]`) and of `m`
/// (rows `t` apart).
#[inline(always)]
fn rows_into<F: Float, const FMA: bool>(
    y: &mut [F],
    a: &[F],
    m: &[F],
    d: usize,
    dh: usize,
    t: usize,
    rows: usize,
) {
    let mut r = 0;
    while r + 4 <= rows {
        axpy4::<F, FMA>(
            y,
            [
                a[r * dh + d],
                a[(r + 1) * dh + d],
                a[(r + 2) * dh + d],
                a[(r + 3) * dh + d],
            ],
            [
                &m[r * t..],
                &m[(r + 1) * t..],
                &m[(r + 2) * t..],
                &m[(r + 3) * t..],
            ],
        );
        r += 4;
    }
    while r < rows {
        let av = a[r * dh + d];
        for (v, &x) in y.iter_mut().zip(&m[r * t..]) {
            *v = madd::<F, FMA>(av, x, *v);
        }
        r += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The portable path (separate multiply and add) and the dispatched one (AVX2 + FMA where
    /// the CPU has them) agree to rounding: on an FMA machine the tests of `tests/attention.rs`
    /// run only the latter.
    #[test]
    fn portable_path_matches_the_dispatched_one() {
        let (t, dh) = (37, 24);
        let n = 2 * t * dh;
        let val = |i: usize, s: usize| (((i * 7919 + s * 104_729) % 1000) as f32 / 500.0) - 1.0;
        let (q, k, v, d_o): (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) = (
            (0..n).map(|i| val(i, 1)).collect(),
            (0..n).map(|i| val(i, 2)).collect(),
            (0..n).map(|i| val(i, 3)).collect(),
            (0..n).map(|i| val(i, 4)).collect(),
        );
        let x = Qkv {
            q: &q,
            k: &k,
            v: &v,
            t,
            dh,
            rows: Rows::HeadMajor,
        };
        let scale = 0.3f32;
        let (o, lse) = forward(&x, f64::from(scale)).unwrap();
        let all = Grads {
            d_o: &d_o,
            o: &o,
            lse: &lse,
        };
        let grads = backward(&x, &all, f64::from(scale)).unwrap();
        let close = |a: &[f32], b: &[f32]| {
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-5 + 1e-5 * y.abs(), "{x} vs {y}");
            }
        };
        let mut w = Scratch::default();
        let head = t * dh;
        for h in 0..2 {
            let xh = x.head(h);
            let mut oh = vec![0f32; head];
            let mut lh = vec![0f64; t];
            fwd_head(&xh, scale, &mut oh, &mut lh, &mut w, Simd::Portable);
            close(&oh, &o[h * head..(h + 1) * head]);
            for (a, b) in lh.iter().zip(&lse[h * t..(h + 1) * t]) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
            let (mut dq, mut dk, mut dv) = (vec![0f32; head], vec![0f32; head], vec![0f32; head]);
            let gh = all.head(h, t, dh, Rows::HeadMajor);
            let out = HeadGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
            };
            bwd_head(&xh, &gh, scale, out, &mut w, Simd::Portable);
            for (c, mine) in [dq, dk, dv].iter().enumerate() {
                let at = c * n + h * head;
                close(mine, &grads[at..at + head]);
            }
        }
    }
    /// The AVX2 and AVX-512 copies compute the same numbers, bitwise (every reduction's lanes
    /// are explicit and every fused multiply-add is asked for), so a run does not depend on
    /// which copy the CPU picks.
    #[test]
    fn avx2_and_avx512_copies_agree_bitwise() {
        if simd() != Simd::Avx512 {
            println!("skipped: this CPU has no AVX-512F, AVX2 and FMA");
            return;
        }
        let (t, dh) = (45, 32);
        let n = t * dh;
        let val = |i: usize, s: usize| (((i * 7919 + s * 104_729) % 1000) as f32 / 500.0) - 1.0;
        let [q, k, v, d_o]: [Vec<f32>; 4] =
            [1, 2, 3, 4].map(|s| (0..n).map(|i| val(i, s)).collect());
        let xh = Head {
            q: &q,
            k: &k,
            v: &v,
            t,
            dh,
            rs: dh,
        };
        let run = |simd: Simd| {
            let mut w = Scratch::default();
            let (mut o, mut lse) = (vec![0f32; n], vec![0f64; t]);
            fwd_head(&xh, 0.2f32, &mut o, &mut lse, &mut w, simd);
            let (mut dq, mut dk, mut dv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            let g = HeadG {
                d_o: &d_o,
                o: &o,
                lse: &lse,
                rs: dh,
            };
            let out = HeadGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
            };
            bwd_head(&xh, &g, 0.2f32, out, &mut w, simd);
            (o, lse, dq, dk, dv)
        };
        let (a, b) = (run(Simd::Avx2), run(Simd::Avx512));
        assert_eq!(a.1, b.1, "logsumexp");
        for (what, x, y) in [
            ("o", &a.0, &b.0),
            ("dq", &a.2, &b.2),
            ("dk", &a.3, &b.3),
            ("dv", &a.4, &b.4),
        ] {
            let same = x
                .iter()
                .zip(y.iter())
                .all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "{what} differs between the AVX2 and AVX-512 copies");
        }
    }
}
