//! Cross-entropy with logits: fused log-softmax and negative log-likelihood, and its backward.

use crate::custom_op::{contiguous, output_vec, par_rows, Elem, Float};
use crate::error::mismatch;
use crate::with_float_storage;
use crate::KernelError;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

/// `(logits [n, vocab], targets [n] u32) -> mean cross-entropy` over the targets that are not
/// `ignore_index`: a scalar, f64 for f64 logits and f32 otherwise (half-precision logits are
/// reduced in f32). Only the logits get a gradient, `(softmax - onehot) / count` times the
/// loss's, zero rows for ignored targets; when every target is ignored the loss and the
/// gradient are 0. A target `>= vocab` that is not ignored is a
/// [`KernelError::TokenOutOfRange`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::ops::CrossEntropy;
/// let logits = Tensor::new(&[[0f32, 0., 0., 0.], [9., 0., 0., 0.]], &Device::Cpu)?;
/// let targets = Tensor::new(&[2u32, 7], &Device::Cpu)?;
/// let loss = logits.apply_op2(&targets, CrossEntropy { ignore_index: Some(7) })?;
/// assert!((loss.to_scalar::<f32>()? - 4f32.ln()).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropy {
    /// The target that takes no part in the mean (padding).
    pub ignore_index: Option<u32>,
}

fn u32_targets<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &'static str,
) -> candle_core::Result<&'a [u32]> {
    match s {
        CpuStorage::U32(t) => contiguous(t, l, op),
        other => Err(candle_core::Error::UnsupportedDTypeForOp(
            candle_core::backend::BackendStorage::dtype(other),
            op,
        )),
    }
}

/// Checks the targets and counts the ones that take part in the mean.
fn count_targets(t: &[u32], vocab: usize, ignore: Option<u32>) -> candle_core::Result<usize> {
    let mut count = 0;
    for (index, &value) in t.iter().enumerate() {
        if Some(value) == ignore {
            continue;
        }
        if value as usize >= vocab {
            return Err(KernelError::TokenOutOfRange {
                op: "cross_entropy",
                what: "target",
                index,
                value,
                vocab,
            }
            .into());
        }
        count += 1;
    }
    Ok(count)
}

/// Log-sum-exp of one row; leaves `exp(x - max)` in `e` and returns `(lse, sum of e)`.
#[inline]
fn row_lse<T: Elem>(row: &[T], e: &mut [T::F]) -> (T::F, T::F) {
    let mut max = <T::F as Float>::NEG_INFINITY;
    for &v in row {
        max = max.max(v.load());
    }
    for (ej, &v) in e.iter_mut().zip(row) {
        *ej = (v.load() - max).fast_exp();
    }
    let mut sum = <T::F as Float>::ZERO;
    for &ej in e.iter() {
        sum += ej;
    }
    (max + sum.ln(), sum)
}

fn ce_fwd<T: Elem>(x: &[T], t: &[u32], v: usize, ignore: Option<u32>) -> candle_core::Result<f64> {
    let count = count_targets(t, v, ignore)?;
    let mut per_row = vec![0f64; t.len()];
    par_rows(&mut per_row, 1, 2 * v, |row0, out| {
        let mut e = vec![<T::F as Float>::ZERO; v];
        for (r, o) in out.iter_mut().enumerate() {
            let row = row0 + r;
            let target = t[row];
            if Some(target) == ignore {
                continue;
            }
            let xr = &x[row * v..(row + 1) * v];
            let (lse, _) = row_lse(xr, &mut e);
            *o = (lse - xr[target as usize].load()).to_f64();
        }
    })?;
    if count == 0 {
        return Ok(0.0);
    }
    // summed in row order: deterministic
    Ok(per_row.iter().sum::<f64>() / count as f64)
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "kiln-cross-entropy"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::cross_entropy_fwd((s1, l1), (s2, l2), self.ignore_index)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let t = u32_targets(s2, l2, op)?;
        let v = l1.dims().last().copied().unwrap_or(0);
        if v == 0 || l1.shape().elem_count() != t.len() * v {
            return Err(mismatch(op, "logits and targets disagree"));
        }
        let loss = with_float_storage!(s1, op, |xs| ce_fwd(
            contiguous(xs, l1, op)?,
            t,
            v,
            self.ignore_index
        ))?;
        let out = match s1 {
            CpuStorage::F64(_) => CpuStorage::F64(vec![loss]),
            _ => CpuStorage::F32(vec![loss as f32]),
        };
        Ok((out, Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let dx = logits.apply_op2_no_bwd(
            targets,
            &CrossEntropyBwd {
                ignore_index: self.ignore_index,
                grad: g,
            },
        )?;
        Ok((Some(dx), None))
    }
}

/// `(logits, targets) -> grad * (softmax - onehot) / count`, zero rows for ignored targets.
struct CrossEntropyBwd {
    ignore_index: Option<u32>,
    grad: f64,
}

fn ce_bwd<T: Elem>(
    x: &[T],
    t: &[u32],
    v: usize,
    ignore: Option<u32>,
    grad: f64,
) -> candle_core::Result<Vec<T>> {
    let count = count_targets(t, v, ignore)?;
    let mut dx = output_vec::<T>(x.len());
    if count == 0 {
        return Ok(dx);
    }
    let scale = <T::F as Float>::from_f64(grad / count as f64);
    par_rows(&mut dx, v, 3 * v, |row0, out| {
        let mut e = vec![<T::F as Float>::ZERO; v];
        for (r, dr) in out.chunks_mut(v).enumerate() {
            let row = row0 + r;
            let target = t[row];
            if Some(target) == ignore {
                continue;
            }
            let xr = &x[row * v..(row + 1) * v];
            let (_, sum) = row_lse(xr, &mut e);
            let k = scale / sum;
            for (o, &ej) in dr.iter_mut().zip(&e) {
                *o = T::store(ej * k);
            }
            let ti = target as usize;
            dr[ti] = T::store((e[ti] / sum - <T::F as Float>::ONE) * scale);
        }
    })?;
    Ok(dx)
}

impl CustomOp2 for CrossEntropyBwd {
    fn name(&self) -> &'static str {
        "kiln-cross-entropy-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::cross_entropy_bwd((s1, l1), (s2, l2), self.ignore_index, self.grad)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let t = u32_targets(s2, l2, op)?;
        let v = l1.dims().last().copied().unwrap_or(0);
        if v == 0 || l1.shape().elem_count() != t.len() * v {
            return Err(mismatch(op, "logits and targets disagree"));
        }
        with_float_storage!(s1, op, |xs| {
            let dx = ce_bwd(contiguous(xs, l1, op)?, t, v, self.ignore_index, self.grad)?;
            Ok((Elem::into_storage(dx), l1.shape().clone()))
        })
    }
}
