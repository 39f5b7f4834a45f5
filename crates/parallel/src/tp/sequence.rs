//! Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
//! Recomputation in Large Transformer Models"): the region a tensor-parallel group otherwise
//! computes whole on every rank (LayerNorm, residual adds, the row-parallel bias, dropout) split
//! along the token rows, so each rank computes and stores `1 / tp` of it.
//!
//! The split: every dimension of `[.., s, d]` but the last flattened into token rows, each rank
//! holding one contiguous run of them, rank `k` the `k`-th. Shaped `[.., s / tp, d]` (the
//! sequence dimension divided by the degree), that run is what Megatron's `[s, b, h]` layout
//! keeps on a rank; with kiln's `[b, s, d]` it is a block of whole rows of the flattened
//! batch, so a row-wise op (normalisation, bias, residual) gives on it exactly the rows it
//! gives on the whole.
//!
//! The conjugate pairs that replace `f` and `g` around the parallel region:
//! - [`gather_from_sequence_parallel_region`]: all-gather of the rows forward (before a
//!   column-parallel product), reduce-scatter of the gradient backward;
//! - [`reduce_scatter_to_sequence_parallel_region`]: reduce-scatter forward (after a
//!   row-parallel product, in place of the all-reduce), all-gather backward;
//! - [`scatter_to_sequence_parallel_region`]: this rank's rows of a replicated tensor forward,
//!   all-gather backward.
//!
//! A replicated parameter used on the split rows (a LayerNorm's gain and shift, a row-parallel
//! bias) gets a partial gradient on each rank: pass it through [`super::copy_to_tp_region`]
//! (identity forward, all-reduce backward) so that its gradient is the sum and stays the same on
//! every rank.

use crate::error::{ParallelError, Result};
use crate::tp::ops::{comm_error, TpComm};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use kiln_comm::{CommElem, CommExt, ReduceOp};
use kiln_kernels::custom_op::contiguous;
use kiln_kernels::map_float_storage;
use std::ops::Range;

/// The token rows `[start, end)` of the `rows` (every dimension but the last, flattened) that
/// this rank holds under sequence parallelism over `comm`; `rows` must be a multiple of the
/// degree.
pub fn sequence_parallel_rows(rows: usize, comm: &TpComm) -> Result<Range<usize>> {
    let tp = comm.world_size();
    if rows % tp != 0 {
        return Err(ParallelError::Param {
            name: "sequence-parallel rows".into(),
            expected: format!("a multiple of the tensor-parallel degree {tp}"),
            got: format!("{rows}"),
        });
    }
    let n = rows / tp;
    Ok(comm.rank() * n..(comm.rank() + 1) * n)
}

/// `x`'s shape with its second-to-last dimension multiplied by `num` and divided by `den`.
fn with_seq(layout: &Layout, num: usize, den: usize) -> Shape {
    let mut dims = layout.dims().to_vec();
    let at = dims.len().saturating_sub(2);
    if let Some(s) = dims.get_mut(at) {
        *s = *s * num / den;
    }
    Shape::from(dims)
}

/// Checks that `x` is `[.., s, d]` with `s` and `d` positive and `s` a multiple of `divisor`.
fn check_seq(x: &Tensor, op: &'static str, divisor: usize) -> Result<()> {
    match x.dims() {
        [.., s, d] if *s > 0 && *d > 0 && s % divisor == 0 => Ok(()),
        dims => Err(ParallelError::Param {
            name: format!("{op} input"),
            expected: format!(
                "[.., s, d] with s a positive multiple of {divisor} (the tensor-parallel degree \
                 where the op splits s) and d > 0"
            ),
            got: format!("{dims:?}"),
        }),
    }
}

/// A collective from contiguous `x` into a new vector of `x.len() * num / den` elements:
/// every rank's `x` concatenated in rank order (all-gather, `num = tp`), or the sum over the
/// ranks of which this rank keeps its `1 / tp` run (reduce-scatter, `den = tp`).
fn collective<T: CommElem>(
    data: &[T],
    layout: &Layout,
    (num, den): (usize, usize),
    op: &'static str,
    run: impl FnOnce(&[T], &mut [T]) -> kiln_comm::Result<()>,
) -> candle_core::Result<Vec<T>> {
    let x = contiguous(data, layout, op)?;
    if x.len() * num % den != 0 {
        return Err(candle_core::Error::msg(format!(
            "{op}: {} elements do not split over {den} ranks",
            x.len()
        )));
    }
    let Some(&fill) = x.first() else {
        return Ok(Vec::new());
    };
    let mut out = vec![fill; x.len() * num / den];
    run(x, &mut out).map_err(|e| comm_error(op, e))?;
    Ok(out)
}

/// This rank's `1 / tp` run of contiguous `x`.
fn scattered<T: Copy>(
    data: &[T],
    layout: &Layout,
    comm: &TpComm,
    op: &'static str,
) -> candle_core::Result<Vec<T>> {
    let x = contiguous(data, layout, op)?;
    let tp = comm.world_size();
    let n = x.len() / tp;
    let at = comm.rank() * n;
    x.get(at..at + n)
        .map(<[T]>::to_vec)
        .ok_or_else(|| candle_core::Error::msg(format!("{op}: input shorter than its shape")))
}

