//! Composite equivalents of the fused [`ops`](crate::ops), built only from basic candle ops
//! that have a backward (`exp`, `sum_keepdim`, broadcasts, `gather`, `where_cond`).
//!
//! They are the second implementation the fused ops are tested against, and the baseline of
//! `bench/src/bin/bench_model.rs`. They allocate one tensor per step and are several times slower.

use crate::error::{ModelError, Result};
use candle_core::{Tensor, D};

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let y = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(y.broadcast_mul(weight)?.broadcast_add(bias)?)
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension, from candle's ops (Llama's
/// RMSNorm as `transformers` writes it).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let y = x.broadcast_div(&(ms + eps)?.sqrt()?)?;
    Ok(y.broadcast_mul(weight)?)
}

/// `silu(gate) * up` for `x = [gate, up]` along the last dimension, from candle's ops (Llama's
/// MLP activation as `transformers` writes it, with the two projections' outputs side by side).
pub fn swiglu(x: &Tensor) -> Result<Tensor> {
    let n = x.dim(D::Minus1)? / 2;
    let gate = x.narrow(D::Minus1, 0, n)?;
    let up = x.narrow(D::Minus1, n, n)?;
    Ok((candle_nn::ops::silu(&gate)? * up)?)
}

/// The rotary embedding of [`crate::ops::rotary`] from candle's ops: for the half layout
/// Hugging Face's `q * cos + rotate_half(q) * sin` with `cos` and `sin` repeated over both
/// halves, for the interleaved one the same on the even and odd elements.
pub fn rotary(
    x: &Tensor,
    table: &Tensor,
    head_dim: usize,
    heads: usize,
    layout: crate::ops::RotaryLayout,
) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (seq, width) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let half = head_dim / 2;
    let rot = heads * head_dim;
    let lead: Vec<usize> = dims[..dims.len() - 1].to_vec();
    let cos = table.narrow(1, 0, half)?.reshape((seq, 1, half))?;
    let sin = table.narrow(1, half, half)?.reshape((seq, 1, half))?;
    let mut hs = lead.clone();
    hs.extend([heads, head_dim]);
    let xr = x.narrow(D::Minus1, 0, rot)?.reshape(hs)?;
    let rotated = match layout {
        crate::ops::RotaryLayout::Half => {
            let (a, b) = (
                xr.narrow(D::Minus1, 0, half)?,
                xr.narrow(D::Minus1, half, half)?,
            );
            let ra = (a.broadcast_mul(&cos)? - b.broadcast_mul(&sin)?)?;
            let rb = (b.broadcast_mul(&cos)? + a.broadcast_mul(&sin)?)?;
            Tensor::cat(&[ra, rb], D::Minus1)?
        }
        crate::ops::RotaryLayout::Interleaved => {
            let mut ps = lead.clone();
            ps.extend([heads, half, 2]);
            let p = xr.reshape(ps)?;
            let a = p.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
            let b = p.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?;
            let ra = (a.broadcast_mul(&cos)? - b.broadcast_mul(&sin)?)?;
            let rb = (b.broadcast_mul(&cos)? + a.broadcast_mul(&sin)?)?;
            let mut hs = lead.clone();
            hs.extend([heads, head_dim]);
            Tensor::stack(&[ra, rb], D::Minus1)?.reshape(hs)?
        }
    };
    let mut flat = lead;
    flat.push(rot);
    let rotated = rotated.reshape(flat)?;
    if rot == width {
        return Ok(rotated);
    }
    Ok(Tensor::cat(
        &[rotated, x.narrow(D::Minus1, rot, width - rot)?],
        D::Minus1,
    )?)
}

/// [`crate::ops::repeat_kv`] as `transformers` writes it: an expand of a new group dimension
/// and a reshape.
pub fn repeat_kv(x: &Tensor, groups: usize) -> Result<Tensor> {
    let (b, h, s, d) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, h, groups, s, d))?
        .reshape((b, h * groups, s, d))?)
}

/// Causal softmax of `scale * x` over the last dimension of `[.., tq, tk]` scores.
pub fn causal_softmax_scaled(x: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = x.dims();
    if dims.len() < 2 || dims[dims.len() - 2] > dims[dims.len() - 1] {
        return Err(ModelError::Shape {
            op: "reference::causal_softmax",
            what: "x",
            expected: "[.., tq, tk] with tq <= tk".into(),
            got: format!("{dims:?}"),
        });
    }
    let (tq, tk) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let mask: Vec<u8> = (0..tq)
        .flat_map(|i| (0..tk).map(move |j| u8::from(j <= i + tk - tq)))
        .collect();
    let mask = Tensor::from_vec(mask, (tq, tk), x.device())?.broadcast_as(x.shape())?;
    let neg = Tensor::new(f32::NEG_INFINITY, x.device())?
        .to_dtype(x.dtype())?
        .broadcast_as(x.shape())?;
    let xm = mask.where_cond(&(x * scale)?, &neg)?;
    let max = xm.max_keepdim(D::Minus1)?.detach();
    let e = xm.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// GELU, tanh approximation.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    let inner = ((x + (x.powf(3.0)? * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
    Ok(((x * 0.5)? * (inner.tanh()? + 1.0)?)?)
}

/// GELU of `x + bias`, the bias broadcast over the last dimension.
pub fn bias_gelu(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    gelu(&x.broadcast_add(bias)?)
}

/// Mean cross-entropy of `logits` `[n, vocab]` against u32 `targets` `[n]`, skipping
/// `ignore_index`; the loss keeps the logits' dtype.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
) -> Result<Tensor> {
    let t = targets.to_vec1::<u32>()?;
    let keep: Vec<f32> = t
        .iter()
        .map(|&t| if Some(t) == ignore_index { 0.0 } else { 1.0 })
        .collect();
    let count = keep.iter().sum::<f32>().max(1.0);
    let safe: Vec<u32> = t
        .iter()
        .map(|&t| if Some(t) == ignore_index { 0 } else { t })
        .collect();
    let n = t.len();
    let dev = logits.device();
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp = shifted.broadcast_sub(&lse)?;
    let idx = Tensor::from_vec(safe, (n, 1), dev)?;
    let picked = logp.gather(&idx, 1)?.squeeze(1)?;
    let keep = Tensor::from_vec(keep, n, dev)?.to_dtype(logits.dtype())?;
    let total = (picked * keep)?.sum_all()?;
    Ok((total.neg()? / count as f64)?)
}
