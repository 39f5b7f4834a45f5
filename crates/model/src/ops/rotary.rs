//! Rotary position embedding ([`Rotary`]): the tables of angles (with Llama 3's frequency
//! scaling) and the rotation of query and key heads, with its backward.

use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use kiln_kernels::custom_op::{is_float, FLOAT_DTYPES};
use kiln_kernels::ops::Rotary;
pub use kiln_kernels::ops::RotaryLayout;

/// Llama 3's scaling of the rotary frequencies for a longer context (`rope_scaling` with
/// `rope_type: "llama3"` in a Hugging Face config): wavelengths longer than
/// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, those shorter
/// than `original_max_position_embeddings / high_freq_factor` are kept, and those between are
/// interpolated.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Llama3Scaling {
    /// How much longer the context is (8 for Llama 3.1).
    pub factor: f64,
    /// 1 for Llama 3.1.
    pub low_freq_factor: f64,
    /// 4 for Llama 3.1.
    pub high_freq_factor: f64,
    /// The context the model was first trained at (8192 for Llama 3.1).
    pub original_max_position_embeddings: usize,
}

impl Llama3Scaling {
    /// The scaling a Hugging Face `config.json`'s `rope_scaling` describes: `null` (or absent)
    /// is none, `{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    /// "original_max_position_embeddings"}` (older files say `type`) is Llama 3's; any other
    /// type (`linear`, `dynamic`, `yarn`, `longrope`, ...) or a missing field is an error naming
    /// it.
    ///
    /// ```
    /// use kiln_model::ops::Llama3Scaling;
    /// let v = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    ///     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    /// assert_eq!(Llama3Scaling::from_hf(&v)?.map(|s| s.factor), Some(8.0));
    /// let yarn = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    /// assert!(Llama3Scaling::from_hf(&yarn).unwrap_err().to_string().contains("yarn"));
    /// # Ok::<(), kiln_model::ModelError>(())
    /// ```
    pub fn from_hf(rope_scaling: &serde_json::Value) -> Result<Option<Self>> {
        if rope_scaling.is_null() {
            return Ok(None);
        }
        let kind = rope_scaling
            .get("rope_type")
            .or_else(|| rope_scaling.get("type"))
            .and_then(|t| t.as_str());
        match kind {
            Some("llama3") => {}
            Some("default") => return Ok(None),
            other => {
                return Err(ModelError::HfConfig {
                    field: "rope_scaling.rope_type",
                    got: other.map_or_else(|| rope_scaling.to_string(), |t| format!("{t:?}")),
                    expected: "\"llama3\" (or no rope_scaling); linear, dynamic, yarn and \
                               longrope scaling are not supported",
                })
            }
        }
        let num = |field: &'static str| {
            rope_scaling
                .get(field.trim_start_matches("rope_scaling."))
                .and_then(|v| v.as_f64())
                .ok_or_else(|| ModelError::HfConfig {
                    field,
                    got: rope_scaling.to_string(),
                    expected: "a number",
                })
        };
        Ok(Some(Self {
            factor: num("rope_scaling.factor")?,
            low_freq_factor: num("rope_scaling.low_freq_factor")?,
            high_freq_factor: num("rope_scaling.high_freq_factor")?,
            original_max_position_embeddings: num("rope_scaling.original_max_position_embeddings")?
                as usize,
        }))
    }
}

