//! Grouped-query attention's key and value heads repeated for their query heads
//! ([`RepeatKv`]), with the backward that sums each group.

use crate::error::{ModelError, Result};
use candle_core::Tensor;
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::RepeatKv;

/// `x [batch, kv_heads, seq, head_dim] -> [batch, kv_heads x groups, seq, head_dim]`, output
/// head `h` a copy of head `h / groups` (Hugging Face's `repeat_kv`), so that an attention op
/// taking as many key/value heads as query heads runs grouped-query (or, with one key/value
/// head, multi-query) attention. The backward sums each group's gradients. With `groups` 1
/// `x` is returned as it is. Recorded on kiln-memory's tape as cheap to recompute.
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{DType, Device, Tensor};
/// let kv = Tensor::ones((1, 2, 3, 4), DType::F32, &Device::Cpu)?;
/// assert_eq!(kiln_model::ops::repeat_kv(&kv, 4)?.dims(), &[1, 8, 3, 4]);
/// # Ok(()) }
/// ```
pub fn repeat_kv(x: &Tensor, groups: usize) -> Result<Tensor> {
    const OP: &str = "repeat_kv";
    if groups == 0 {
        return Err(ModelError::InvalidValue {
            field: "groups (query heads per key/value head)",
            value: 0.0,
            expected: "> 0",
        });
    }
    if x.dims().len() != 4 {
        return Err(ModelError::Shape {
            op: OP,
            what: "x",
            expected: "[batch, kv_heads, seq, head_dim]".into(),
            got: format!("{:?}", x.dims()),
        });
    }
    if !is_float(x.dtype()) {
        return Err(ModelError::Dtype {
            op: OP,
            what: "x",
            expected: FLOAT_DTYPES,
            got: x.dtype(),
        });
    }
    if groups == 1 {
        return Ok(x.clone());
    }
    let x = x.contiguous()?;
    Ok(kiln_memory::tape::recomputable(|| {
        kiln_memory::tape::apply_op1(&x, RepeatKv::new(groups))
    })?)
}
