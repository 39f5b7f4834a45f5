//! The helpers every CPU side of a candle custom op here (and the tensor-parallel collectives of
//! kiln-parallel) is written with: element types and the arithmetic type they compute in
//! ([`Elem`], [`Float`]), contiguous access ([`contiguous`], [`same_type`]), a match over the
//! float storages ([`with_float_storage!`](crate::with_float_storage),
//! [`map_float_storage!`](crate::map_float_storage)), and row-parallel loops on candle's own
//! worker pool ([`par_rows`], [`par_each`], [`output_vec`]).
//!
//! ```
//! use candle_core::{CpuStorage, Layout};
//! use kiln_kernels::custom_op::{contiguous, Elem};
//! fn doubled<T: Elem>(x: &[T]) -> Vec<T> {
//!     x.iter().map(|&e| T::store(e.load() + e.load())).collect()
//! }
//! // the CPU forward of a "double it" op, for every float dtype
//! fn double(s: &CpuStorage, l: &Layout) -> candle_core::Result<CpuStorage> {
//!     kiln_kernels::with_float_storage!(s, "double", |v| {
//!         Ok(Elem::into_storage(doubled(contiguous(v, l, "double")?)))
//!     })
//! }
//! let out = double(&CpuStorage::F32(vec![1.0, -2.5]), &Layout::contiguous(2))?;
//! assert!(matches!(out, CpuStorage::F32(v) if v == [2.0, -5.0]));
//! # Ok::<(), candle_core::Error>(())
//! ```

use crate::fastmath::exp_f32;
use crate::KernelError;
use candle_core::{CpuStorage, DType, Layout};
use half::{bf16, f16};
use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};
use std::sync::Mutex;

/// The arithmetic type kernels compute in: f32 for f32/f16/bf16 storage, f64 for f64.
pub trait Float:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + 'static
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// Minus infinity.
    const NEG_INFINITY: Self;
    /// `v` rounded to this type.
    fn from_f64(v: f64) -> Self;
    /// This value, exactly, as f64.
    fn to_f64(self) -> f64;
    /// The natural logarithm.
    fn ln(self) -> Self;
    /// The square root.
    fn sqrt(self) -> Self;
    /// The larger of the two (the other where one is NaN).
    fn max(self, other: Self) -> Self;
    /// `self * a + b` with one rounding (the standard library's `mul_add`): a single
    /// instruction only where the caller was compiled with FMA, a slow library call elsewhere.
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// `exp`, through a branch-free polynomial for f32 (about 2 ulp, auto-vectorisable),
    /// the standard library's for f64.
    fn fast_exp(self) -> Self;
    /// `tanh` as `1 - 2 / (exp(2x) + 1)` with [`Float::fast_exp`] for f32 (absolute error
    /// about 1e-7), the standard library's for f64.
    fn fast_tanh(self) -> Self;
}

macro_rules! impl_float {
    ($t:ty, $fexp:expr, $ftanh:expr) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            #[inline(always)]
            fn mul_add(self, a: Self, b: Self) -> Self {
                <$t>::mul_add(self, a, b)
            }
            #[inline(always)]
            fn fast_exp(self) -> Self {
                $fexp(self)
            }
            #[inline(always)]
            fn fast_tanh(self) -> Self {
                $ftanh(self)
            }
        }
    };
}
impl_float!(f32, exp_f32, |x: f32| 1.0 - 2.0 / (exp_f32(2.0 * x) + 1.0));
impl_float!(f64, f64::exp, f64::tanh);

/// A storage element type the fused kernels accept: f32, f64, f16, bf16.
pub trait Elem: Copy + Send + Sync + 'static {
    /// The type arithmetic happens in.
    type F: Float;
    /// The value, widened to the arithmetic type.
    fn load(self) -> Self::F;
    /// `v` rounded to the storage type (to nearest even).
    fn store(v: Self::F) -> Self;
    /// Candle storage holding `v`.
    fn into_storage(v: Vec<Self>) -> CpuStorage;
}

impl Elem for f32 {
    type F = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        v
    }
    fn into_storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::F32(v)
    }
}
impl Elem for f64 {
    type F = f64;
    #[inline(always)]
    fn load(self) -> f64 {
        self
    }
    #[inline(always)]
    fn store(v: f64) -> Self {
        v
    }
    fn into_storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::F64(v)
    }
}
impl Elem for f16 {
    type F = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn into_storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::F16(v)
    }
}
impl Elem for bf16 {
    type F = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn into_storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::BF16(v)
    }
}

