//! The tied LM head and the vocab-parallel cross-entropy as one graph node.

use super::{ce_stats, grad_row, par_rows, pool_failed, CeStats, VocabCrossEntropyBwd};
use crate::error::{ParallelError, Result};
use crate::tp::cpu_gemm::{bf16_f32_product, round_bf16_pairs};
use crate::tp::dense::{bwd_tensors, linear_cpu, matmul_precision, Mat, MatmulPrecision};
use crate::tp::ops::{contiguous, copy_to_tp_region, TpComm};
use crate::tp::vocab::{vocab_parallel_cross_entropy, vocab_parallel_logits};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Storage, Tensor};
use std::mem::MaybeUninit;
use std::sync::Arc;

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
    let (_, d) = wte_local.dims2()?;
    let n = match x.dims() {
        &[n, xd] if xd == d => n,
        dims => {
            return Err(ParallelError::Param {
                name: "LM head input".into(),
                expected: format!("[n, {d}]"),
                got: format!("{dims:?}"),
            })
        }
    };
    if !x.device().is_cpu() || !wte_local.device().is_cpu() {
        let logits = vocab_parallel_logits(x, wte_local, comm)?;
        return vocab_parallel_cross_entropy(&logits, targets, ignore_index, comm);
    }
    if targets.dims() != [n] {
        return Err(ParallelError::Param {
            name: "cross-entropy targets".into(),
            expected: format!("[{n}]"),
            got: format!("{:?}", targets.dims()),
        });
    }
    // what `vocab_parallel_logits` multiplies: `f(x)` and the weight in x's dtype, contiguous
    let x = copy_to_tp_region(x, comm)?.contiguous()?;
    let w = wte_local.to_dtype(x.dtype())?.contiguous()?;
    let precision = matmul_precision();
    let logits = linear_cpu(&x.detach(), &w.detach(), None)?;
    let (logits, stats) = ce_stats(&logits, targets, ignore_index, comm)?;
    Ok(x.apply_op2(
        &w,
        HeadCrossEntropy {
            stats,
            logits,
            precision,
        },
    )?)
}

/// `(x, wte_local) -> mean loss`, holding the forward's logits for the backward.
struct HeadCrossEntropy {
    stats: Arc<CeStats>,
    logits: Tensor,
    precision: MatmulPrecision,
}

