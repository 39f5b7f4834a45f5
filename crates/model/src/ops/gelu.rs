//! GELU, tanh approximation (GPT-2/3), and its backward.

use crate::error::{ModelError, Result};
use crate::kernel::{
    contiguous, is_float, output_vec, par_rows, same_type, with_float_storage, Elem, Float,
    FLOAT_DTYPES,
};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const COEF: f64 = 0.044_715;
/// Elements per parallel work row of the element-wise kernels.
const ROW: usize = 4096;

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` element-wise, with a backward.
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor};
/// let y = kiln_model::ops::gelu(&Tensor::new(&[0f32, 1.0, -1.0], &Device::Cpu)?)?;
/// let y = y.to_vec1::<f32>()?;
/// assert_eq!(y[0], 0.0);
/// assert!((y[1] - 0.841192).abs() < 1e-5 && (y[2] + 0.158808).abs() < 1e-5);
/// # Ok(()) }
/// ```
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if !is_float(x.dtype()) {
        return Err(ModelError::Dtype {
            op: "gelu",
            what: "x",
            expected: FLOAT_DTYPES,
            got: x.dtype(),
        });
    }
    Ok(x.contiguous()?.apply_op1(Gelu)?)
}

struct Gelu;

#[inline(always)]
fn gelu_val<F: Float>(x: F) -> F {
    let c = F::from_f64(SQRT_2_OVER_PI);
    let a = F::from_f64(COEF);
    let half = F::from_f64(0.5);
    half * x * (F::ONE + (c * (x + a * x * x * x)).tanh())
}

#[inline(always)]
fn gelu_grad<F: Float>(x: F) -> F {
    let c = F::from_f64(SQRT_2_OVER_PI);
    let a = F::from_f64(COEF);
    let half = F::from_f64(0.5);
    let x2 = x * x;
    let t = (c * (x + a * x2 * x)).tanh();
    half * (F::ONE + t) + half * x * (F::ONE - t * t) * c * (F::ONE + F::from_f64(3.0) * a * x2)
}

/// Applies `f` element-wise over `x` into a new vector, in parallel row blocks.
fn map<T: Elem>(x: &[T], f: impl Fn(usize, T) -> T + Sync) -> candle_core::Result<Vec<T>> {
    let mut y = output_vec::<T>(x.len());
    let n = x.len();
    // whole rows of ROW elements, then the tail on this thread
    let full = n / ROW * ROW;
    let (head, tail) = y.split_at_mut(full);
    par_rows(head, ROW, 8 * ROW, |row0, out| {
        let off = row0 * ROW;
        for (i, o) in out.iter_mut().enumerate() {
            *o = f(off + i, x[off + i]);
        }
    })?;
    for (i, o) in tail.iter_mut().enumerate() {
        *o = f(full + i, x[full + i]);
    }
    Ok(y)
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "kiln-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        with_float_storage!(s, op, |xs| {
            let x = contiguous(xs, l, op)?;
            let y = map(x, |_, v| Elem::store(gelu_val(v.load())))?;
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
                return Err(candle_core::Error::msg(format!(
                    "{op}: dy and x differ in size"
                )));
            }
            let dx = map(x, |i, v| Elem::store(dy[i].load() * gelu_grad(v.load())))?;
            Ok((Elem::into_storage(dx), l1.shape().clone()))
        })
    }
}