/// The float dtypes the fused ops accept, as error messages name them.
pub const FLOAT_DTYPES: &str = "f32, f64, f16 or bf16";

/// Whether the fused ops accept `dtype` ([`FLOAT_DTYPES`]).
pub fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// The contiguous elements `layout` addresses in `data`; a strided layout is an error naming
/// `op` ([`KernelError::NotContiguous`]).
pub fn contiguous<'a, T>(
    data: &'a [T],
    layout: &Layout,
    op: &'static str,
) -> candle_core::Result<&'a [T]> {
    layout
        .contiguous_offsets()
        .and_then(|(a, b)| data.get(a..b))
        .ok_or_else(|| KernelError::NotContiguous { op, what: "input" }.into())
}

/// Runs a generic kernel body for each float variant of a `CpuStorage` (f32, f64, f16,
/// bf16), binding the slice to `$v`; the body's value is the macro's, and another dtype is a
/// candle `UnsupportedDTypeForOp` error naming `$op`.
#[macro_export]
macro_rules! with_float_storage {
    ($storage:expr, $op:expr, |$v:ident| $body:expr) => {
        match $storage {
            $crate::__private::candle_core::CpuStorage::F32($v) => $body,
            $crate::__private::candle_core::CpuStorage::F64($v) => $body,
            $crate::__private::candle_core::CpuStorage::F16($v) => $body,
            $crate::__private::candle_core::CpuStorage::BF16($v) => $body,
            other => Err(
                $crate::__private::candle_core::Error::UnsupportedDTypeForOp(
                    $crate::__private::candle_core::backend::BackendStorage::dtype(other),
                    $op,
                ),
            ),
        }
    };
}

/// Runs `$body` on the typed vector of a float `CpuStorage` and wraps the vector it evaluates
/// to back into storage of the same dtype; another dtype returns (from the enclosing
/// function) a candle `UnsupportedDTypeForOp` error naming `$op`.
#[macro_export]
macro_rules! map_float_storage {
    ($s:expr, $op:expr, |$v:ident| $body:expr) => {
        match $s {
            $crate::__private::candle_core::CpuStorage::F32($v) => {
                $crate::__private::candle_core::CpuStorage::F32($body)
            }
            $crate::__private::candle_core::CpuStorage::F64($v) => {
                $crate::__private::candle_core::CpuStorage::F64($body)
            }
            $crate::__private::candle_core::CpuStorage::F16($v) => {
                $crate::__private::candle_core::CpuStorage::F16($body)
            }
            $crate::__private::candle_core::CpuStorage::BF16($v) => {
                $crate::__private::candle_core::CpuStorage::BF16($body)
            }
            other => {
                return Err(
                    $crate::__private::candle_core::Error::UnsupportedDTypeForOp(
                        $crate::__private::candle_core::backend::BackendStorage::dtype(other),
                        $op,
                    ),
                )
            }
        }
    };
}

/// The slice of `storage`, which must hold the same element type as `_like`.
pub fn same_type<'a, T: Elem>(
    _like: &[T],
    storage: &'a CpuStorage,
    op: &'static str,
) -> candle_core::Result<&'a [T]> {
    let any: &dyn std::any::Any = match storage {
        CpuStorage::F32(v) => v,
        CpuStorage::F64(v) => v,
        CpuStorage::F16(v) => v,
        CpuStorage::BF16(v) => v,
        other => {
            return Err(candle_core::Error::UnsupportedDTypeForOp(
                candle_core::backend::BackendStorage::dtype(other),
                op,
            ))
        }
    };
    any.downcast_ref::<Vec<T>>()
        .map(|v| v.as_slice())
        .ok_or_else(|| {
            KernelError::Mismatch {
                op,
                reason: "all float inputs must share one dtype".into(),
            }
            .into()
        })
}

/// Work (in element-operations) below which a kernel runs on the calling thread.
const PAR_MIN_WORK: usize = 64 * 1024;
/// Target work per chunk.
const CHUNK_WORK: usize = 32 * 1024;

