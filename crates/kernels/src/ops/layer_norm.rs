//! Layer normalisation over the last dimension, with gain and bias, and its backward.

use crate::custom_op::{contiguous, output_vec, par_rows, same_type, Elem, Float};
use crate::error::mismatch;
use crate::with_float_storage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

/// `(x, weight, bias) -> (x - mean) / sqrt(var + eps) * weight + bias` over the last dimension
/// `d` of `x`, with `weight` and `bias` `[d]`, all contiguous and of one float dtype (half
/// types compute in f32); the output shaped as `x`, or with `rows` as `[n, d]` (every leading
/// dimension in `n`). Its backward gives `x`, `weight` and `bias` their gradients from one
/// fused kernel (the gain and bias gradients as column sums reduced in a fixed order), where
/// `candle_nn`'s layer norm builds no backward at all.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use kiln_kernels::ops::LayerNorm;
/// let x = Var::new(&[[1f32, 2., 3.], [2., 2., 5.]], &Device::Cpu)?;
/// let w = Tensor::new(&[1f32, 1., 1.], &Device::Cpu)?;
/// let b = Var::new(&[0f32, 0., 0.], &Device::Cpu)?;
/// let y = x.apply_op3(&w, &b, LayerNorm::new(0.0))?;
/// let r0 = y.get(0)?.to_vec1::<f32>()?;
/// assert!((r0[0] + 1.2247449).abs() < 1e-5 && r0[1].abs() < 1e-6);
/// let grads = y.get(0)?.get(2)?.backward()?;
/// let db = grads.get(&b).map(|g| g.to_vec1::<f32>()).transpose()?;
/// assert_eq!(db, Some(vec![0., 0., 1.]));
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct LayerNorm {
    /// Added to the variance before the square root.
    pub eps: f64,
    /// Whether the output is rows `[n, d]` rather than the shape of `x`.
    pub rows: bool,
}

impl LayerNorm {
    /// The op with its output shaped as `x`.
    pub fn new(eps: f64) -> Self {
        Self { eps, rows: false }
    }

    /// The op with its output as rows `[n, d]`: what a product over rows takes, without a
    /// reshape after it (a graph node of its own).
    pub fn as_rows(eps: f64) -> Self {
        Self { eps, rows: true }
    }

    /// The output's shape for an input of shape `x`.
    fn out_shape(&self, x: &Shape) -> Shape {
        out_shape(self.rows, x)
    }
}

/// A row-wise norm's output shape for an input of shape `x`: rows `[n, d]` (every leading
/// dimension in `n`) when `rows`, otherwise `x`'s.
pub(crate) fn out_shape(rows: bool, x: &Shape) -> Shape {
    match (rows, x.dims().last()) {
        (true, Some(&d)) if d > 0 => Shape::from((x.elem_count() / d, d)),
        _ => x.clone(),
    }
}

/// Partial sums of a row's reductions: element `j` goes to lane `j % LANES`, and the lanes are
/// combined pairwise at the end ([`total`]), an order fixed in the source, so every machine and
/// both compiled copies give the same bits. One chain of adds had run at an add's latency an
/// element (the LayerNorm backward was 3.4% of the main job's step, its forward 2.7%).
pub(crate) const LANES: usize = 16;

/// The lanes' sum: `a[i] + a[i + 8]`, then `+ [i + 4]`, `+ [i + 2]`, `+ [i + 1]`.
#[inline(always)]
pub(crate) fn total<F: Float>(mut a: [F; LANES]) -> F {
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            let v = a[i + w];
            a[i] += v;
        }
        w /= 2;
    }
    a[0]
}

