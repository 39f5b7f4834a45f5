//! GELU, tanh approximation (GPT-2/3), plain and with a fused bias add, and their backward.

use crate::custom_op::{contiguous, output_vec, par_rows, same_type, Elem, Float};
use crate::error::mismatch;
use crate::with_float_storage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Tensor};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const COEF: f64 = 0.044_715;
/// Elements per parallel work row of the element-wise kernels.
const ROW: usize = 4096;

/// GELU, tanh approximation (GPT-2/3): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`
/// element-wise, on a contiguous float tensor (f32, f64, f16, bf16; half types compute in
/// f32). Its backward is a second fused kernel, `dy * gelu'(x)`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[0f32, 1.0, -1.0], &Device::Cpu)?;
/// let y = x.apply_op1(kiln_kernels::ops::Gelu)?.to_vec1::<f32>()?;
/// assert_eq!(y[0], 0.0);
/// assert!((y[1] - 0.841192).abs() < 1e-5 && (y[2] + 0.158808).abs() < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Gelu;

#[inline(always)]
fn gelu_val<F: Float>(x: F) -> F {
    let c = F::from_f64(SQRT_2_OVER_PI);
    let a = F::from_f64(COEF);
    let half = F::from_f64(0.5);
    half * x * (F::ONE + (c * (x + a * x * x * x)).fast_tanh())
}

#[inline(always)]
fn gelu_grad<F: Float>(x: F) -> F {
    let c = F::from_f64(SQRT_2_OVER_PI);
    let a = F::from_f64(COEF);
    let half = F::from_f64(0.5);
    let x2 = x * x;
    let t = (c * (x + a * x2 * x)).fast_tanh();
    half * (F::ONE + t) + half * x * (F::ONE - t * t) * c * (F::ONE + F::from_f64(3.0) * a * x2)
}

/// `out[i] = f(x[i], y[i])`, vectorised as wide as the CPU allows (`f` is small and inlined
/// into each copy).
fn map2_rows<T: Elem, F: Fn(T, T) -> T>(out: &mut [T], x: &[T], y: &[T], f: &F) {
    crate::simd_dispatch!(map2_rows_avx512, map2_rows_impl, (out, x, y, f))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn map2_rows_avx512<T: Elem, F: Fn(T, T) -> T>(out: &mut [T], x: &[T], y: &[T], f: &F) {
    map2_rows_impl(out, x, y, f)
}

#[inline(always)]
fn map2_rows_impl<T: Elem, F: Fn(T, T) -> T>(out: &mut [T], x: &[T], y: &[T], f: &F) {
    for ((o, &a), &b) in out.iter_mut().zip(x).zip(y) {
        *o = f(a, b);
    }
}

/// `out[i] = f(x[i], y[i])` over whole rows of `ROW` elements in parallel, the tail inline.
pub(crate) fn map2<T: Elem>(
    x: &[T],
    y: &[T],
    f: impl Fn(T, T) -> T + Sync,
) -> candle_core::Result<Vec<T>> {
    let mut out = output_vec::<T>(x.len());
    let full = x.len() / ROW * ROW;
    let (head, tail) = out.split_at_mut(full);
    par_rows(head, ROW, 8 * ROW, |row0, chunk| {
        let off = row0 * ROW;
        let (xs, ys) = (&x[off..off + chunk.len()], &y[off..off + chunk.len()]);
        map2_rows(chunk, xs, ys, &f);
    })?;
    for ((o, &a), &b) in tail.iter_mut().zip(&x[full..]).zip(&y[full..]) {
        *o = f(a, b);
    }
    Ok(out)
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "kiln-gelu"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::gelu((s1, l1), None)
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        with_float_storage!(s, op, |xs| {
            let x = contiguous(xs, l, op)?;
            let y = map2(x, x, |v, _| Elem::store(gelu_val(v.load())))?;
            Ok((Elem::into_storage(y), l.shape().clone()))
        })
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.to_dtype(x.dtype())?.contiguous()?;
        Ok(Some(x.apply_op2_no_bwd(&grad, &GeluBwd)?))
    }
}

/// `(x, dy) -> dy * gelu'(x)`.
struct GeluBwd;

impl CustomOp2 for GeluBwd {
    fn name(&self) -> &'static str {
        "kiln-gelu-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::gelu((s1, l1), Some((s2, l2)))
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
            let dy = contiguous(same_type(x, s2, op)?, l2, op)?;
            if dy.len() != x.len() {
                return Err(mismatch(op, "dy and x differ in size"));
            }
            let dx = map2(x, dy, |v, g| Elem::store(g.load() * gelu_grad(v.load())))?;
            Ok((Elem::into_storage(dx), l1.shape().clone()))
        })
    }
}