/// Splits `out` (rows of `row_len`) into chunks of whole rows, runs `f(first_row, chunk)` on
/// each, on candle's worker pool when the total work is large, and returns the results in
/// chunk order. The chunking depends only on the sizes, never on the thread count, so any
/// reduction over the results is deterministic.
pub fn par_rows<T, R, F>(
    out: &mut [T],
    row_len: usize,
    work_per_row: usize,
    f: F,
) -> candle_core::Result<Vec<R>>
where
    T: Send,
    R: Send,
    F: Fn(usize, &mut [T]) -> R + Sync,
{
    if row_len == 0 || out.is_empty() {
        return Ok(Vec::new());
    }
    let n_rows = out.len() / row_len;
    let work_per_row = work_per_row.max(1);
    let rows_per_chunk = (CHUNK_WORK / work_per_row).clamp(1, n_rows.max(1));
    let n_chunks = n_rows.div_ceil(rows_per_chunk);
    if n_chunks <= 1 || n_rows * work_per_row < PAR_MIN_WORK {
        return Ok(out
            .chunks_mut(rows_per_chunk * row_len)
            .enumerate()
            .map(|(c, chunk)| f(c * rows_per_chunk, chunk))
            .collect());
    }
    let chunks: Vec<Mutex<Option<&mut [T]>>> = out
        .chunks_mut(rows_per_chunk * row_len)
        .map(|c| Mutex::new(Some(c)))
        .collect();
    let results: Vec<Mutex<Option<R>>> = (0..chunks.len()).map(|_| Mutex::new(None)).collect();
    let run = |c: usize| {
        let slice = chunks[c].lock().ok().and_then(|mut g| g.take());
        if let Some(slice) = slice {
            let r = f(c * rows_per_chunk, slice);
            if let Ok(mut g) = results[c].lock() {
                *g = Some(r);
            }
        }
    };
    candle_core::utils::barrier_pool().execute_chunked(chunks.len(), |range| range.for_each(run));
    results
        .into_iter()
        .map(|m| m.into_inner().ok().flatten())
        .collect::<Option<Vec<R>>>()
        .ok_or_else(|| {
            KernelError::Internal {
                op: "fused kernel",
                reason: "a worker chunk did not complete".into(),
            }
            .into()
        })
}

/// Runs `f(state, index, item)` once for each item, on candle's worker pool when there are
/// several items and the total work (in element-operations) is large; each run of consecutive
/// items on one worker shares one `state` from `init` (scratch buffers). For kernels whose
/// tasks write several disjoint outputs: the items hold each task's `&mut` slices.
pub fn par_each<I, S, F>(
    items: Vec<I>,
    work_per_item: usize,
    init: impl Fn() -> S + Sync,
    f: F,
) -> candle_core::Result<()>
where
    I: Send,
    F: Fn(&mut S, usize, I) + Sync,
{
    let n = items.len();
    if n <= 1 || n * work_per_item.max(1) < PAR_MIN_WORK {
        let mut state = init();
        for (i, item) in items.into_iter().enumerate() {
            f(&mut state, i, item);
        }
        return Ok(());
    }
    let slots: Vec<Mutex<Option<I>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
    let done = std::sync::atomic::AtomicUsize::new(0);
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let mut state = init();
        for i in range {
            if let Some(item) = slots[i].lock().ok().and_then(|mut g| g.take()) {
                f(&mut state, i, item);
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    if done.into_inner() == n {
        Ok(())
    } else {
        Err(KernelError::Internal {
            op: "fused kernel",
            reason: "a worker task did not complete".into(),
        }
        .into())
    }
}

/// A `Vec` of `n` elements to be fully overwritten by a kernel.
pub fn output_vec<T: Elem>(n: usize) -> Vec<T> {
    let zero = T::store(<T::F as Float>::ZERO);
    if n < PAR_MIN_WORK {
        return vec![zero; n];
    }
    // a large buffer is zeroed in parallel blocks: a serial fill held up the worker pool
    let mut out = Vec::with_capacity(n);
    let filled = par_rows(&mut out.spare_capacity_mut()[..n], 1, 1, |_, block| {
        for v in block {
            v.write(zero);
        }
    });
    if filled.is_err() {
        return vec![zero; n];
    }
    // SAFETY: `par_rows` returned Ok, so every block ran and wrote each of its elements; the
    // blocks cover the first `n` elements, inside the capacity
    unsafe { out.set_len(n) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fast_tanh` against f64 (its `exp` is tested in `crate::fastmath`).
    #[test]
    fn fast_tanh_against_f64() {
        let mut worst = 0f64;
        for i in -87_000..88_000 {
            let x = i as f32 * 1e-3;
            let t = Float::fast_tanh(x) as f64;
            worst = worst.max((t - (x as f64).tanh()).abs());
        }
        assert!(worst < 3e-7, "tanh absolute error {worst}");
        assert_eq!(Float::fast_tanh(0f32), 0.0);
    }
}
