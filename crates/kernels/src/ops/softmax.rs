//! Causal-masked softmax over the last dimension, and its backward.

use crate::custom_op::{contiguous, output_vec, par_rows, same_type, Elem, Float};
use crate::error::mismatch;
use crate::with_float_storage;
use crate::KernelError;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

/// Causal softmax of `scale * x` for attention scores `x` of shape `[.., tq, tk]` (`tq <= tk`,
/// contiguous, a float dtype): row `i` is a softmax over the positions `j <= i + (tk - tq)`;
/// the masked positions are exactly zero. For square scores (`tq == tk`) this is the usual
/// lower-triangular mask. The backward is a second fused kernel.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[0f32, 5.], [0., 0.]], &Device::Cpu)?;
/// let y = x.apply_op1(kiln_kernels::ops::CausalSoftmax { scale: 1.0 })?;
/// assert_eq!(y.to_vec2::<f32>()?, vec![vec![1., 0.], vec![0.5, 0.5]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct CausalSoftmax {
    /// The factor of the scores (an attention layer's `1 / sqrt(head_dim)`).
    pub scale: f64,
}

/// `(tq, tk)` of scores `[.., tq, tk]` with `0 < tq <= tk`.
fn score_dims(l: &Layout, op: &'static str) -> candle_core::Result<(usize, usize)> {
    match *l.dims() {
        [.., tq, tk] if tq > 0 && tq <= tk => Ok((tq, tk)),
        ref d => Err(KernelError::Shape {
            op,
            what: "x",
            expected: "[.., tq, tk] with 0 < tq <= tk".into(),
            got: format!("{d:?}"),
        }
        .into()),
    }
}

/// Number of unmasked positions of flat row `r`.
#[inline(always)]
fn visible(r: usize, tq: usize, tk: usize) -> usize {
    (r % tq) + (tk - tq) + 1
}

fn softmax_fwd<T: Elem>(x: &[T], tq: usize, tk: usize, scale: f64) -> candle_core::Result<Vec<T>> {
    let s = <T::F as Float>::from_f64(scale);
    let mut y = output_vec::<T>(x.len());
    par_rows(&mut y, tk, 3 * tk, |row0, out| {
        let mut e = vec![<T::F as Float>::ZERO; tk];
        for (r, yr) in out.chunks_mut(tk).enumerate() {
            let row = row0 + r;
            let n = visible(row, tq, tk);
            let xr = &x[row * tk..row * tk + n];
            let mut max = <T::F as Float>::NEG_INFINITY;
            for &v in xr {
                max = max.max(v.load() * s);
            }
            for (ej, &v) in e[..n].iter_mut().zip(xr) {
                *ej = (v.load() * s - max).fast_exp();
            }
            let mut sum = <T::F as Float>::ZERO;
            for &ej in &e[..n] {
                sum += ej;
            }
            let inv = <T::F as Float>::ONE / sum;
            for (o, &ej) in yr[..n].iter_mut().zip(&e[..n]) {
                *o = T::store(ej * inv);
            }
            // the masked tail stays exactly zero (output_vec)
        }
    })?;
    Ok(y)
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "kiln-causal-softmax"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::causal_softmax((s1, l1), None, self.scale)
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (tq, tk) = score_dims(l, op)?;
        with_float_storage!(s, op, |xs| {
            let x = contiguous(xs, l, op)?;
            let y = softmax_fwd(x, tq, tk, self.scale)?;
            Ok((Elem::into_storage(y), l.shape().clone()))
        })
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.to_dtype(y.dtype())?.contiguous()?;
        let dx = y.apply_op2_no_bwd(&grad, &CausalSoftmaxBwd { scale: self.scale })?;
        Ok(Some(dx))
    }
}

/// The backward kernel: `(y, dy) -> dx = scale * y * (dy - sum(dy * y))` on the visible part.
struct CausalSoftmaxBwd {
    scale: f64,
}

fn softmax_bwd<T: Elem>(
    y: &[T],
    dy: &[T],
    tq: usize,
    tk: usize,
    scale: f64,
) -> candle_core::Result<Vec<T>> {
    let s = <T::F as Float>::from_f64(scale);
    let mut dx = output_vec::<T>(y.len());
    par_rows(&mut dx, tk, 3 * tk, |row0, out| {
        for (r, dxr) in out.chunks_mut(tk).enumerate() {
            let row = row0 + r;
            let n = visible(row, tq, tk);
            let yr = &y[row * tk..row * tk + n];
            let gr = &dy[row * tk..row * tk + n];
            let mut dot = <T::F as Float>::ZERO;
            for (&a, &g) in yr.iter().zip(gr) {
                dot += a.load() * g.load();
            }
            for ((o, &a), &g) in dxr[..n].iter_mut().zip(yr).zip(gr) {
                *o = T::store(s * a.load() * (g.load() - dot));
            }
        }
    })?;
    Ok(dx)
}

impl CustomOp2 for CausalSoftmaxBwd {
    fn name(&self) -> &'static str {
        "kiln-causal-softmax-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::causal_softmax((s1, l1), Some((s2, l2)), self.scale)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (tq, tk) = score_dims(l1, op)?;
        with_float_storage!(s1, op, |ys| {
            let y = contiguous(ys, l1, op)?;
            let dy = contiguous(same_type(y, s2, op)?, l2, op)?;
            if dy.len() != y.len() {
                return Err(mismatch(op, "dy and y differ in size"));
            }
            let dx = softmax_bwd(y, dy, tq, tk, self.scale)?;
            Ok((Elem::into_storage(dx), l1.shape().clone()))
        })
    }
}