/// `gelu(x + bias)` with `bias` `[n]` broadcast over the last dimension of `x` `[.., n]`
/// (contiguous, one float dtype): the bias add of an MLP's first layer fused into its
/// activation. The backward gives `x` and `bias` their gradients in one pass (the bias gradient
/// as parallel column sums, reduced in a fixed order).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[1f32, -2.0]], &Device::Cpu)?;
/// let b = Tensor::new(&[-1f32, 3.0], &Device::Cpu)?;
/// let y = x.apply_op2(&b, kiln_kernels::ops::BiasGelu)?.to_vec2::<f32>()?;
/// assert_eq!(y[0][0], 0.0);
/// assert!((y[0][1] - 0.841192).abs() < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct BiasGelu;

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "kiln-bias-gelu"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::bias_gelu_fwd((s1, l1), (s2, l2))
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
            let b = contiguous(same_type(x, s2, op)?, l2, op)?;
            let n = b.len();
            if n == 0 || x.len() % n != 0 {
                return Err(mismatch(op, "bias does not fit x"));
            }
            let y = bias_gelu_fwd(x, b)?;
            Ok((Elem::into_storage(y), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = bias.elem_count();
        let rows = x.elem_count() / n.max(1);
        let grad = grad.to_dtype(x.dtype())?.contiguous()?;
        // packed: rows 0..rows are dx, row `rows` is d(bias)
        let packed = x.apply_op3_no_bwd(bias, &grad, &BiasGeluBwd)?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let db = packed.narrow(0, rows, 1)?.reshape(n)?;
        Ok((Some(dx), Some(db)))
    }
}

/// `(x, bias, dy) -> [rows + 1, n]`: `dx = dy * gelu'(x + b)` and its column sums.
struct BiasGeluBwd;

impl CustomOp3 for BiasGeluBwd {
    fn name(&self) -> &'static str {
        "kiln-bias-gelu-bwd"
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
        crate::cuda::ops::bias_gelu_bwd((s1, l1), (s2, l2), (s3, l3))
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
            let b = contiguous(same_type(x, s2, op)?, l2, op)?;
            let dy = contiguous(same_type(x, s3, op)?, l3, op)?;
            let n = b.len();
            if n == 0 || x.len() % n != 0 || dy.len() != x.len() {
                return Err(mismatch(op, "sizes disagree"));
            }
            let rows = x.len() / n;
            let out = bias_gelu_bwd(x, b, dy)?;
            Ok((Elem::into_storage(out), Shape::from((rows + 1, n))))
        })
    }
}

/// `y = gelu(x + b)` over one row.
fn gelu_row<T: Elem>(y: &mut [T], x: &[T], b: &[T::F]) {
    crate::simd_dispatch!(gelu_row_avx512, gelu_row_impl, (y, x, b))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_row_avx512<T: Elem>(y: &mut [T], x: &[T], b: &[T::F]) {
    gelu_row_impl(y, x, b)
}

#[inline(always)]
fn gelu_row_impl<T: Elem>(y: &mut [T], x: &[T], b: &[T::F]) {
    for ((o, &v), &bj) in y.iter_mut().zip(x).zip(b) {
        *o = T::store(gelu_val(v.load() + bj));
    }
}

/// `dx = dy gelu'(x + b)` over one row, added to the column sums `db`.
fn gelu_grad_row<T: Elem>(dx: &mut [T], x: &[T], dy: &[T], b: &[T::F], db: &mut [T::F]) {
    crate::simd_dispatch!(gelu_grad_row_avx512, gelu_grad_row_impl, (dx, x, dy, b, db))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_grad_row_avx512<T: Elem>(
    dx: &mut [T],
    x: &[T],
    dy: &[T],
    b: &[T::F],
    db: &mut [T::F],
) {
    gelu_grad_row_impl(dx, x, dy, b, db)
}

#[inline(always)]
fn gelu_grad_row_impl<T: Elem>(dx: &mut [T], x: &[T], dy: &[T], b: &[T::F], db: &mut [T::F]) {
    for ((((o, &v), &g), &bj), acc) in dx.iter_mut().zip(x).zip(dy).zip(b).zip(db.iter_mut()) {
        let d = g.load() * gelu_grad(v.load() + bj);
        *acc += d;
        *o = T::store(d);
    }
}

fn bias_gelu_fwd<T: Elem>(x: &[T], b: &[T]) -> candle_core::Result<Vec<T>> {
    let n = b.len();
    let bw: Vec<T::F> = b.iter().map(|v| v.load()).collect();
    let mut y = output_vec::<T>(x.len());
    par_rows(&mut y, n, 8 * n, |row0, chunk| {
        let off = row0 * n;
        for (r, yr) in chunk.chunks_mut(n).enumerate() {
            gelu_row(yr, &x[off + r * n..off + (r + 1) * n], &bw);
        }
    })?;
    Ok(y)
}

fn bias_gelu_bwd<T: Elem>(x: &[T], b: &[T], dy: &[T]) -> candle_core::Result<Vec<T>> {
    let n = b.len();
    let zero = <T::F as Float>::ZERO;
    let bw: Vec<T::F> = b.iter().map(|v| v.load()).collect();
    let mut out = output_vec::<T>(x.len() + n);
    let (dx, db_out) = out.split_at_mut(x.len());
    let partials = par_rows(dx, n, 12 * n, |row0, chunk| {
        let mut db = vec![zero; n];
        let off = row0 * n;
        for (r, dr) in chunk.chunks_mut(n).enumerate() {
            let lo = off + r * n;
            gelu_grad_row(dr, &x[lo..lo + n], &dy[lo..lo + n], &bw, &mut db);
        }
        db
    })?;
    // per-chunk column sums reduced in chunk order: deterministic
    let mut db = vec![zero; n];
    for p in partials {
        for (a, v) in db.iter_mut().zip(p) {
            *a += v;
        }
    }
    for (o, v) in db_out.iter_mut().zip(db) {
        *o = T::store(v);
    }
    Ok(out)
}
