//! The vocab-parallel token embedding, its tied LM head and the vocab-parallel cross-entropy
//! (Megatron-LM): each rank holds `vocab / tp` rows of the embedding and produces the logits
//! of its own slice of the vocabulary; the loss is computed without gathering the logits.
//!
//! On CUDA (feature `cuda`) the cross-entropy stages through host memory until a device
//! communicator (NCCL) exists: the logits are copied to the host for the row statistics the
//! group reduces and for the gradient, which runs the same host code as on the CPU and is
//! copied back to the logits' device; the loss itself is written straight to the device.
//!
//! The row kernels, the statistics and the loss's ops are kiln-kernels' (`ops::vocab`); here
//! are the reductions over the group between their passes, and the checks of the inputs.

use crate::error::{ParallelError, Result};
use crate::tp::linear::column_parallel_linear;
use crate::tp::ops::{reduce_from_tp_region, TpComm};
use crate::tp::sequence::reduce_scatter_to_sequence_parallel_region;
use crate::tp::shard::{shard_vocab, vocab_range};
use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::Layout;
use candle_core::{CpuStorage, DType, Storage, Tensor, Var};
use kiln_comm::{CommElem, CommExt, ReduceOp};
use kiln_kernels::custom_op::{contiguous, Elem, Float};
use kiln_kernels::ops::vocab::{self, CeStats, CeTargets, VocabCrossEntropy};
use std::ops::Range;
use std::sync::Arc;

mod head;
pub use head::{
    linear_cross_entropy, sequence_parallel_linear_cross_entropy,
    vocab_parallel_linear_cross_entropy,
};

/// The ids `wte_local` covers on this rank, and the whole vocabulary.
fn local_range(wte_local: &Tensor, comm: &TpComm) -> Result<(Range<usize>, usize)> {
    let (rows, _) = wte_local.dims2()?;
    let vocab = rows * comm.world_size();
    Ok((vocab_range(vocab, comm.world_size(), comm.rank())?, vocab))
}

fn token_ids(ids: &Tensor, what: &str) -> Result<Vec<u32>> {
    if ids.dtype() != DType::U32 {
        return Err(ParallelError::Param {
            name: what.to_string(),
            expected: "u32 token ids".into(),
            got: format!("{:?}", ids.dtype()),
        });
    }
    Ok(ids.flatten_all()?.to_vec1::<u32>()?)
}

/// Looks up token `ids` (u32, any shape `[..]`) in a vocab-parallel embedding: `wte_local` is
/// this rank's rows `[vocab / tp, d]` (ids `rank * vocab / tp ..`, see [`vocab_range`]). Ids
/// outside this rank's range give zero rows, and the partial results are summed over the
/// group (`g`), so every rank gets the whole `[.., d]` embedding in `wte_local`'s dtype. The
/// gradient of `wte_local` is the matching rows of the dense gradient.
///
/// An id `>= vocab` is an error.
pub fn vocab_parallel_embedding(ids: &Tensor, wte_local: &Tensor, comm: &TpComm) -> Result<Tensor> {
    let rows = partial_embedding(ids, wte_local, comm)?;
    let mut dims = ids.dims().to_vec();
    dims.push(rows.dim(1)?);
    Ok(reduce_from_tp_region(&rows, comm)?.reshape(dims)?)
}

/// [`vocab_parallel_embedding`] under sequence parallelism: for `ids` `[.., s]` (`s` a multiple
/// of the degree) each rank gets only its token rows `[.., s / tp, d]` of the embedding (see
/// [`crate::tp::sequence_parallel_rows`]), the partial lookups reduce-scattered over the group
/// instead of all-reduced. The gradient of `wte_local` is the matching rows of the dense
/// gradient, as there.
pub fn vocab_parallel_embedding_sp(
    ids: &Tensor,
    wte_local: &Tensor,
    comm: &TpComm,
) -> Result<Tensor> {
    let tp = comm.world_size();
    match ids.dims().last() {
        Some(&s) if s > 0 && s % tp == 0 => {}
        _ => {
            return Err(ParallelError::Param {
                name: "sequence-parallel embedding ids".into(),
                expected: format!("[.., s] with s a positive multiple of the degree {tp}"),
                got: format!("{:?}", ids.dims()),
            })
        }
    }
    let rows = partial_embedding(ids, wte_local, comm)?;
    let mut dims = ids.dims().to_vec();
    dims.push(rows.dim(1)?);
    reduce_scatter_to_sequence_parallel_region(&rows.reshape(dims)?, comm)
}

