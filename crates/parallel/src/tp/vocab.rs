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
use crate::tp::ops::{reduce_from_tp_region, TpComm};
use crate::tp::sequence::reduce_scatter_to_sequence_parallel_region;
use crate::tp::shard::{shard_vocab, vocab_range};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Storage, Tensor, Var, WithDType};
use kiln_comm::{CommElem, CommExt, ReduceOp};
use kiln_kernels::custom_op::contiguous;
use kiln_kernels::pool::run_items;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

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

/// The type rows are reduced in: f32 for f32, f16 and bf16 logits (as the dense kernels do),
/// f64 for f64.
trait Acc:
    CommElem
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
{
    const NEG_INFINITY: Self;
    const ZERO: Self;
    fn exp(self) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

impl Acc for f32 {
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    const ZERO: Self = 0.0;
    /// The vectorising polynomial (relative error below 4e-7), as the dense kernels use.
    #[inline(always)]
    fn exp(self) -> Self {
        kiln_kernels::fastmath::exp_f32(self)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Acc for f64 {
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
}

/// A logits element and the type its rows are reduced in.
trait Logit: WithDType {
    type A: Acc;
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
}

macro_rules! logit {
    ($t:ty, $a:ty, $load:expr, $store:expr) => {
        impl Logit for $t {
            type A = $a;
            #[inline(always)]
            fn load(self) -> $a {
                $load(self)
            }
            #[inline(always)]
            fn store(a: $a) -> Self {
                $store(a)
            }
        }
    };
}
logit!(f32, f32, |x| x, |a| a);
logit!(f64, f64, |x| x, |a| a);
logit!(half::f16, f32, half::f16::to_f32, half::f16::from_f32);
logit!(half::bf16, f32, half::bf16::to_f32, half::bf16::from_f32);

/// Independent accumulators per row: the loops below vectorise over them, and their order of
/// combination is fixed, so a row's result does not depend on the vector width.
const LANES: usize = 16;

/// The maximum of a row (NaN does not win, as in the dense kernel).
fn max_of<T: Logit>(row: &[T]) -> T::A {
    kiln_kernels::simd_dispatch!(max_of_avx512, max_of_impl, (row))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_of_avx512<T: Logit>(row: &[T]) -> T::A {
    max_of_impl(row)
}

#[inline(always)]
fn max_of_impl<T: Logit>(row: &[T]) -> T::A {
    let pick = |m: T::A, e: T::A| if e > m { e } else { m };
    let mut acc = [T::A::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut m = chunks
        .remainder()
        .iter()
        .fold(T::A::NEG_INFINITY, |m, &e| pick(m, e.load()));
    for c in chunks {
        for (a, &e) in acc.iter_mut().zip(c) {
            *a = pick(*a, e.load());
        }
    }
    for a in acc {
        m = pick(m, a);
    }
    m
}

/// `sum_j exp(row_j - m)`.
fn exp_sum<T: Logit>(row: &[T], m: T::A) -> T::A {
    kiln_kernels::simd_dispatch!(exp_sum_avx512, exp_sum_impl, (row, m))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_avx512<T: Logit>(row: &[T], m: T::A) -> T::A {
    exp_sum_impl(row, m)
}

#[inline(always)]
fn exp_sum_impl<T: Logit>(row: &[T], m: T::A) -> T::A {
    let mut acc = [T::A::ZERO; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut s = chunks
        .remainder()
        .iter()
        .fold(T::A::ZERO, |s, &e| s + (e.load() - m).exp());
    for c in chunks {
        for (a, &e) in acc.iter_mut().zip(c) {
            *a = *a + (e.load() - m).exp();
        }
    }
    for a in acc {
        s = s + a;
    }
    s
}

/// Rows of the logits per parallel work item: about 64K elements.
fn rows_per_item(v: usize) -> usize {
    ((1usize << 16) / v.max(1)).max(1)
}

/// `f(first_row, rows, out)` over the `[n, v]` rows of `x` in blocks on candle's worker pool,
/// `out` holding `per_row` elements of each row's result. Every block ran when it returns
/// `true`.
fn par_rows<T: Sync, O: Send>(
    x: &[T],
    v: usize,
    out: &mut [O],
    per_row: usize,
    f: impl Fn(usize, &[T], &mut [O]) + Sync,
) -> bool {
    let rows = rows_per_item(v);
    let items: Vec<_> = x
        .chunks(rows * v)
        .zip(out.chunks_mut(rows * per_row))
        .map(|item| Mutex::new(Some(item)))
        .collect();
    let done = AtomicUsize::new(0);
    run_items(items.len(), rows * v, |i| {
        let item = items[i].lock().ok().and_then(|mut g| g.take());
        if let Some((xs, os)) = item {
            f(i * rows, xs, os);
            done.fetch_add(1, Ordering::Relaxed);
        }
    });
    done.into_inner() == items.len()
}

fn pool_failed() -> candle_core::Error {
    candle_core::Error::msg(format!(
        "{CE_OP}: a block of rows did not run on the worker pool"
    ))
}

/// [`reduced_row_stats`] on a typed slice: the row maxima, then in one buffer the sums of
/// `exp(logit - max)` and the target logits. With one rank each row's maximum and sum come
/// from one pass while the row is in cache; with more the maxima are reduced over the group
/// in between.
fn typed_row_stats<T: Logit>(
    x: &[T],
    v: usize,
    targets: &CeTargets,
    group: Option<&TpComm>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let split = group.filter(|c| c.world_size() > 1);
    let n = x.len() / v;
    let mut max = vec![T::A::NEG_INFINITY; n];
    let mut sums = vec![T::A::ZERO; 2 * n];
    if let Some(comm) = split {
        let ok = par_rows(x, v, &mut max, 1, |_, xs, out| {
            for (row, o) in xs.chunks_exact(v).zip(out) {
                *o = max_of(row);
            }
        });
        if !ok {
            return Err(pool_failed().into());
        }
        comm.all_reduce(&mut max, ReduceOp::Max)?;
        let ok = par_rows(x, v, &mut sums[..n], 1, |r0, xs, out| {
            for (r, (row, o)) in xs.chunks_exact(v).zip(out).enumerate() {
                *o = exp_sum(row, max[r0 + r]);
            }
        });
        if !ok {
            return Err(pool_failed().into());
        }
    } else {
        let mut pairs = vec![(T::A::ZERO, T::A::ZERO); n];
        let ok = par_rows(x, v, &mut pairs, 1, |_, xs, out| {
            for (row, o) in xs.chunks_exact(v).zip(out) {
                let m = max_of(row);
                *o = (m, exp_sum(row, m));
            }
        });
        if !ok {
            return Err(pool_failed().into());
        }
        for (r, (m, s)) in pairs.into_iter().enumerate() {
            max[r] = m;
            sums[r] = s;
        }
    }
    for r in 0..n {
        if let Some(j) = targets.local(r) {
            sums[n + r] = x[r * v + j].load();
        }
    }
    if let Some(comm) = split {
        comm.all_reduce(&mut sums, ReduceOp::Sum)?;
    }
    Ok((
        max.into_iter().map(Acc::to_f64).collect(),
        sums.into_iter().map(Acc::to_f64).collect(),
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
    cross_entropy_over(logits_local, targets, ignore_index, Some(comm))
}

/// [`vocab_parallel_cross_entropy`] over `group` (`None`: the logits hold the whole
/// vocabulary), recorded as one [`VocabCrossEntropy`] node.
fn cross_entropy_over(
    logits_local: &Tensor,
    targets: &Tensor,
    ignore_index: Option<u32>,
    group: Option<&TpComm>,
) -> Result<Tensor> {
    let (logits, stats) = ce_stats(logits_local, targets, ignore_index, group)?;
    Ok(kiln_memory::tape::apply_op1(
        &logits,
        VocabCrossEntropy { stats },
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
    let targets = CeTargets {
        targets: t,
        ignore_index,
        start: rank * v,
        len: v,
    };
    let count = (0..n).filter(|&r| targets.counted(r)).count();
    let logits = logits_local.contiguous()?;
    let (max, sums) = reduced_row_stats(&logits, v, &targets, group)?;
    let lse = max.iter().zip(&sums).map(|(&m, &s)| m + s.ln()).collect();
    let target_logit = sums.get(n..).map(<[f64]>::to_vec).unwrap_or_default();
    let stats = Arc::new(CeStats {
        targets,
        lse,
        target_logit,
        count,
    });
    Ok((logits, stats))
}

/// `logits_local -> mean loss` from the reduced statistics.
struct VocabCrossEntropy {
    stats: Arc<CeStats>,
}

impl CeStats {
    /// The mean loss as a host scalar: f64 for f64 logits, f32 otherwise.
    fn loss(&self, logits: DType) -> CpuStorage {
        let loss = if self.count == 0 {
            0.0
        } else {
            let total: f64 = (0..self.lse.len())
                .filter(|&r| self.targets.counted(r))
                .map(|r| self.lse[r] - self.target_logit[r])
                .sum();
            total / self.count as f64
        };
        match logits {
            DType::F64 => CpuStorage::F64(vec![loss]),
            _ => CpuStorage::F32(vec![loss as f32]),
        }
    }

    /// What the logits gradient is multiplied by: the loss's incoming gradient over the
    /// number of counted rows (0 when none counts).
    fn grad_scale(&self, grad: &Tensor) -> candle_core::Result<f64> {
        let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok(if self.count == 0 {
            0.0
        } else {
            g / self.count as f64
        })
    }
}

impl CustomOp1 for VocabCrossEntropy {
    fn name(&self) -> &'static str {
        "kiln-tp-vocab-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((self.stats.loss(s.dtype()), Shape::from(())))
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
            .storage_from_cpu_storage_owned(self.stats.loss(s.dtype()))?;
        Ok((out, Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let scale = self.stats.grad_scale(grad)?;
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

/// `out_j = scale exp(row_j - lse)`.
fn softmax_row<T: Logit>(row: &[T], out: &mut [MaybeUninit<T>], lse: T::A, scale: T::A) {
    kiln_kernels::simd_dispatch!(softmax_row_avx512, softmax_row_impl, (row, out, lse, scale))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_row_avx512<T: Logit>(
    row: &[T],
    out: &mut [MaybeUninit<T>],
    lse: T::A,
    scale: T::A,
) {
    softmax_row_impl(row, out, lse, scale)
}

#[inline(always)]
fn softmax_row_impl<T: Logit>(row: &[T], out: &mut [MaybeUninit<T>], lse: T::A, scale: T::A) {
    for (o, &e) in out.iter_mut().zip(row) {
        o.write(T::store((e.load() - lse).exp() * scale));
    }
}

/// `scale * (softmax - onehot)` of `[n, v]` rows, zero rows for ignored targets: rows in
/// parallel, every element written once (the output is not zero-filled first).
fn ce_grad<T: Logit>(x: &[T], v: usize, st: &CeStats, scale: f64) -> candle_core::Result<Vec<T>> {
    let len = x.len();
    if len % v != 0 {
        return Err(candle_core::Error::msg(format!(
            "{CE_OP}: {len} logits are not whole rows of {v}"
        )));
    }
    let mut out: Vec<T> = Vec::with_capacity(len);
    let scale_a = T::A::from_f64(scale);
    let ok = par_rows(
        x,
        v,
        &mut out.spare_capacity_mut()[..len],
        v,
        |r0, xs, os| {
            for (r, (row, dr)) in xs.chunks_exact(v).zip(os.chunks_exact_mut(v)).enumerate() {
                let r = r0 + r;
                if !st.targets.counted(r) {
                    for o in dr.iter_mut() {
                        o.write(T::zero());
                    }
                    continue;
                }
                let lse = T::A::from_f64(st.lse[r]);
                softmax_row(row, dr, lse, scale_a);
                if let Some(j) = st.targets.local(r) {
                    let p = (row[j].load() - lse).exp().to_f64();
                    dr[j].write(T::from_f64((p - 1.0) * scale));
                }
            }
        },
    );
    if !ok {
        return Err(pool_failed());
    }
    // SAFETY: every block of rows ran (`ok`) and wrote each element of its rows; the rows
    // cover the first `len` elements (`len` is a whole number of rows).
    unsafe { out.set_len(len) };
    Ok(out)
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
            CpuStorage::F32(x) => CpuStorage::F32(ce_grad(contiguous(x, l, op)?, v, st, scale)?),
            CpuStorage::F16(x) => CpuStorage::F16(ce_grad(contiguous(x, l, op)?, v, st, scale)?),
            CpuStorage::BF16(x) => CpuStorage::BF16(ce_grad(contiguous(x, l, op)?, v, st, scale)?),
            CpuStorage::F64(x) => CpuStorage::F64(ce_grad(contiguous(x, l, op)?, v, st, scale)?),
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