/// The inverse frequencies `theta^(-2i / head_dim)` for `i < head_dim / 2`, scaled as
/// `scaling` says (Hugging Face's `_compute_default_rope_parameters` and
/// `_compute_llama3_parameters`, in f64).
pub fn rotary_inv_freq(head_dim: usize, theta: f64, scaling: Option<Llama3Scaling>) -> Vec<f64> {
    let inv: Vec<f64> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    let Some(s) = scaling else {
        return inv;
    };
    let old = s.original_max_position_embeddings as f64;
    let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
    inv.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// The table [`rotary`] takes: `[seq, head_dim]`, row `p` holding `cos(p f_i)` for the
/// `head_dim / 2` frequencies of [`rotary_inv_freq`] then `sin(p f_i)`, computed in f64 and
/// stored in `dtype` on `device`. A model builds it once per device and length.
pub fn rotary_table(
    seq: usize,
    head_dim: usize,
    theta: f64,
    scaling: Option<Llama3Scaling>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    check_head_dim(head_dim)?;
    check_rope(theta, scaling)?;
    let inv = rotary_inv_freq(head_dim, theta, scaling);
    let half = head_dim / 2;
    let mut v = Vec::with_capacity(seq * head_dim);
    for p in 0..seq {
        v.extend(inv.iter().map(|f| (p as f64 * f).cos()));
        v.extend(inv.iter().map(|f| (p as f64 * f).sin()));
    }
    debug_assert_eq!(v.len(), seq * 2 * half);
    Ok(Tensor::from_vec(v, (seq, head_dim), device)?.to_dtype(dtype)?)
}

/// `theta` finite and above 1, and `scaling`'s factors in order: an error naming the field.
pub(crate) fn check_rope(theta: f64, scaling: Option<Llama3Scaling>) -> Result<()> {
    if !(theta.is_finite() && theta > 1.0) {
        return Err(ModelError::InvalidValue {
            field: "rope_theta",
            value: theta,
            expected: "finite and > 1",
        });
    }
    if let Some(s) = scaling {
        let ok = s.factor.is_finite()
            && s.factor >= 1.0
            && s.low_freq_factor > 0.0
            && s.high_freq_factor > s.low_freq_factor
            && s.original_max_position_embeddings > 0;
        if !ok {
            return Err(ModelError::Config {
                field: "rope_scaling",
                reason: format!(
                    "{s:?}: expected factor >= 1, 0 < low_freq_factor < high_freq_factor and \
                     original_max_position_embeddings > 0"
                ),
            });
        }
    }
    Ok(())
}

fn check_head_dim(head_dim: usize) -> Result<()> {
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(ModelError::InvalidValue {
            field: "head_dim (the rotary dimension)",
            value: head_dim as f64,
            expected: "even and > 0",
        });
    }
    Ok(())
}

/// Rotates the first `heads` heads of `head_dim` elements in each row of `x [.., seq, width]`
/// by the angles of the row's position (its index along the second-to-last dimension), from
/// `table` ([`rotary_table`], `[seq, head_dim]`, in `x`'s dtype), pairing elements as `layout`
/// says; the rest of each row passes through. `x` a float tensor (half types compute in f32);
/// the backward is the inverse rotation. Recorded on kiln-memory's tape.
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{DType, Device, Tensor};
/// use kiln_model::ops::{rotary, rotary_table, RotaryLayout};
/// let dev = Device::Cpu;
/// let table = rotary_table(3, 4, 10_000.0, None, DType::F32, &dev)?;
/// let q = Tensor::ones((1, 3, 8), DType::F32, &dev)?; // 2 heads of 4 at 3 positions
/// let r = rotary(&q, &table, 4, 2, RotaryLayout::Half)?;
/// // position 0 is not rotated
/// assert_eq!(r.get(0)?.get(0)?.to_vec1::<f32>()?, vec![1.0; 8]);
/// # Ok(()) }
/// ```
pub fn rotary(
    x: &Tensor,
    table: &Tensor,
    head_dim: usize,
    heads: usize,
    layout: RotaryLayout,
) -> Result<Tensor> {
    const OP: &str = "rotary";
    check_head_dim(head_dim)?;
    let seq = table.dims().first().copied().unwrap_or(0);
    if table.dims() != [seq, head_dim] {
        return Err(ModelError::Shape {
            op: OP,
            what: "table",
            expected: format!("[seq, {head_dim}]"),
            got: format!("{:?}", table.dims()),
        });
    }
    match x.dims() {
        [.., s, w] if *s == seq && *w >= heads * head_dim => {}
        dims => {
            return Err(ModelError::Shape {
                op: OP,
                what: "x",
                expected: format!(
                    "[.., {seq}, width] with width >= {} ({heads} heads of {head_dim})",
                    heads * head_dim
                ),
                got: format!("{dims:?}"),
            })
        }
    }
    if !is_float(x.dtype()) {
        return Err(ModelError::Dtype {
            op: OP,
            what: "x",
            expected: FLOAT_DTYPES,
            got: x.dtype(),
        });
    }
    if table.dtype() != x.dtype() {
        return Err(ModelError::Dtype {
            op: OP,
            what: "table",
            expected: "the dtype of x",
            got: table.dtype(),
        });
    }
    let (x, table) = (x.contiguous()?, table.contiguous()?);
    Ok(kiln_memory::tape::apply_op2(
        &x,
        &table,
        Rotary::new(head_dim, heads, layout),
    )?)
}
