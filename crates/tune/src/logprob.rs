//! Per-sequence log-probabilities of responses: what DPO compares between the policy and the
//! reference, read from the model's head through kiln's fused cross-entropy (vocab-parallel
//! under tensor parallelism), so the logits' softmax has a backward and the vocabulary may be
//! split.

use crate::batch::IGNORE_INDEX;
use crate::error::{Result, TuneError};
use candle_core::{DType, Tensor};
use kiln_model::{ops, Gpt, ParamSource};
use kiln_parallel::tp::vocab_parallel_cross_entropy;

/// `log(sigmoid(x))`, computed stably as `min(x, 0) - log(1 + exp(-|x|))`, with a backward.
pub fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    let soft = x.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?;
    Ok((x.minimum(0.0)? - soft)?)
}

/// Per row of `hidden` `[b, t, d]` (the output of the model's last block), the sum over the
/// positions whose target is not [`IGNORE_INDEX`] of `log p(target)` under the model's head
/// with the weights `p` supplies; `targets` is `[b, t]` (u32). Returns `[b]` (f32; f64 when
/// the model computes in f64), differentiable. A row without a counted target gives 0.
pub fn sequence_log_probs(
    model: &Gpt,
    hidden: &Tensor,
    targets: &Tensor,
    p: &dyn ParamSource,
) -> Result<Tensor> {
    let (b, t, _) = hidden.dims3()?;
    if targets.dims() != [b, t] || targets.dtype() != DType::U32 {
        return Err(TuneError::input(
            "targets",
            format!("u32 [{b}, {t}]"),
            format!("{:?} {:?}", targets.dtype(), targets.dims()),
        ));
    }
    let logits = model.head_logits_local(hidden, p)?;
    let ids: Vec<u32> = targets.flatten_all()?.to_vec1()?;
    let mut rows = Vec::with_capacity(b);
    for i in 0..b {
        let count = ids[i * t..(i + 1) * t]
            .iter()
            .filter(|&&x| x != IGNORE_INDEX)
            .count();
        let li = logits.get(i)?;
        let ti = targets.get(i)?;
        let mean = match model.tp_group() {
            None => ops::cross_entropy(&li, &ti, Some(IGNORE_INDEX))?,
            Some(c) => vocab_parallel_cross_entropy(&li, &ti, Some(IGNORE_INDEX), c)?,
        };
        rows.push(mean.affine(-(count as f64), 0.0)?);
    }
    Ok(Tensor::stack(&rows, 0)?)
}

/// [`sequence_log_probs`] of whole sequences through `model` with its own weights, with no
/// gradient kept (a frozen reference model, or evaluation): `inputs` and `targets` `[b, t]`.
pub fn model_log_probs(model: &Gpt, inputs: &Tensor, targets: &Tensor) -> Result<Vec<f32>> {
    let mut x = model.embed(inputs)?;
    for i in 0..model.n_blocks() {
        x = model.block(i, &x)?.detach();
    }
    let lp = sequence_log_probs(model, &x, targets, &model.named_parameters())?;
    Ok(lp.detach().to_dtype(DType::F32)?.to_vec1()?)
}

/// Segment `i` of a GPT run as kiln-memory's segments when it is the embedding or a block
/// (`Some`); `None` for the last segment, whose head the objective supplies.
pub(crate) fn trunk_segment(
    gpt: &Gpt,
    i: usize,
    input: &Tensor,
    params: &kiln_memory::SegmentParams,
) -> Option<candle_core::Result<Tensor>> {
    let n = gpt.n_blocks();
    let out = if i == 0 {
        gpt.embed_with(input, params)
    } else if i <= n {
        gpt.block_with(i - 1, input, params)
    } else {
        return None;
    };
    Some(out.map_err(candle_core::Error::wrap))
}
