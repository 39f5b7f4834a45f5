//! The vocab-parallel token embedding, its tied LM head and the vocab-parallel cross-entropy
//! (Megatron-LM): each rank holds `vocab / tp` rows of the embedding and produces the logits
//! of its own slice of the vocabulary; the loss is computed without gathering the logits.
//!
//! On CUDA (feature `cuda`) the cross-entropy stages through host memory until a device
//! communicator (NCCL) exists: the logits are copied to the host for the row statistics the
//! group reduces and for the gradient, which runs the same host code as on the CPU and is
//! copied back to the logits' device; the loss itself is written straight to the device.

use crate::error::{ParallelError, Result};
use crate::tp::linear::column_parallel_linear;
use crate::tp::ops::{contiguous, reduce_from_tp_region, TpComm};
use crate::tp::shard::{shard_vocab, vocab_range};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Storage, Tensor, Var, WithDType};
use kiln_comm::{CommElem, CommExt, ReduceOp};
use std::ops::Range;
use std::sync::Arc;

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
    let (range, vocab) = local_range(wte_local, comm)?;
    let (_, d) = wte_local.dims2()?;
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
    let mut dims = ids.dims().to_vec();
    dims.push(d);
    Ok(reduce_from_tp_region(&rows, comm)?.reshape(dims)?)
}

/// The LM head tied to a vocab-parallel embedding: `f(x) wte_local^T`, hidden states
/// `[.., d]` (replicated) to this rank's logits `[.., vocab / tp]`, computing in `x`'s dtype.
/// Feed them to [`vocab_parallel_cross_entropy`]; the input gradient is summed over the group.
pub fn vocab_parallel_logits(x: &Tensor, wte_local: &Tensor, comm: &TpComm) -> Result<Tensor> {
    column_parallel_linear(x, wte_local, None, comm)
}

const CE_OP: &str = "vocab_parallel_cross_entropy";

/// The type rows are reduced in: f32 for f32, f16 and bf16 logits (as the dense kernels do),
/// f64 for f64.
trait Acc:
    CommElem + PartialOrd + std::ops::Sub<Output = Self> + std::ops::Mul<Output = Self> + std::iter::Sum
{
    const NEG_INFINITY: Self;
    const ZERO: Self;
    fn of<T: WithDType>(t: T) -> Self;
    fn exp(self) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

macro_rules! acc {
    ($t:ty) => {
        impl Acc for $t {
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const ZERO: Self = 0.0;
            #[inline]
            fn of<T: WithDType>(t: T) -> Self {
                t.to_f64() as $t
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn to_f64(self) -> f64 {
                f64::from(self)
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
        }
    };
}
acc!(f32);
acc!(f64);

/// Per-row maximum of `[n, v]` rows (NaN does not win, as in the dense kernel).
fn row_max<T: WithDType, A: Acc>(x: &[T], v: usize) -> Vec<A> {
    x.chunks_exact(v)
        .map(|row| {
            row.iter().fold(A::NEG_INFINITY, |m, &e| {
                let e = A::of(e);
                if e > m {
                    e
                } else {
                    m
                }
            })
        })
        .collect()
}

/// `[sum_j exp(x_j - max) for each row, then the target logit of each row (0 where the
/// target is ignored or held by another rank)]`.
fn row_sums<T: WithDType, A: Acc>(x: &[T], v: usize, max: &[A], t: &CeTargets) -> Vec<A> {
    let n = max.len();
    let mut out = vec![A::ZERO; 2 * n];
    for (r, (row, &m)) in x.chunks_exact(v).zip(max).enumerate() {
        out[r] = row.iter().map(|&e| (A::of(e) - m).exp()).sum();
        if let Some(j) = t.local(r) {
            out[n + r] = A::of(row[j]);
        }
    }
    out
}

/// [`reduced_row_stats`] on a typed slice, reducing in `A`.
fn typed_row_stats<T: WithDType, A: Acc>(
    x: &[T],
    v: usize,
    targets: &CeTargets,
    comm: &TpComm,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let world = comm.world_size();
    let mut max: Vec<A> = row_max(x, v);
    if world > 1 {
        comm.all_reduce(&mut max, ReduceOp::Max)?;
    }
    let mut sums = row_sums(x, v, &max, targets);
    if world > 1 {
        comm.all_reduce(&mut sums, ReduceOp::Sum)?;
    }
    Ok((
        max.into_iter().map(A::to_f64).collect(),
        sums.into_iter().map(A::to_f64).collect(),
    ))
}

/// The row maxima and `[sum of exp(logit - max) per row | target logit per row]` of the
/// whole logits, reduced over the group.
fn reduced_row_stats(
    logits: &Tensor,
    v: usize,
    targets: &CeTargets,
    comm: &TpComm,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (storage, layout) = logits.storage_and_layout();
    #[cfg(feature = "cuda")]
    let staged;
    let (cpu, layout) = match &*storage {
        Storage::Cpu(cpu) => (cpu, layout.clone()),
        #[cfg(feature = "cuda")]
        Storage::Cuda(cuda) => {
            staged = crate::tp::staging::to_host(cuda, layout, CE_OP)?;
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
            typed_row_stats::<_, f32>(contiguous(x, layout, CE_OP).map_err(c)?, v, targets, comm)
        }
        CpuStorage::F16(x) => {
            typed_row_stats::<_, f32>(contiguous(x, layout, CE_OP).map_err(c)?, v, targets, comm)
        }
        CpuStorage::BF16(x) => {
            typed_row_stats::<_, f32>(contiguous(x, layout, CE_OP).map_err(c)?, v, targets, comm)
        }
        CpuStorage::F64(x) => {
            typed_row_stats::<_, f64>(contiguous(x, layout, CE_OP).map_err(c)?, v, targets, comm)
        }
        other => Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), CE_OP).into()),
    }
}