/// A row's mean and reciprocal standard deviation (`1 / sqrt(var + eps)`, the biased
/// variance, two passes), each sum over [`LANES`] lanes.
fn row_stats<T: Elem>(row: &[T], eps: T::F) -> (T::F, T::F) {
    crate::simd_dispatch!(row_stats_avx512, row_stats_impl, (row, eps))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_stats_avx512<T: Elem>(row: &[T], eps: T::F) -> (T::F, T::F) {
    row_stats_impl(row, eps)
}

#[inline(always)]
fn row_stats_impl<T: Elem>(row: &[T], eps: T::F) -> (T::F, T::F) {
    let zero = <T::F as Float>::ZERO;
    let n = <T::F as Float>::from_f64(row.len() as f64);
    let mut acc = [zero; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v.load();
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += v.load();
    }
    let mean = total(acc) / n;
    let mut acc = [zero; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            let c = v.load() - mean;
            *a += c * c;
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        let c = v.load() - mean;
        *a += c * c;
    }
    let rstd = <T::F as Float>::ONE / (total(acc) / n + eps).sqrt();
    (mean, rstd)
}

pub(crate) fn widen<T: Elem>(v: &[T]) -> Vec<T::F> {
    v.iter().map(|&x| x.load()).collect()
}

/// `y = (x - mean) rstd w + b` over one row.
fn ln_row<T: Elem>(y: &mut [T], x: &[T], w: &[T::F], b: &[T::F], mean: T::F, rstd: T::F) {
    crate::simd_dispatch!(ln_row_avx512, ln_row_impl, (y, x, w, b, mean, rstd))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn ln_row_avx512<T: Elem>(
    y: &mut [T],
    x: &[T],
    w: &[T::F],
    b: &[T::F],
    mean: T::F,
    rstd: T::F,
) {
    ln_row_impl(y, x, w, b, mean, rstd)
}

#[inline(always)]
fn ln_row_impl<T: Elem>(y: &mut [T], x: &[T], w: &[T::F], b: &[T::F], mean: T::F, rstd: T::F) {
    for (((o, &v), &wj), &bj) in y.iter_mut().zip(x).zip(w).zip(b) {
        *o = T::store((v.load() - mean) * rstd * wj + bj);
    }
}

fn ln_fwd<T: Elem>(x: &[T], w: &[T], b: &[T], eps: f64) -> candle_core::Result<Vec<T>> {
    let d = w.len();
    let (w, b) = (widen(w), widen(b));
    let eps = <T::F as Float>::from_f64(eps);
    let mut y = output_vec::<T>(x.len());
    par_rows(&mut y, d, 4 * d, |row0, out| {
        for (r, yr) in out.chunks_mut(d).enumerate() {
            let xr = &x[(row0 + r) * d..(row0 + r + 1) * d];
            let (mean, rstd) = row_stats(xr, eps);
            ln_row(yr, xr, &w, &b, mean, rstd);
        }
    })?;
    Ok(y)
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "kiln-layer-norm"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (y, shape) = crate::cuda::ops::layer_norm_fwd((s1, l1), (s2, l2), (s3, l3), self.eps)?;
        Ok((y, self.out_shape(&shape)))
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        with_float_storage!(s1, op, |xs| {
            let x = contiguous(xs, l1, op)?;
            let w = contiguous(same_type(x, s2, op)?, l2, op)?;
            let b = contiguous(same_type(x, s3, op)?, l3, op)?;
            let d = w.len();
            if d == 0 || x.len() % d != 0 || b.len() != d {
                return Err(mismatch(
                    op,
                    format!("x has {} elements, weight {d}, bias {}", x.len(), b.len()),
                ));
            }
            let y = ln_fwd(x, w, b, self.eps)?;
            Ok((Elem::into_storage(y), self.out_shape(l1.shape())))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = weight.elem_count();
        let n = x.elem_count() / d.max(1);
        let grad = grad.to_dtype(x.dtype())?.contiguous()?;
        // one packed output: rows 0..n are dx, row n is d(weight), row n + 1 is d(bias)
        let packed = x.apply_op3_no_bwd(weight, &grad, &LayerNormBwd { eps: self.eps })?;
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = packed.narrow(0, n, 1)?.reshape(d)?;
        let db = packed.narrow(0, n + 1, 1)?.reshape(d)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The backward kernel: `(x, weight, dy) -> [n + 2, d]` packing dx, dweight, dbias.
struct LayerNormBwd {
    eps: f64,
}

/// One row's inputs to the backward.
struct BwdRow<'a, T: Elem> {
    x: &'a [T],
    dy: &'a [T],
    w: &'a [T::F],
    eps: T::F,
    inv_d: T::F,
}

/// One row of the backward: its `dx`, and its terms added to the column sums `dw`, `db`
/// (`xhat` is scratch of the row's length).
fn bwd_row<T: Elem>(
    row: BwdRow<'_, T>,
    dx: &mut [T],
    sums: (&mut [T::F], &mut [T::F]),
    xhat: &mut [T::F],
) {
    crate::simd_dispatch!(bwd_row_avx512, bwd_row_impl, (row, dx, sums, xhat))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn bwd_row_avx512<T: Elem>(
    row: BwdRow<'_, T>,
    dx: &mut [T],
    sums: (&mut [T::F], &mut [T::F]),
    xhat: &mut [T::F],
) {
    bwd_row_impl(row, dx, sums, xhat)
}

/// `dx = rstd (g - mean(g) - xhat mean(g xhat))` with `g = dy w`, the two means summed over
/// [`LANES`] lanes; `dw += dy xhat`, `db += dy` column by column.
#[inline(always)]
fn bwd_row_impl<T: Elem>(
    row: BwdRow<'_, T>,
    dx: &mut [T],
    (dw, db): (&mut [T::F], &mut [T::F]),
    xhat: &mut [T::F],
) {
    let BwdRow {
        x,
        dy,
        w,
        eps,
        inv_d,
    } = row;
    let d = x.len();
    let (dy, w, dx) = (&dy[..d], &w[..d], &mut dx[..d]);
    let (dw, db, xhat) = (&mut dw[..d], &mut db[..d], &mut xhat[..d]);
    let (mean, rstd) = row_stats_impl(x, eps);
    let zero = <T::F as Float>::ZERO;
    let (mut sg, mut sgx) = ([zero; LANES], [zero; LANES]);
    // element j's terms, added to lane l = j % LANES
    let mut term = |j: usize, l: usize| {
        let xh = (x[j].load() - mean) * rstd;
        xhat[j] = xh;
        let gy = dy[j].load();
        dw[j] += gy * xh;
        db[j] += gy;
        let g = gy * w[j];
        sg[l] += g;
        sgx[l] += g * xh;
    };
    let full = d - d % LANES;
    for j0 in (0..full).step_by(LANES) {
        for l in 0..LANES {
            term(j0 + l, l);
        }
    }
    for j in full..d {
        term(j, j - full);
    }
    let (mean_g, mean_gx) = (total(sg) * inv_d, total(sgx) * inv_d);
    for j in 0..d {
        let g = dy[j].load() * w[j];
        dx[j] = T::store(rstd * (g - mean_g - xhat[j] * mean_gx));
    }
}

fn ln_bwd<T: Elem>(x: &[T], w: &[T], dy: &[T], eps: f64) -> candle_core::Result<Vec<T>> {
    let d = w.len();
    let n = x.len() / d;
    let w = widen(w);
    let eps = <T::F as Float>::from_f64(eps);
    let inv_d = <T::F as Float>::from_f64(1.0 / d as f64);
    let mut out = output_vec::<T>((n + 2) * d);
    let (dx, dwb) = out.split_at_mut(n * d);
    let partials = par_rows(dx, d, 8 * d, |row0, chunk| {
        let zero = <T::F as Float>::ZERO;
        let mut dw = vec![zero; d];
        let mut db = vec![zero; d];
        let mut xhat = vec![zero; d];
        for (r, dxr) in chunk.chunks_mut(d).enumerate() {
            let off = (row0 + r) * d;
            let row = BwdRow {
                x: &x[off..off + d],
                dy: &dy[off..off + d],
                w: &w,
                eps,
                inv_d,
            };
            bwd_row(row, dxr, (&mut dw, &mut db), &mut xhat);
        }
        (dw, db)
    })?;
    // reduce the per-chunk column sums in chunk order: deterministic
    let zero = <T::F as Float>::ZERO;
    let mut dw = vec![zero; d];
    let mut db = vec![zero; d];
    for (pw, pb) in partials {
        for j in 0..d {
            dw[j] += pw[j];
            db[j] += pb[j];
        }
    }
    for j in 0..d {
        dwb[j] = T::store(dw[j]);
        dwb[d + j] = T::store(db[j]);
    }
    Ok(out)
}

impl CustomOp3 for LayerNormBwd {
    fn name(&self) -> &'static str {
        "kiln-layer-norm-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::layer_norm_bwd((s1, l1), (s2, l2), (s3, l3), self.eps)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        with_float_storage!(s1, op, |xs| {
            let x = contiguous(xs, l1, op)?;
            let w = contiguous(same_type(x, s2, op)?, l2, op)?;
            let dy = contiguous(same_type(x, s3, op)?, l3, op)?;
            let d = w.len();
            if d == 0 || x.len() % d != 0 || dy.len() != x.len() {
                return Err(mismatch(
                    op,
                    format!("x has {} elements, dy {}, weight {d}", x.len(), dy.len()),
                ));
            }
            let out = ln_bwd(x, w, dy, self.eps)?;
            Ok((Elem::into_storage(out), Shape::from((x.len() / d + 2, d))))
        })
    }
}
