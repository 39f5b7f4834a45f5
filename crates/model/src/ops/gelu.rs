//! GELU, tanh approximation (GPT-2/3), plain and with a fused bias add: the inputs checked,
//! then kiln-kernels' ops ([`Gelu`], [`BiasGelu`]) recorded on kiln-memory's tape.

use crate::error::{ModelError, Result};
use candle_core::Tensor;
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::{BiasGelu, Gelu};

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
    let x = x.contiguous()?;
    // cheap to run again against the activation it keeps: a selective checkpoint drops it
    Ok(kiln_memory::tape::recomputable(|| {
        kiln_memory::tape::apply_op1(&x, Gelu)
    })?)
}

/// `gelu(x + bias)` with `bias` `[n]` broadcast over the last dimension of `x` `[.., n]`: the
/// bias add of the MLP's first layer fused into its activation. The backward gives `x` and
/// `bias` their gradients in one pass (the bias gradient as parallel column sums).
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[1f32, -2.0]], &Device::Cpu)?;
/// let b = Tensor::new(&[-1f32, 3.0], &Device::Cpu)?;
/// let y = kiln_model::ops::bias_gelu(&x, &b)?.to_vec2::<f32>()?;
/// assert_eq!(y[0][0], 0.0);
/// assert!((y[0][1] - 0.841192).abs() < 1e-5);
/// # Ok(()) }
/// ```
pub fn bias_gelu(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    const OP: &str = "bias_gelu";
    let n = match x.dims().last() {
        Some(&n) if n > 0 => n,
        _ => {
            return Err(ModelError::Shape {
                op: OP,
                what: "x",
                expected: "[.., n] with n > 0".into(),
                got: format!("{:?}", x.dims()),
            })
        }
    };
    if bias.dims() != [n] {
        return Err(ModelError::Shape {
            op: OP,
            what: "bias",
            expected: format!("[{n}]"),
            got: format!("{:?}", bias.dims()),
        });
    }
    if !is_float(x.dtype()) || bias.dtype() != x.dtype() {
        return Err(ModelError::Dtype {
            op: OP,
            what: if is_float(x.dtype()) { "bias" } else { "x" },
            expected: "one float dtype (f32, f64, f16 or bf16) for x and bias",
            got: if is_float(x.dtype()) {
                bias.dtype()
            } else {
                x.dtype()
            },
        });
    }
    let (x, bias) = (x.contiguous()?, bias.contiguous()?);
    // cheap to run again against the activation it keeps: a selective checkpoint drops it
    Ok(kiln_memory::tape::recomputable(|| {
        kiln_memory::tape::apply_op2(&x, &bias, BiasGelu)
    })?)
}