/// The targets of the rows and this rank's slice of the vocabulary.
struct CeTargets {
    targets: Vec<u32>,
    ignore_index: Option<u32>,
    start: usize,
    len: usize,
}

impl CeTargets {
    fn counted(&self, r: usize) -> bool {
        Some(self.targets[r]) != self.ignore_index
    }

    /// The local column of row `r`'s target, when it counts and this rank holds it.
    fn local(&self, r: usize) -> Option<usize> {
        let t = self.targets[r] as usize;
        (self.counted(r) && (self.start..self.start + self.len).contains(&t))
            .then(|| t - self.start)
    }
}

/// What the forward reduced over the group and the backward reuses (no communication there).
struct CeStats {
    targets: CeTargets,
    /// Log-sum-exp of each whole row.
    lse: Vec<f64>,
    /// The target logit of each row.
    target_logit: Vec<f64>,
    /// Rows whose target counts.
    count: usize,
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
    let (world, rank) = (comm.world_size(), comm.rank());
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
    let targets = CeTargets {
        targets: t,
        ignore_index,
        start: rank * v,
        len: v,
    };
    let count = (0..n).filter(|&r| targets.counted(r)).count();
    let logits = logits_local.contiguous()?;
    let (max, sums) = reduced_row_stats(&logits, v, &targets, comm)?;
    let lse = max.iter().zip(&sums).map(|(&m, &s)| m + s.ln()).collect();
    let target_logit = sums.get(n..).map(<[f64]>::to_vec).unwrap_or_default();
    let stats = Arc::new(CeStats {
        targets,
        lse,
        target_logit,
        count,
    });
    Ok(logits.apply_op1(VocabCrossEntropy { stats })?)
}

/// `logits_local -> mean loss` from the reduced statistics.
struct VocabCrossEntropy {
    stats: Arc<CeStats>,
}

impl VocabCrossEntropy {
    /// The mean loss as a host scalar: f64 for f64 logits, f32 otherwise.
    fn loss(&self, logits: DType) -> CpuStorage {
        let st = &self.stats;
        let loss = if st.count == 0 {
            0.0
        } else {
            let total: f64 = (0..st.lse.len())
                .filter(|&r| st.targets.counted(r))
                .map(|r| st.lse[r] - st.target_logit[r])
                .sum();
            total / st.count as f64
        };
        match logits {
            DType::F64 => CpuStorage::F64(vec![loss]),
            _ => CpuStorage::F32(vec![loss as f32]),
        }
    }
}

impl CustomOp1 for VocabCrossEntropy {
    fn name(&self) -> &'static str {
        "kiln-tp-vocab-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((self.loss(s.dtype()), Shape::from(())))
    }

    /// The loss computed on the host from the reduced statistics (the logits are not read
    /// again), written to a new scalar on the logits' device.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendDevice;
        let out = s
            .device()
            .storage_from_cpu_storage_owned(self.loss(s.dtype()))?;
        Ok((out, Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let scale = if self.stats.count == 0 {
            0.0
        } else {
            g / self.stats.count as f64
        };
        let dx = logits
            .contiguous()?
            .apply_op1_no_bwd(&VocabCrossEntropyBwd {
                stats: self.stats.clone(),
                scale,
            })?;
        Ok(Some(dx))
    }
}

/// `logits_local -> scale * (softmax_local - onehot_local)`, zero rows for ignored targets.
struct VocabCrossEntropyBwd {
    stats: Arc<CeStats>,
    scale: f64,
}

fn ce_grad<T: WithDType, A: Acc>(x: &[T], v: usize, st: &CeStats, scale: f64) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    let scale_a = A::from_f64(scale);
    for (r, (row, dr)) in x.chunks_exact(v).zip(out.chunks_exact_mut(v)).enumerate() {
        if !st.targets.counted(r) {
            continue;
        }
        let lse = A::from_f64(st.lse[r]);
        for (o, &e) in dr.iter_mut().zip(row) {
            *o = T::from_f64(((A::of(e) - lse).exp() * scale_a).to_f64());
        }
        if let Some(j) = st.targets.local(r) {
            let p = (A::of(row[j]) - lse).exp().to_f64();
            dr[j] = T::from_f64((p - 1.0) * scale);
        }
    }
    out
}

impl CustomOp1 for VocabCrossEntropyBwd {
    fn name(&self) -> &'static str {
        "kiln-tp-vocab-cross-entropy-bwd"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let v = self.stats.targets.len;
        if l.shape().elem_count() != v * self.stats.lse.len() {
            return Err(candle_core::Error::msg(format!(
                "{op}: logits {:?} do not match the forward's {} rows of {v}",
                l.dims(),
                self.stats.lse.len()
            )));
        }
        let (st, scale) = (&*self.stats, self.scale);
        let out = match s {
            CpuStorage::F32(x) => {
                CpuStorage::F32(ce_grad::<_, f32>(contiguous(x, l, op)?, v, st, scale))
            }
            CpuStorage::F16(x) => {
                CpuStorage::F16(ce_grad::<_, f32>(contiguous(x, l, op)?, v, st, scale))
            }
            CpuStorage::BF16(x) => {
                CpuStorage::BF16(ce_grad::<_, f32>(contiguous(x, l, op)?, v, st, scale))
            }
            CpuStorage::F64(x) => {
                CpuStorage::F64(ce_grad::<_, f64>(contiguous(x, l, op)?, v, st, scale))
            }
            other => return Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), op)),
        };
        Ok((out, l.shape().clone()))
    }

    /// The same host logic as `cpu_fwd`, the logits staged through host memory (see the
    /// module docs).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::tp::staging::staged_fwd(self, s, l)
    }
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
