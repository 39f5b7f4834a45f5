//! The computation of the vocab-parallel cross-entropy (Megatron-LM) and of the LM head fused
//! with it: each rank holds the logits of a slice of the vocabulary, and the loss needs only
//! row statistics reduced over the ranks (each row's maximum, its sum of `exp(logit - max)`,
//! its target logit), never the whole logits. Here are the row kernels, the statistics, and the
//! two ops that compute the loss and its gradient from them; kiln-parallel
//! (`kiln_parallel::tp::vocab_parallel_cross_entropy`) runs the reductions between the passes
//! and applies the ops.
//!
//! Rows are reduced in f32 (f64 for f64 logits), each in [`LANES`] independent accumulators
//! combined in a fixed order, so a row's result does not depend on the vector width; the mean
//! is taken in f64.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use kiln_kernels::ops::vocab::{row_stats, CeStats, CeTargets, VocabCrossEntropy};
//! use std::sync::Arc;
//! // two rows over a vocabulary of 4, the second row's target ignored
//! let x = [0f32, 0., 0., 0., 9., 0., 0., 0.];
//! let targets = CeTargets::new(vec![2, 7], Some(7), 0, 4);
//! let (max, sums) = row_stats(&x, 4, &targets)?;
//! let wide = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
//! let stats = Arc::new(CeStats::new(targets, &wide(max), &wide(sums)));
//! let logits = Tensor::from_slice(&x, (2, 4), &Device::Cpu)?;
//! let loss = logits.apply_op1(VocabCrossEntropy::new(stats))?.to_scalar::<f32>()?;
//! assert!((loss - 4f32.ln()).abs() < 1e-6);
//! # Ok::<(), candle_core::Error>(())
//! ```

use crate::custom_op::{contiguous, Elem, Float};
use crate::dense::{linear_backward, linear_backward_parts, LinearGrads};
use crate::pool::run_items;
use crate::{KernelError, MatmulPrecision};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor, WithDType};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const CE_OP: &str = "vocab_parallel_cross_entropy";

/// Independent accumulators per row: the loops below vectorise over them, and their order of
/// combination is fixed, so a row's result does not depend on the vector width.
pub const LANES: usize = 16;

