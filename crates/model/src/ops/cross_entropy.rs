//! Cross-entropy with logits ([`CrossEntropy`]): fused log-softmax and negative
//! log-likelihood, and its backward.

use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::CrossEntropy;

/// Mean cross-entropy of `logits` `[n, vocab]` against `targets` `[n]` (u32), averaged over
/// the targets that are not `ignore_index`. Returns a scalar: f64 for f64 logits, f32
/// otherwise (half-precision logits are reduced in f32, and the loss stays f32 for loss
/// scaling). Only `logits` receives a gradient: `(softmax - onehot) / count`.
///
/// When every target is ignored the loss is 0 and the gradient is zero (a fully padded
/// micro-batch contributes nothing). A target `>= vocab` that is not `ignore_index` is an error.
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor};
/// let logits = Tensor::new(&[[0f32, 0., 0., 0.], [9., 0., 0., 0.]], &Device::Cpu)?;
/// let targets = Tensor::new(&[2u32, 7], &Device::Cpu)?;
/// let loss = kiln_model::ops::cross_entropy(&logits, &targets, Some(7))?;
/// assert!((loss.to_scalar::<f32>()? - 4f32.ln()).abs() < 1e-6);
/// # Ok(()) }
/// ```
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    let (n, v) = match logits.dims() {
        &[n, v] if v > 0 => (n, v),
        dims => {
            return Err(ModelError::Shape {
                op: OP,
                what: "logits",
                expected: "[n, vocab] with vocab > 0".into(),
                got: format!("{dims:?}"),
            })
        }
    };
    if targets.dims() != [n] {
        return Err(ModelError::Shape {
            op: OP,
            what: "targets",
            expected: format!("[{n}]"),
            got: format!("{:?}", targets.dims()),
        });
    }
    if targets.dtype() != DType::U32 {
        return Err(ModelError::Dtype {
            op: OP,
            what: "targets",
            expected: "u32",
            got: targets.dtype(),
        });
    }
    if !is_float(logits.dtype()) {
        return Err(ModelError::Dtype {
            op: OP,
            what: "logits",
            expected: FLOAT_DTYPES,
            got: logits.dtype(),
        });
    }
    // validate the targets up front, so the kernels cannot meet a bad one
    let t = targets.to_vec1::<u32>()?;
    if let Some((index, &value)) = t
        .iter()
        .enumerate()
        .find(|(_, &t)| Some(t) != ignore_index && t as usize >= v)
    {
        return Err(ModelError::TokenOutOfRange {
            op: OP,
            what: "target",
            index,
            value,
            vocab: v,
        });
    }
    Ok(kiln_memory::tape::apply_op2(
        &logits.contiguous()?,
        &targets.contiguous()?,
        CrossEntropy { ignore_index },
    )?)
}
