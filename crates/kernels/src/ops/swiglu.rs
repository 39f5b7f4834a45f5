//! SwiGLU, the gated MLP activation of the Llama family: `silu(gate) * up` on the fused output
//! of the gate and up projections, and its backward.

use crate::custom_op::{contiguous, output_vec, par_rows, same_type, Elem, Float};
use crate::error::mismatch;
use crate::with_float_storage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

/// `x [.., 2n] -> silu(x[.., :n]) * x[.., n:]` `[.., n]`, with `silu(g) = g / (1 + exp(-g))`:
/// the first half of each row is the gate projection's output, the second the up
/// projection's (one product computes both; under tensor parallelism each rank holds its
/// shard of both halves in this layout). A contiguous float tensor (f32, f64, f16, bf16; half
/// types compute in f32). Its backward gives the fused input's gradient in one pass:
/// `d gate = dy up silu'(gate)`, `d up = dy silu(gate)`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::ops::SwiGlu;
/// let x = Tensor::new(&[[0f32, 2.0, 5.0, 3.0]], &Device::Cpu)?; // gate [0, 2], up [5, 3]
/// let y = x.apply_op1(SwiGlu)?.to_vec2::<f32>()?;
/// let silu2 = 2.0 / (1.0 + (-2f32).exp());
/// assert_eq!(y[0][0], 0.0);
/// assert!((y[0][1] - 3.0 * silu2).abs() < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct SwiGlu;

#[inline(always)]
fn sigmoid<F: Float>(g: F) -> F {
    F::ONE / (F::ONE + (F::ZERO - g).fast_exp())
}

/// Checks a fused input of `len` elements with rows of `width` (even and non-zero).
fn check(op: &'static str, len: usize, width: usize) -> candle_core::Result<usize> {
    if width == 0 || width % 2 != 0 || len % width != 0 {
        return Err(mismatch(
            op,
            format!(
                "the fused gate and up input has rows of {width}: it must be [.., 2n] with \
                 n > 0"
            ),
        ));
    }
    Ok(width / 2)
}

/// `y = silu(gate) up` over one row.
fn fwd_row<T: Elem>(y: &mut [T], x: &[T]) {
    crate::simd_dispatch!(fwd_row_avx512, fwd_row_impl, (y, x))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fwd_row_avx512<T: Elem>(y: &mut [T], x: &[T]) {
    fwd_row_impl(y, x)
}

#[inline(always)]
fn fwd_row_impl<T: Elem>(y: &mut [T], x: &[T]) {
    let n = y.len();
    let (gate, up) = x.split_at(n);
    for ((o, &g), &u) in y.iter_mut().zip(gate).zip(up) {
        let g = g.load();
        *o = T::store(g * sigmoid(g) * u.load());
    }
}

/// `dx = [dy up silu'(gate), dy silu(gate)]` over one row.
fn bwd_row<T: Elem>(dx: &mut [T], x: &[T], dy: &[T]) {
    crate::simd_dispatch!(bwd_row_avx512, bwd_row_impl, (dx, x, dy))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn bwd_row_avx512<T: Elem>(dx: &mut [T], x: &[T], dy: &[T]) {
    bwd_row_impl(dx, x, dy)
}

#[inline(always)]
fn bwd_row_impl<T: Elem>(dx: &mut [T], x: &[T], dy: &[T]) {
    let n = dy.len();
    let (gate, up) = x.split_at(n);
    let (dgate, dup) = dx.split_at_mut(n);
    for ((((dg, du), &g), &u), &d) in dgate.iter_mut().zip(dup).zip(gate).zip(up).zip(dy) {
        let (g, u, d) = (g.load(), u.load(), d.load());
        let s = sigmoid(g);
        let silu = g * s;
        *du = T::store(d * silu);
        *dg = T::store(d * u * (s + silu * (<T::F as Float>::ONE - s)));
    }
}

fn swiglu_fwd<T: Elem>(x: &[T], n: usize) -> candle_core::Result<Vec<T>> {
    let mut y = output_vec::<T>(x.len() / 2);
    par_rows(&mut y, n, 8 * n, |row0, out| {
        for (r, yr) in out.chunks_mut(n).enumerate() {
            let off = (row0 + r) * 2 * n;
            fwd_row(yr, &x[off..off + 2 * n]);
        }
    })?;
    Ok(y)
}

fn swiglu_bwd<T: Elem>(x: &[T], dy: &[T], n: usize) -> candle_core::Result<Vec<T>> {
    let mut dx = output_vec::<T>(x.len());
    par_rows(&mut dx, 2 * n, 16 * n, |row0, out| {
        for (r, dxr) in out.chunks_mut(2 * n).enumerate() {
            let row = row0 + r;
            let xr = &x[row * 2 * n..(row + 1) * 2 * n];
            bwd_row(dxr, xr, &dy[row * n..(row + 1) * n]);
        }
    })?;
    Ok(dx)
}

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "kiln-swiglu"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::llama::swiglu((s, l), None)
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let width = l.shape().dims().last().copied().unwrap_or(0);
        with_float_storage!(s, op, |xs| {
            let x = contiguous(xs, l, op)?;
            let n = check(op, x.len(), width)?;
            let y = swiglu_fwd(x, n)?;
            let mut dims = l.shape().dims().to_vec();
            if let Some(last) = dims.last_mut() {
                *last = n;
            }
            Ok((Elem::into_storage(y), Shape::from(dims)))
        })
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.to_dtype(x.dtype())?.contiguous()?;
        Ok(Some(x.apply_op2_no_bwd(&grad, &SwiGluBwd)?))
    }
}

/// `(x [.., 2n], dy [.., n]) -> dx [.., 2n]`.
struct SwiGluBwd;

impl CustomOp2 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "kiln-swiglu-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::llama::swiglu((s1, l1), Some((s2, l2)))
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let width = l1.shape().dims().last().copied().unwrap_or(0);
        with_float_storage!(s1, op, |xs| {
            let x = contiguous(xs, l1, op)?;
            let dy = contiguous(same_type(x, s2, op)?, l2, op)?;
            let n = check(op, x.len(), width)?;
            if dy.len() * 2 != x.len() {
                return Err(mismatch(
                    op,
                    format!(
                        "dy has {} elements, x {}: dy must be half",
                        dy.len(),
                        x.len()
                    ),
                ));
            }
            let dx = swiglu_bwd(x, dy, n)?;
            Ok((Elem::into_storage(dx), l1.shape().clone()))
        })
    }
}
