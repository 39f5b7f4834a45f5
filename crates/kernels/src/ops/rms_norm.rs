//! Root-mean-square normalisation over the last dimension, with a gain (Llama's RMSNorm), and
//! its backward.

use crate::custom_op::{contiguous, output_vec, par_rows, same_type, Elem, Float};
use crate::error::mismatch;
use crate::ops::layer_norm::{total, widen, LANES};
use crate::with_float_storage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

/// `(x, weight) -> x / sqrt(mean(x^2) + eps) * weight` over the last dimension `d` of `x`, with
/// `weight` `[d]`, both contiguous and of one float dtype (half types compute in f32; the
/// mean of squares is summed over 16 lanes in a fixed order, so every machine gives the same
/// bits). Llama's `LlamaRMSNorm`: no mean subtracted, no bias. Its backward gives `x` and
/// `weight` their gradients from one fused kernel (the gain's as column sums reduced in a
/// fixed order).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::ops::RmsNorm;
/// let x = Tensor::new(&[[3f32, 4.]], &Device::Cpu)?;
/// let w = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// // rms = sqrt((9 + 16) / 2)
/// let y = x.apply_op2(&w, RmsNorm::new(0.0))?.to_vec2::<f32>()?;
/// let rms = 12.5f32.sqrt();
/// assert!((y[0][0] - 3.0 / rms).abs() < 1e-6 && (y[0][1] - 8.0 / rms).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RmsNorm {
    /// Added to the mean of squares before the square root.
    pub eps: f64,
    /// Whether the output is rows `[n, d]` rather than the shape of `x`.
    pub rows: bool,
}

impl RmsNorm {
    /// The op with this epsilon (Llama: 1e-5 or 1e-6, `rms_norm_eps` in its config), its
    /// output shaped as `x`.
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
        super::layer_norm::out_shape(self.rows, x)
    }
}

/// A row's reciprocal root mean square `1 / sqrt(mean(x^2) + eps)`, summed over [`LANES`]
/// lanes.
#[inline(always)]
fn row_rstd<T: Elem>(row: &[T], eps: T::F) -> T::F {
    let zero = <T::F as Float>::ZERO;
    let n = <T::F as Float>::from_f64(row.len() as f64);
    let mut acc = [zero; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            let v = v.load();
            *a += v * v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        let v = v.load();
        *a += v * v;
    }
    <T::F as Float>::ONE / (total(acc) / n + eps).sqrt()
}