/// This rank's part of the lookup of `ids` as rows `[n, d]`: the rows of the ids in its range,
/// zeros for the others.
fn partial_embedding(ids: &Tensor, wte_local: &Tensor, comm: &TpComm) -> Result<Tensor> {
    let (range, vocab) = local_range(wte_local, comm)?;
    wte_local.dims2()?;
    let flat = token_ids(ids, "embedding ids")?;
    if let Some((index, &id)) = flat
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= vocab)
    {
        return Err(ParallelError::Param {
            name: "embedding ids".into(),
            expected: format!("ids below the vocabulary size {vocab}"),
            got: format!("{id} at position {index}"),
        });
    }
    let n = flat.len();
    let dev = wte_local.device();
    let all_local = flat.iter().all(|&id| range.contains(&(id as usize)));
    let local: Vec<u32> = flat
        .iter()
        .map(|&id| {
            if range.contains(&(id as usize)) {
                id - range.start as u32
            } else {
                0
            }
        })
        .collect();
    let rows = wte_local.index_select(&Tensor::from_vec(local, n, dev)?, 0)?;
    let rows = if all_local {
        rows
    } else {
        let mask: Vec<f32> = flat
            .iter()
            .map(|&id| f32::from(u8::from(range.contains(&(id as usize)))))
            .collect();
        let mask = Tensor::from_vec(mask, (n, 1), dev)?.to_dtype(wte_local.dtype())?;
        rows.broadcast_mul(&mask)?
    };
    Ok(rows)
}

/// The LM head tied to a vocab-parallel embedding: `f(x) wte_local^T`, hidden states
/// `[.., d]` (replicated) to this rank's logits `[.., vocab / tp]`, computing in `x`'s dtype.
/// Feed them to [`vocab_parallel_cross_entropy`]; the input gradient is summed over the group.
pub fn vocab_parallel_logits(x: &Tensor, wte_local: &Tensor, comm: &TpComm) -> Result<Tensor> {
    column_parallel_linear(x, wte_local, None, comm)
}

const CE_OP: &str = "vocab_parallel_cross_entropy";

/// [`reduced_row_stats`] on a typed slice: the row maxima, then in one buffer the sums of
/// `exp(logit - max)` and the target logits (kiln-kernels' row kernels). With one rank each
/// row's maximum and sum come from one pass while the row is in cache; with more the maxima are
/// reduced over the group in between.
fn typed_row_stats<T: Elem>(
    x: &[T],
    v: usize,
    targets: &CeTargets,
    group: Option<&TpComm>,
) -> Result<(Vec<f64>, Vec<f64>)>
where
    T::F: CommElem,
{
    let (max, sums) = match group.filter(|c| c.world_size() > 1) {
        Some(comm) => {
            let mut max = vocab::row_maxima(x, v)?;
            comm.all_reduce(&mut max, ReduceOp::Max)?;
            let mut sums = vocab::row_sums(x, v, targets, &max)?;
            comm.all_reduce(&mut sums, ReduceOp::Sum)?;
            (max, sums)
        }
        None => vocab::row_stats(x, v, targets)?,
    };
    Ok((
        max.into_iter().map(Float::to_f64).collect(),
        sums.into_iter().map(Float::to_f64).collect(),
    ))
}

/// The row maxima and `[sum of exp(logit - max) per row | target logit per row]` of the
/// whole logits, reduced over the group (none when `group` is `None` or has one rank).
fn reduced_row_stats(
    logits: &Tensor,
    v: usize,
    targets: &CeTargets,
    group: Option<&TpComm>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (storage, layout) = logits.storage_and_layout();
    #[cfg(feature = "cuda")]
    let staged;
    let (cpu, layout) = match &*storage {
        Storage::Cpu(cpu) => (cpu, layout.clone()),
        #[cfg(feature = "cuda")]
        Storage::Cuda(cuda) => {
            staged = kiln_kernels::cuda::to_host(cuda, layout, CE_OP)?;
            (&staged, Layout::contiguous(layout.shape()))
        }
        _ => {
            return Err(ParallelError::Param {
                name: "vocab-parallel logits".into(),
                expected: "a tensor on the cpu, or on a cuda device with the cuda feature".into(),
                got: format!("{:?}", logits.device().location()),
            })
        }
    };
    let layout = &layout;
    let c = |e| ParallelError::from(e);
    match cpu {
        CpuStorage::F32(x) => {
            typed_row_stats(contiguous(x, layout, CE_OP).map_err(c)?, v, targets, group)
        }
        CpuStorage::F16(x) => {
            typed_row_stats(contiguous(x, layout, CE_OP).map_err(c)?, v, targets, group)
        }
        CpuStorage::BF16(x) => {
            typed_row_stats(contiguous(x, layout, CE_OP).map_err(c)?, v, targets, group)
        }
        CpuStorage::F64(x) => {
            typed_row_stats(contiguous(x, layout, CE_OP).map_err(c)?, v, targets, group)
        }
        other => Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), CE_OP).into()),
    }
}

