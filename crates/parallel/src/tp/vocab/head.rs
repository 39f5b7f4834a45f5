//! The tied LM head and the vocab-parallel cross-entropy as one graph node.

use super::{ce_stats, cross_entropy_over};
use crate::error::{ParallelError, Result};
use crate::tp::linear::linear_cpu;
use crate::tp::ops::{copy_to_tp_region, TpComm};
use crate::tp::sequence::gather_from_sequence_parallel_region;
use crate::tp::vocab::{vocab_parallel_cross_entropy, vocab_parallel_logits};
use candle_core::{Tensor, TensorId};
use kiln_kernels::matmul_precision;
use kiln_kernels::ops::vocab::HeadCrossEntropy;
use std::sync::{Arc, Mutex};

/// [`vocab_parallel_logits`] followed by [`vocab_parallel_cross_entropy`], as one node of the
/// graph: the mean cross-entropy of the logits `f(x) wte_local^T` against `targets`, with
/// `x` `[n, d]` (replicated), `wte_local` this rank's rows `[vocab / tp, d]` and `targets`
/// `[n]` (u32 ids in the whole vocabulary, `ignore_index` left out of the mean).
///
/// The loss and the gradients of `x` and `wte_local` are bitwise those of the two ops: the
/// same product (at this thread's [`matmul_precision`]), the same row statistics reduced
/// over the group, the same logits gradient and the same two products on it. What goes is
/// the logits as a node of the graph: there, candle's backward gives them a zero-filled
/// gradient buffer `[n, vocab / tp]` and adds the cross-entropy's gradient into it before the
/// head's backward reads it, one fill and one addition of the largest activation of the
/// model. Here the backward hands the logits gradient straight to the head's products.
///
/// CPU tensors with a two-dimensional `x`; anything else (a CUDA tensor) runs the two ops.
pub fn vocab_parallel_linear_cross_entropy(
    x: &Tensor,
    wte_local: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
    comm: &TpComm,
) -> Result<Tensor> {
    check_input(x, wte_local)?;
    if !x.device().is_cpu() || !wte_local.device().is_cpu() {
        let logits = vocab_parallel_logits(x, wte_local, comm)?;
        return vocab_parallel_cross_entropy(&logits, targets, ignore_index, comm);
    }
    // what `vocab_parallel_logits` multiplies: `f(x)` and the weight in x's dtype
    let x = copy_to_tp_region(x, comm)?;
    fused(&x, wte_local, targets, ignore_index, Some(comm))
}

/// [`vocab_parallel_linear_cross_entropy`] under sequence parallelism: `x_local` `[n / tp, d]`
/// is this rank's token rows of the head's input (see [`crate::tp::sequence_parallel_rows`]),
/// all-gathered into `[n, d]` before the product; `targets` `[n]` are every row's. Backward,
/// the input gradient (partial on each rank, from its vocabulary shard) is summed over the
/// group and scattered back to the rows. The loss and `wte_local`'s gradient are bitwise those
/// of [`vocab_parallel_linear_cross_entropy`] on the gathered rows.
pub fn sequence_parallel_linear_cross_entropy(
    x_local: &Tensor,
    wte_local: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
    comm: &TpComm,
) -> Result<Tensor> {
    check_input(x_local, wte_local)?;
    let x = gather_from_sequence_parallel_region(x_local, comm)?;
    if !x.device().is_cpu() || !wte_local.device().is_cpu() {
        let logits = crate::tp::linear(&x, wte_local, None)?;
        return cross_entropy_over(&logits, targets, ignore_index, Some(comm));
    }
    fused(&x, wte_local, targets, ignore_index, Some(comm))
}

/// The LM head `x w^T` over the whole vocabulary and the mean cross-entropy of its logits
/// against `targets`, as one graph node: with `x` `[n, d]`, `w` `[vocab, d]` (the tied
/// embedding) and `targets` `[n]` (u32 ids, `ignore_index` left out of the mean), the loss
/// is a scalar (f64 for f64 `x`, f32 otherwise).
///
/// [`vocab_parallel_linear_cross_entropy`] on one rank, bitwise, with no communicator: the
/// logits' row statistics come from the vectorised one-pass kernels, and the backward hands
/// the logits gradient straight to the head's two products (no zero-filled `[n, vocab]`
/// gradient buffer for the logits, no addition into it). CPU tensors with a two-dimensional
/// `x`; on another device it runs [`crate::tp::linear`] and the cross-entropy as two ops
/// (the row statistics there are taken on the host).
pub fn linear_cross_entropy(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
) -> Result<Tensor> {
    check_input(x, w)?;
    if !x.device().is_cpu() || !w.device().is_cpu() {
        let logits = crate::tp::linear(x, w, None)?;
        return cross_entropy_over(&logits, targets, ignore_index, None);
    }
    fused(x, w, targets, ignore_index, None)
}