/// The maximum of a row (NaN does not win, as in the dense kernel).
fn max_of<T: Elem>(row: &[T]) -> T::F {
    crate::simd_dispatch!(max_of_avx512, max_of_impl, (row))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_of_avx512<T: Elem>(row: &[T]) -> T::F {
    max_of_impl(row)
}

#[inline(always)]
fn max_of_impl<T: Elem>(row: &[T]) -> T::F {
    let pick = |m: T::F, e: T::F| if e > m { e } else { m };
    let mut acc = [<T::F as Float>::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut m = chunks
        .remainder()
        .iter()
        .fold(<T::F as Float>::NEG_INFINITY, |m, &e| pick(m, e.load()));
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
fn exp_sum<T: Elem>(row: &[T], m: T::F) -> T::F {
    crate::simd_dispatch!(exp_sum_avx512, exp_sum_impl, (row, m))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_avx512<T: Elem>(row: &[T], m: T::F) -> T::F {
    exp_sum_impl(row, m)
}

#[inline(always)]
fn exp_sum_impl<T: Elem>(row: &[T], m: T::F) -> T::F {
    let zero = <T::F as Float>::ZERO;
    let mut acc = [zero; LANES];
    let chunks = row.chunks_exact(LANES);
    let mut s = chunks
        .remainder()
        .iter()
        .fold(zero, |s, &e| s + (e.load() - m).fast_exp());
    for c in chunks {
        for (a, &e) in acc.iter_mut().zip(c) {
            *a += (e.load() - m).fast_exp();
        }
    }
    for a in acc {
        s += a;
    }
    s
}

/// Rows of the logits per parallel work item: about 64K elements.
fn rows_per_item(v: usize) -> usize {
    ((1usize << 16) / v.max(1)).max(1)
}

/// `f(first_row, rows, out)` over the `[n, v]` rows of `x` in blocks on candle's worker pool,
/// `out` holding `per_row` elements of each row's result; an error where a block did not run.
fn row_blocks<T: Sync, O: Send>(
    x: &[T],
    v: usize,
    out: &mut [O],
    per_row: usize,
    f: impl Fn(usize, &[T], &mut [O]) + Sync,
) -> candle_core::Result<()> {
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
    if done.into_inner() == items.len() {
        Ok(())
    } else {
        Err(KernelError::Internal {
            op: CE_OP,
            reason: "a block of rows did not run on the worker pool".into(),
        }
        .into())
    }
}

/// Whole rows of `v` logits in `x`.
fn rows_of<T>(x: &[T], v: usize) -> candle_core::Result<usize> {
    if v == 0 || x.len() % v != 0 {
        return Err(crate::error::mismatch(
            CE_OP,
            format!("{} logits are not whole rows of {v}", x.len()),
        ));
    }
    Ok(x.len() / v)
}

/// The maximum of each `[n, v]` row of `x`.
pub fn row_maxima<T: Elem>(x: &[T], v: usize) -> candle_core::Result<Vec<T::F>> {
    let n = rows_of(x, v)?;
    let mut max = vec![<T::F as Float>::NEG_INFINITY; n];
    row_blocks(x, v, &mut max, 1, |_, xs, out| {
        for (row, o) in xs.chunks_exact(v).zip(out) {
            *o = max_of(row);
        }
    })?;
    Ok(max)
}

/// `[sum of exp(logit - max) per row | target logit per row]` of the `[n, v]` rows of `x`,
/// given each row's maximum `max` (reduced over the vocabulary's ranks): a row whose target
/// this rank does not hold (or that is ignored) has a target logit of 0, so a sum over the
/// ranks gives each row's.
pub fn row_sums<T: Elem>(
    x: &[T],
    v: usize,
    targets: &CeTargets,
    max: &[T::F],
) -> candle_core::Result<Vec<T::F>> {
    let n = rows_of(x, v)?;
    if max.len() != n || targets.rows() != n {
        return Err(crate::error::mismatch(
            CE_OP,
            format!("{n} rows, {} maxima, {} targets", max.len(), targets.rows()),
        ));
    }
    let mut sums = vec![<T::F as Float>::ZERO; 2 * n];
    row_blocks(x, v, &mut sums[..n], 1, |r0, xs, out| {
        for (r, (row, o)) in xs.chunks_exact(v).zip(out).enumerate() {
            *o = exp_sum(row, max[r0 + r]);
        }
    })?;
    target_logits(x, v, targets, &mut sums[n..]);
    Ok(sums)
}

/// [`row_maxima`] and [`row_sums`] of a rank that holds the whole vocabulary, in one pass
/// (each row's maximum and sum while the row is in cache): the same numbers.
#[allow(clippy::type_complexity)]
pub fn row_stats<T: Elem>(
    x: &[T],
    v: usize,
    targets: &CeTargets,
) -> candle_core::Result<(Vec<T::F>, Vec<T::F>)> {
    let n = rows_of(x, v)?;
    if targets.rows() != n {
        return Err(crate::error::mismatch(
            CE_OP,
            format!("{n} rows, {} targets", targets.rows()),
        ));
    }
    let zero = <T::F as Float>::ZERO;
    let mut pairs = vec![(zero, zero); n];
    row_blocks(x, v, &mut pairs, 1, |_, xs, out| {
        for (row, o) in xs.chunks_exact(v).zip(out) {
            let m = max_of(row);
            *o = (m, exp_sum(row, m));
        }
    })?;
    let mut max = Vec::with_capacity(n);
    let mut sums = vec![zero; 2 * n];
    for ((m, s), o) in pairs.into_iter().zip(&mut sums) {
        max.push(m);
        *o = s;
    }
    target_logits(x, v, targets, &mut sums[n..]);
    Ok((max, sums))
}

/// Each row's target logit where this rank holds it (`out` is zero elsewhere).
fn target_logits<T: Elem>(x: &[T], v: usize, targets: &CeTargets, out: &mut [T::F]) {
    for (r, o) in out.iter_mut().enumerate() {
        if let Some(j) = targets.local(r) {
            *o = x[r * v + j].load();
        }
    }
}

/// The targets of the rows and the slice of the vocabulary this rank's logits cover.
#[derive(Debug, Clone)]
pub struct CeTargets {
    targets: Vec<u32>,
    ignore_index: Option<u32>,
    start: usize,
    len: usize,
}

impl CeTargets {
    /// Row `r`'s target `targets[r]` (an id in the whole vocabulary; `ignore_index` leaves the
    /// row out of the mean), for logits holding the ids `start .. start + len`.
    pub fn new(targets: Vec<u32>, ignore_index: Option<u32>, start: usize, len: usize) -> Self {
        Self {
            targets,
            ignore_index,
            start,
            len,
        }
    }

    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.targets.len()
    }

    /// Whether row `r`'s target counts (is not the ignore index).
    pub fn counted(&self, r: usize) -> bool {
        Some(self.targets[r]) != self.ignore_index
    }

    /// The local column of row `r`'s target, when it counts and this rank holds it.
    pub fn local(&self, r: usize) -> Option<usize> {
        let t = self.targets[r] as usize;
        (self.counted(r) && (self.start..self.start + self.len).contains(&t))
            .then(|| t - self.start)
    }
}

/// What the forward reduced over the group and the backward reuses (no communication there).
#[derive(Debug)]
pub struct CeStats {
    targets: CeTargets,
    /// Log-sum-exp of each whole row.
    lse: Vec<f64>,
    /// The target logit of each row.
    target_logit: Vec<f64>,
    /// Rows whose target counts.
    count: usize,
}

impl CeStats {
    /// The statistics of the rows from each row's maximum `max` and `sums` `[sum of exp(logit -
    /// max) | target logit]`, both reduced over the vocabulary's ranks ([`row_maxima`],
    /// [`row_sums`]).
    pub fn new(targets: CeTargets, max: &[f64], sums: &[f64]) -> Self {
        let n = targets.rows();
        let count = (0..n).filter(|&r| targets.counted(r)).count();
        let lse = max.iter().zip(sums).map(|(&m, &s)| m + s.ln()).collect();
        let target_logit = sums.get(n..).map(<[f64]>::to_vec).unwrap_or_default();
        Self {
            targets,
            lse,
            target_logit,
            count,
        }
    }

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

/// `logits_local -> mean loss` from the reduced statistics (the logits are not read again): a
/// scalar on the logits' device, f64 for f64 logits and f32 otherwise. Backward, with no
/// communication: `(softmax_local - onehot_local) / count` times the incoming gradient, zero
/// rows for ignored targets (on CUDA the same host code, the logits staged through host
/// memory).
#[derive(Debug, Clone)]
pub struct VocabCrossEntropy {
    stats: Arc<CeStats>,
}

impl VocabCrossEntropy {
    /// The op over the logits the statistics were taken of.
    pub fn new(stats: Arc<CeStats>) -> Self {
        Self { stats }
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
fn softmax_row<T: Elem>(row: &[T], out: &mut [MaybeUninit<T>], lse: T::F, scale: T::F) {
    crate::simd_dispatch!(softmax_row_avx512, softmax_row_impl, (row, out, lse, scale))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_row_avx512<T: Elem>(
    row: &[T],
    out: &mut [MaybeUninit<T>],
    lse: T::F,
    scale: T::F,
) {
    softmax_row_impl(row, out, lse, scale)
}

#[inline(always)]
fn softmax_row_impl<T: Elem>(row: &[T], out: &mut [MaybeUninit<T>], lse: T::F, scale: T::F) {
    for (o, &e) in out.iter_mut().zip(row) {
        o.write(T::store((e.load() - lse).fast_exp() * scale));
    }
}

/// `scale * (softmax - onehot)` of `[n, v]` rows, zero rows for ignored targets: rows in
/// parallel, every element written once (the output is not zero-filled first).
fn ce_grad<T: Elem + WithDType>(
    x: &[T],
    v: usize,
    st: &CeStats,
    scale: f64,
) -> candle_core::Result<Vec<T>> {
    let len = x.len();
    rows_of(x, v)?;
    let mut out: Vec<T> = Vec::with_capacity(len);
    let scale_a = <T::F as Float>::from_f64(scale);
    row_blocks(
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
                let lse = <T::F as Float>::from_f64(st.lse[r]);
                softmax_row(row, dr, lse, scale_a);
                if let Some(j) = st.targets.local(r) {
                    let p = (row[j].load() - lse).fast_exp().to_f64();
                    dr[j].write(T::from_f64((p - 1.0) * scale));
                }
            }
        },
    )?;
    // SAFETY: every block of rows ran (`row_blocks` returned Ok) and wrote each element of its
    // rows; the rows cover the first `len` elements (`len` is a whole number of rows).
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
            return Err(crate::error::mismatch(
                op,
                format!(
                    "logits {:?} do not match the forward's {} rows of {v}",
                    l.dims(),
                    self.stats.lse.len()
                ),
            ));
        }
        let (st, scale) = (&*self.stats, self.scale);
        let out =
            crate::map_float_storage!(s, op, |x| ce_grad(contiguous(x, l, op)?, v, st, scale)?);
        Ok((out, l.shape().clone()))
    }

    /// The same host logic as `cpu_fwd`, the logits staged through host memory.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::staged_fwd(self, s, l)
    }
}

/// `(x [n, d], w [vocab_local, d]) -> mean loss`: the LM head's product `x w^T` and the
/// cross-entropy of its logits as one graph node, holding the forward's logits (made with
/// [`crate::dense::LinearNoBias`] at `precision`) and their statistics. The loss and the
/// gradients of `x` and `w` are bitwise those of the two ops, but the backward hands the logits
/// gradient straight to the head's two products: no zero-filled gradient buffer of the logits'
/// size, no addition into it. CPU tensors.
#[derive(Debug, Clone)]
pub struct HeadCrossEntropy {
    stats: Arc<CeStats>,
    logits: Tensor,
    precision: MatmulPrecision,
}

impl HeadCrossEntropy {
    /// The op over `logits`, the head's product at `precision`, whose statistics are `stats`.
    pub fn new(stats: Arc<CeStats>, logits: Tensor, precision: MatmulPrecision) -> Self {
        Self {
            stats,
            logits,
            precision,
        }
    }
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
        let (dx, dw, _) = linear_backward(x, w, &self.logits_grad(grad)?, false, self.precision)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl HeadCrossEntropy {
    /// The gradient of the logits for the loss's gradient `grad`: softmax minus the one-hot
    /// targets, scaled (what the op's backward hands to the head's two products).
    pub fn logits_grad(&self, grad: &Tensor) -> candle_core::Result<Tensor> {
        self.logits.apply_op1_no_bwd(&VocabCrossEntropyBwd {
            stats: self.stats.clone(),
            scale: self.stats.grad_scale(grad)?,
        })
    }

    /// The gradients of `x` and `w` that `want` asks for (its `bias` is ignored) from the
    /// logits' gradient [`HeadCrossEntropy::logits_grad`] gave, each bitwise what the op's
    /// backward gives: a zero-bubble schedule computes `dx` first and `dw` later.
    pub fn backward_parts(
        &self,
        x: &Tensor,
        w: &Tensor,
        dlogits: &Tensor,
        want: LinearGrads,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let want = LinearGrads {
            bias: false,
            ..want
        };
        let (dx, dw, _) = linear_backward_parts(x, w, dlogits, want, self.precision)?;
        Ok((dx, dw))
    }
}