/// Mean cross-entropy of vocab-parallel `logits_local` `[n, vocab / tp]` (this rank's columns
/// `rank * vocab / tp ..` of the whole `[n, vocab]` logits, as produced by
/// [`vocab_parallel_logits`]) against `targets` `[n]` (u32 ids in the whole vocabulary),
/// averaged over the targets not equal to `ignore_index`, without gathering the logits.
///
/// Forward, three reductions over the group: the row maxima (max), then in one buffer the
/// sums of `exp(logit - max)` and the target logits (sum, each rank contributing the targets
/// it holds). The result is a scalar on every rank, f64 for f64 logits and f32 otherwise.
/// Backward, with no communication: `(softmax_local - onehot_local) / count` times the
/// incoming gradient, zero rows for ignored targets. When every target is ignored the loss
/// and the gradient are 0. Rows are reduced in f32 (f64 for f64 logits), like the dense
/// kernel, and the mean is taken in f64.
pub fn vocab_parallel_cross_entropy(
    logits_local: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
    comm: &TpComm,
) -> Result<Tensor> {
    cross_entropy_over(logits_local, targets, ignore_index, Some(comm))
}

/// [`vocab_parallel_cross_entropy`] over `group` (`None`: the logits hold the whole
/// vocabulary), recorded as one `VocabCrossEntropy` node (kiln-kernels).
fn cross_entropy_over(
    logits_local: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
    group: Option<&TpComm>,
) -> Result<Tensor> {
    let (logits, stats) = ce_stats(logits_local, targets, ignore_index, group)?;
    Ok(kiln_memory::tape::apply_op1(
        &logits,
        VocabCrossEntropy::new(stats),
    )?)
}

/// The checked, contiguous logits and their row statistics reduced over the group (`None`:
/// this rank holds the whole vocabulary): what the cross-entropy's forward computes and its
/// backward reuses.
fn ce_stats(
    logits_local: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
    group: Option<&TpComm>,
) -> Result<(Tensor, Arc<CeStats>)> {
    let (n, v) = match logits_local.dims() {
        &[n, v] if v > 0 => (n, v),
        dims => {
            return Err(ParallelError::Param {
                name: "vocab-parallel logits".into(),
                expected: "[n, vocab / tp] with vocab > 0".into(),
                got: format!("{dims:?}"),
            })
        }
    };
    if targets.dims() != [n] {
        return Err(ParallelError::Param {
            name: "cross-entropy targets".into(),
            expected: format!("[{n}]"),
            got: format!("{:?}", targets.dims()),
        });
    }
    let t = token_ids(targets, "cross-entropy targets")?;
    let (world, rank) = group.map_or((1, 0), |c| (c.world_size(), c.rank()));
    let vocab = v * world;
    if let Some((index, &id)) = t
        .iter()
        .enumerate()
        .find(|(_, &id)| Some(id) != ignore_index && id as usize >= vocab)
    {
        return Err(ParallelError::Param {
            name: "cross-entropy targets".into(),
            expected: format!("ids below the vocabulary size {vocab} or the ignore index"),
            got: format!("{id} at position {index}"),
        });
    }
    let targets = CeTargets::new(t, ignore_index, rank * v, v);
    let logits = logits_local.contiguous()?;
    let (max, sums) = reduced_row_stats(&logits, v, &targets, group)?;
    let stats = Arc::new(CeStats::new(targets, &max, &sums));
    Ok((logits, stats))
}

/// A vocab-parallel token embedding whose transpose is also the LM head (tied weights): this
/// rank holds rows [`VocabParallelEmbedding::vocab_range`] of `wte` `[vocab, d]`.
#[derive(Clone)]
pub struct VocabParallelEmbedding {
    weight: Var,
    comm: TpComm,
}

impl std::fmt::Debug for VocabParallelEmbedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VocabParallelEmbedding")
            .field("weight", &self.weight.dims())
            .field("rank_of_world", &(self.comm.rank(), self.comm.world_size()))
            .finish()
    }
}

impl VocabParallelEmbedding {
    /// Wraps this rank's rows `[vocab / tp, d]`.
    pub fn new(weight: Var, comm: TpComm) -> Result<Self> {
        local_range(weight.as_tensor(), &comm)?;
        Ok(Self { weight, comm })
    }

    /// Takes this rank's rows of the whole embedding `[vocab, d]` with [`shard_vocab`], as a
    /// new `Var`.
    pub fn from_full(wte: &Tensor, comm: TpComm) -> Result<Self> {
        let w = shard_vocab(wte, comm.world_size(), comm.rank())?;
        Self::new(Var::from_tensor(&w)?, comm)
    }

    /// Token ids `[..]` (u32) to embeddings `[.., d]`, replicated (see
    /// [`vocab_parallel_embedding`]).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        vocab_parallel_embedding(ids, self.weight.as_tensor(), &self.comm)
    }

    /// The tied LM head: hidden states `[.., d]` to this rank's logits `[.., vocab / tp]`
    /// (see [`vocab_parallel_logits`]).
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        vocab_parallel_logits(x, self.weight.as_tensor(), &self.comm)
    }

    /// This rank's rows `[vocab / tp, d]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The tensor-parallel group.
    pub fn comm(&self) -> &TpComm {
        &self.comm
    }

    /// The whole vocabulary size.
    pub fn vocab(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0) * self.comm.world_size()
    }

    /// The ids this rank holds.
    pub fn vocab_range(&self) -> Range<usize> {
        let n = self.weight.dims().first().copied().unwrap_or(0);
        self.comm.rank() * n..(self.comm.rank() + 1) * n
    }
}