/// `x` must be `[n, d]` for a weight `[rows, d]`.
fn check_input(x: &Tensor, w: &Tensor) -> Result<()> {
    let (_, d) = w.dims2()?;
    match x.dims() {
        &[_, xd] if xd == d => Ok(()),
        dims => Err(ParallelError::Param {
            name: "LM head input".into(),
            expected: format!("[n, {d}]"),
            got: format!("{dims:?}"),
        }),
    }
}

/// The head's product and the row statistics over `group` (`None`: the whole vocabulary
/// here), recorded as one [`HeadCrossEntropy`] node (kiln-kernels); `x` is `[n, d]` on the
/// CPU.
fn fused(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
    group: Option<&TpComm>,
) -> Result<Tensor> {
    let n = x.dims().first().copied().unwrap_or(0);
    if targets.dims() != [n] {
        return Err(ParallelError::Param {
            name: "cross-entropy targets".into(),
            expected: format!("[{n}]"),
            got: format!("{:?}", targets.dims()),
        });
    }
    let x = x.contiguous()?;
    let w = w.to_dtype(x.dtype())?.contiguous()?;
    let precision = matmul_precision();
    let logits = linear_cpu(&x.detach(), &w.detach(), None)?;
    let (logits, stats) = ce_stats(&logits, targets, ignore_index, group)?;
    Ok(kiln_memory::tape::apply_op2_split(
        &x,
        &w,
        SplitHead::new(HeadCrossEntropy::new(stats, logits, precision)),
    )?)
}

/// [`HeadCrossEntropy`] on kiln-memory's tape with its backward in parts
/// ([`kiln_memory::tape::SplitBackward`]): a zero-bubble pipeline schedule computes the head
/// input's gradient in its input pass and the (tied) embedding's in its weight pass. The
/// logits' gradient the input pass computes is kept for the weight pass (one softmax over
/// the vocabulary, not two), keyed by the output gradient it came from.
#[derive(Debug, Clone)]
struct SplitHead {
    op: HeadCrossEntropy,
    dlogits: Arc<Mutex<Option<(TensorId, Tensor)>>>,
}

impl SplitHead {
    fn new(op: HeadCrossEntropy) -> Self {
        Self {
            op,
            dlogits: Arc::default(),
        }
    }
}

impl candle_core::CustomOp2 for SplitHead {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.op.cpu_fwd(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        loss: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        self.op.bwd(x, w, loss, grad)
    }
}

impl kiln_memory::tape::SplitBackward for SplitHead {
    fn backward_part(
        &self,
        inputs: &[Tensor],
        grad: &Tensor,
        wanted: &[bool],
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let [x, w] = inputs else {
            candle_core::bail!(
                "kiln-tp-vocab-head-cross-entropy: backward of {} inputs, not 2",
                inputs.len()
            )
        };
        let want = kiln_kernels::dense::LinearGrads {
            x: wanted.first().copied().unwrap_or(false),
            weight: wanted.get(1).copied().unwrap_or(false),
            bias: false,
        };
        if !want.x && !want.weight {
            return Ok(vec![None, None]);
        }
        let mut kept = self
            .dlogits
            .lock()
            .map_err(|_| candle_core::Error::msg("the head's logits gradient lock is poisoned"))?;
        let (dlogits, fresh) = match kept.take() {
            Some((id, d)) if id == grad.id() => (d, false),
            _ => (self.op.logits_grad(grad)?, true),
        };
        let (dx, dw) = self.op.backward_parts(x, w, &dlogits, want)?;
        // a first part alone: the other comes later, from the same output gradient
        if fresh && !(want.x && want.weight) {
            *kept = Some((grad.id(), dlogits));
        }
        Ok(vec![dx, dw])
    }
}