/// Which collective a [`SeqOp`] runs forward; its backward runs the conjugate.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SeqKind {
    /// All-gather forward, reduce-scatter backward.
    Gather,
    /// Reduce-scatter forward, all-gather backward.
    ReduceScatter,
    /// This rank's rows forward, all-gather backward.
    Scatter,
    /// All-gather with no gradient (the backward of the last two).
    GatherNoGrad,
    /// Reduce-scatter with no gradient (the backward of `Gather`).
    ReduceScatterNoGrad,
}

struct SeqOp {
    comm: TpComm,
    kind: SeqKind,
}

impl CustomOp1 for SeqOp {
    fn name(&self) -> &'static str {
        match self.kind {
            SeqKind::Gather => "kiln-sp-gather",
            SeqKind::ReduceScatter => "kiln-sp-reduce-scatter",
            SeqKind::Scatter => "kiln-sp-scatter",
            SeqKind::GatherNoGrad => "kiln-sp-gather-bwd",
            SeqKind::ReduceScatterNoGrad => "kiln-sp-reduce-scatter-bwd",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let tp = self.comm.world_size();
        let c = &self.comm;
        Ok(match self.kind {
            SeqKind::Gather | SeqKind::GatherNoGrad => (
                map_float_storage!(s, op, |v| collective(v, l, (tp, 1), op, |x, out| c
                    .all_gather(x, out))?),
                with_seq(l, tp, 1),
            ),
            SeqKind::ReduceScatter | SeqKind::ReduceScatterNoGrad => (
                map_float_storage!(s, op, |v| collective(v, l, (1, tp), op, |x, out| c
                    .reduce_scatter(x, out, ReduceOp::Sum))?),
                with_seq(l, 1, tp),
            ),
            SeqKind::Scatter => (
                map_float_storage!(s, op, |v| scattered(v, l, c, op)?),
                with_seq(l, 1, tp),
            ),
        })
    }

    /// The same host logic as `cpu_fwd`, staged through host memory (see `ops.rs`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        kiln_kernels::cuda::staged_fwd(self, s, l)
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let kind = match self.kind {
            SeqKind::Gather => SeqKind::ReduceScatterNoGrad,
            SeqKind::ReduceScatter | SeqKind::Scatter => SeqKind::GatherNoGrad,
            SeqKind::GatherNoGrad | SeqKind::ReduceScatterNoGrad => return Ok(None),
        };
        let g = grad.contiguous()?.apply_op1_no_bwd(&SeqOp {
            comm: self.comm.clone(),
            kind,
        })?;
        Ok(Some(g))
    }
}

fn apply(x: &Tensor, comm: &TpComm, kind: SeqKind) -> Result<Tensor> {
    let x = x.contiguous()?;
    let op = SeqOp {
        comm: comm.clone(),
        kind,
    };
    Ok(if kind == SeqKind::Gather {
        // the whole rows, cheap to gather again against the activation they are: a selective
        // checkpoint drops them (every rank of the group gathers again at the same record)
        kiln_memory::tape::recomputable(|| kiln_memory::tape::apply_op1(&x, op))?
    } else {
        kiln_memory::tape::apply_op1(&x, op)?
    })
}

/// Every rank's rows `[.., s / tp, d]` concatenated into the whole `[.., s, d]` (rank `k`'s
/// rows the `k`-th run of the flattened rows); backward, the gradient is summed over the group
/// and each rank keeps its own rows (reduce-scatter). Put it before a column-parallel product
/// in place of `f`.
///
/// With one rank this is `x` itself (no op is recorded).
pub fn gather_from_sequence_parallel_region(x: &Tensor, comm: &TpComm) -> Result<Tensor> {
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    check_seq(x, "gather_from_sequence_parallel_region", 1)?;
    apply(x, comm, SeqKind::Gather)
}

/// The sum over the group of every rank's `x` `[.., s, d]`, of which this rank keeps its rows
/// `[.., s / tp, d]`; backward, the gradients of every rank's rows are all-gathered. Put it
/// after a row-parallel product in place of `g`: the same sum as the all-reduce, each rank
/// computing and storing a `1 / tp` of it.
///
/// With one rank this is `x` itself (no op is recorded).
pub fn reduce_scatter_to_sequence_parallel_region(x: &Tensor, comm: &TpComm) -> Result<Tensor> {
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    check_seq(
        x,
        "reduce_scatter_to_sequence_parallel_region",
        comm.world_size(),
    )?;
    apply(x, comm, SeqKind::ReduceScatter)
}

/// This rank's rows `[.., s / tp, d]` of a replicated `x` `[.., s, d]`; backward, the gradients
/// of every rank's rows are all-gathered, so the gradient of `x` is whole (and the same) on
/// every rank. The inverse of [`gather_from_sequence_parallel_region`]: enters the split
/// region from a replicated tensor.
///
/// With one rank this is `x` itself (no op is recorded).
pub fn scatter_to_sequence_parallel_region(x: &Tensor, comm: &TpComm) -> Result<Tensor> {
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    check_seq(x, "scatter_to_sequence_parallel_region", comm.world_size())?;
    apply(x, comm, SeqKind::Scatter)
}