/// `y = x rstd w` over one row.
fn fwd_row<T: Elem>(y: &mut [T], x: &[T], w: &[T::F], eps: T::F) {
    crate::simd_dispatch!(fwd_row_avx512, fwd_row_impl, (y, x, w, eps))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fwd_row_avx512<T: Elem>(y: &mut [T], x: &[T], w: &[T::F], eps: T::F) {
    fwd_row_impl(y, x, w, eps)
}

#[inline(always)]
fn fwd_row_impl<T: Elem>(y: &mut [T], x: &[T], w: &[T::F], eps: T::F) {
    let rstd = row_rstd(x, eps);
    for ((o, &v), &wj) in y.iter_mut().zip(x).zip(w) {
        *o = T::store(v.load() * rstd * wj);
    }
}

fn rms_fwd<T: Elem>(x: &[T], w: &[T], eps: f64) -> candle_core::Result<Vec<T>> {
    let d = w.len();
    let w = widen(w);
    let eps = <T::F as Float>::from_f64(eps);
    let mut y = output_vec::<T>(x.len());
    par_rows(&mut y, d, 3 * d, |row0, out| {
        for (r, yr) in out.chunks_mut(d).enumerate() {
            fwd_row(yr, &x[(row0 + r) * d..(row0 + r + 1) * d], &w, eps);
        }
    })?;
    Ok(y)
}

/// Checks `x` against a gain of `d` elements (and `dy` against `x`).
fn check(op: &'static str, x: usize, d: usize, dy: Option<usize>) -> candle_core::Result<()> {
    if d == 0 || x % d != 0 || dy.is_some_and(|n| n != x) {
        return Err(mismatch(
            op,
            format!(
                "x has {x} elements{}, weight {d}: x must be [.., {d}]",
                dy.map(|n| format!(", dy {n}")).unwrap_or_default()
            ),
        ));
    }
    Ok(())
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "kiln-rms-norm"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (y, shape) = crate::cuda::llama::rms_norm_fwd((s1, l1), (s2, l2), self.eps)?;
        Ok((y, self.out_shape(&shape)))
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        with_float_storage!(s1, op, |xs| {
            let x = contiguous(xs, l1, op)?;
            let w = contiguous(same_type(x, s2, op)?, l2, op)?;
            check(op, x.len(), w.len(), None)?;
            let y = rms_fwd(x, w, self.eps)?;
            Ok((Elem::into_storage(y), self.out_shape(l1.shape())))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let d = weight.elem_count();
        let n = x.elem_count() / d.max(1);
        let grad = grad.to_dtype(x.dtype())?.contiguous()?;
        // one packed output: rows 0..n are dx, row n is d(weight)
        let packed = x.apply_op3_no_bwd(weight, &grad, &RmsNormBwd { eps: self.eps })?;
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = packed.narrow(0, n, 1)?.reshape(d)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// The backward kernel: `(x, weight, dy) -> [n + 1, d]` packing dx and dweight.
struct RmsNormBwd {
    eps: f64,
}

/// One row of the backward: `dx = rstd (g - xhat mean(g xhat))` with `g = dy w` and
/// `xhat = x rstd`, the mean summed over [`LANES`] lanes; `dw += dy xhat` column by column
/// (`xhat` is scratch of the row's length).
fn bwd_row<T: Elem>(x: &[T], dy: &[T], w: &[T::F], eps: T::F, dx: &mut [T], dw: &mut [T::F]) {
    crate::simd_dispatch!(bwd_row_avx512, bwd_row_impl, (x, dy, w, eps, dx, dw))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn bwd_row_avx512<T: Elem>(
    x: &[T],
    dy: &[T],
    w: &[T::F],
    eps: T::F,
    dx: &mut [T],
    dw: &mut [T::F],
) {
    bwd_row_impl(x, dy, w, eps, dx, dw)
}

#[inline(always)]
fn bwd_row_impl<T: Elem>(x: &[T], dy: &[T], w: &[T::F], eps: T::F, dx: &mut [T], dw: &mut [T::F]) {
    let d = x.len();
    let (dy, w, dx, dw) = (&dy[..d], &w[..d], &mut dx[..d], &mut dw[..d]);
    let rstd = row_rstd(x, eps);
    let zero = <T::F as Float>::ZERO;
    let mut sgx = [zero; LANES];
    // element j's terms, added to lane l = j % LANES
    let mut term = |j: usize, l: usize| {
        let xh = x[j].load() * rstd;
        let gy = dy[j].load();
        dw[j] += gy * xh;
        sgx[l] += gy * w[j] * xh;
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
    let mean_gx = total(sgx) / <T::F as Float>::from_f64(d as f64);
    for j in 0..d {
        let xh = x[j].load() * rstd;
        dx[j] = T::store(rstd * (dy[j].load() * w[j] - xh * mean_gx));
    }
}

fn rms_bwd<T: Elem>(x: &[T], w: &[T], dy: &[T], eps: f64) -> candle_core::Result<Vec<T>> {
    let d = w.len();
    let n = x.len() / d;
    let w = widen(w);
    let eps = <T::F as Float>::from_f64(eps);
    let mut out = output_vec::<T>((n + 1) * d);
    let (dx, dwr) = out.split_at_mut(n * d);
    let partials = par_rows(dx, d, 6 * d, |row0, chunk| {
        let mut dw = vec![<T::F as Float>::ZERO; d];
        for (r, dxr) in chunk.chunks_mut(d).enumerate() {
            let off = (row0 + r) * d;
            bwd_row(&x[off..off + d], &dy[off..off + d], &w, eps, dxr, &mut dw);
        }
        dw
    })?;
    // the per-chunk column sums reduced in chunk order: deterministic
    let mut dw = vec![<T::F as Float>::ZERO; d];
    for p in partials {
        for (a, b) in dw.iter_mut().zip(p) {
            *a += b;
        }
    }
    for (o, v) in dwr.iter_mut().zip(dw) {
        *o = T::store(v);
    }
    Ok(out)
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "kiln-rms-norm-bwd"
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
        crate::cuda::llama::rms_norm_bwd((s1, l1), (s2, l2), (s3, l3), self.eps)
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
            check(op, x.len(), w.len(), Some(dy.len()))?;
            let out = rms_bwd(x, w, dy, self.eps)?;
            Ok((
                Elem::into_storage(out),
                Shape::from((x.len() / w.len() + 1, w.len())),
            ))
        })
    }
}