impl CustomOp2 for HeadCrossEntropy {
    fn name(&self) -> &'static str {
        "kiln-tp-vocab-head-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((self.stats.loss(s1.dtype()), Shape::from(())))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let scale = self.stats.grad_scale(grad)?;
        if let Some((dx, dw)) = self.bf16_bwd(x, w, scale)? {
            return Ok((Some(dx), Some(dw)));
        }
        let dlogits = self.logits.apply_op1_no_bwd(&VocabCrossEntropyBwd {
            stats: self.stats.clone(),
            scale,
        })?;
        let (dx, dw, _) = bwd_tensors(x, w, &dlogits, false, self.precision)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl HeadCrossEntropy {
    /// The backward at [`MatmulPrecision::Bf16`] with f32 operands on a CPU with the bf16 dot
    /// product, the logits gradient made as bf16 pairs: `(dx, dw)`, or `None` where this does
    /// not apply (the caller then runs the f32 gradient through [`bwd_tensors`]).
    ///
    /// Both products round the gradient to bf16 as they pack it; here each element is
    /// rounded once as the cross-entropy's backward writes it, by the same conversion, so the
    /// gradients are bitwise those of the f32 gradient. Half the gradient's bytes are written
    /// and read, the `x` gradient's product reads the pairs in place, and the weight
    /// gradient's interleaves them with no rounding (about 2% of a bf16 step at `small_cpu`
    /// sizes, where the gradient is the largest tensor of the step).
    fn bf16_bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        scale: f64,
    ) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        let f32s = [x, w, &self.logits].iter().all(|t| t.dtype() == DType::F32);
        if self.precision != MatmulPrecision::Bf16 || !f32s || !x.device().is_cpu() {
            return Ok(None);
        }
        let (n, v) = self.logits.dims2()?;
        let (d, (wv, wd)) = (x.dim(1)?, w.dims2()?);
        // whole 32-value runs: every element rounds on the kernel the packing uses
        if v % 32 != 0 || n == 0 || d == 0 || (wv, wd) != (v, d) {
            return Ok(None);
        }
        const OP: &str = "kiln-tp-vocab-head-cross-entropy-bwd";
        let (sl, ll) = self.logits.storage_and_layout();
        let (sx, lx) = x.storage_and_layout();
        let (sw, lw) = w.storage_and_layout();
        let (
            Storage::Cpu(CpuStorage::F32(logits)),
            Storage::Cpu(CpuStorage::F32(xs)),
            Storage::Cpu(CpuStorage::F32(ws)),
        ) = (&*sl, &*sx, &*sw)
        else {
            return Ok(None);
        };
        let logits = contiguous(logits, ll, OP).map_err(candle_core::Error::wrap)?;
        let xs = contiguous(xs, lx, OP).map_err(candle_core::Error::wrap)?;
        let ws = contiguous(ws, lw, OP).map_err(candle_core::Error::wrap)?;
        let Some(pairs) = grad_pairs(logits, v, &self.stats, scale)? else {
            return Ok(None);
        };
        // SAFETY: a u32 is two u16 with no padding, u16's alignment divides u32's, and every
        // bit pattern is a valid u16; the view lives no longer than `pairs`
        let bits: &[u16] =
            unsafe { std::slice::from_raw_parts(pairs.as_ptr() as *const u16, 2 * pairs.len()) };
        let mat = |data, rs, cs| Mat { data, rs, cs };
        // dx = dlogits w (n x v by v x d), dw = dlogits^T x (v x n by n x d)
        let dx = bf16_f32_product(
            (n, d, v),
            mat(bits, v, 1),
            Mat {
                data: ws,
                rs: d,
                cs: 1,
            },
        );
        let dw = bf16_f32_product(
            (v, d, n),
            mat(bits, 1, v),
            Mat {
                data: xs,
                rs: d,
                cs: 1,
            },
        );
        let (Some(dx), Some(dw)) = (dx, dw) else {
            return Ok(None);
        };
        let dev = x.device();
        Ok(Some((
            Tensor::from_vec(dx, (n, d), dev)?,
            Tensor::from_vec(dw, (v, d), dev)?,
        )))
    }
}

/// The cross-entropy's gradient of f32 logits `[n, v]` (see `ce_grad`) rounded to bf16
/// pairs as it is written: each row computed in f32 into a scratch row, then rounded by
/// [`round_bf16_pairs`]. `None` where the CPU cannot round on that kernel.
fn grad_pairs(
    x: &[f32],
    v: usize,
    st: &CeStats,
    scale: f64,
) -> candle_core::Result<Option<Vec<u32>>> {
    let len = x.len() / 2;
    if x.len() % v != 0 || v % 32 != 0 {
        return Ok(None);
    }
    let mut out: Vec<u32> = Vec::with_capacity(len);
    let rounded = std::sync::atomic::AtomicBool::new(true);
    let ok = par_rows(
        x,
        v,
        &mut out.spare_capacity_mut()[..len],
        v / 2,
        |r0, xs, os| {
            let mut row = vec![MaybeUninit::<f32>::uninit(); v];
            for (r, (xr, or)) in xs
                .chunks_exact(v)
                .zip(os.chunks_exact_mut(v / 2))
                .enumerate()
            {
                grad_row(r0 + r, xr, &mut row, st, scale);
                // SAFETY: `grad_row` wrote every element of the row
                let vals =
                    unsafe { &*(row.as_slice() as *const [MaybeUninit<f32>] as *const [f32]) };
                if !round_bf16_pairs(vals, or) {
                    rounded.store(false, std::sync::atomic::Ordering::Relaxed);
                    return;
                }
            }
        },
    );
    if !ok {
        return Err(pool_failed());
    }
    if !rounded.into_inner() {
        return Ok(None);
    }
    // SAFETY: every block of rows ran (`ok`) and rounded each of its rows (`rounded`) into
    // its `v / 2` pairs; the rows cover the first `len` pairs
    unsafe { out.set_len(len) };
    Ok(Some(out))
}
