//! The products of the linear op, for every float type: gemm's kernels for f64 and f16, kiln's
//! (`crate::cpu_gemm`) for f32 and bf16 where the CPU has AVX-512, at a [`MatmulPrecision`];
//! a product into a new buffer is written once where the kernel can, with no zero fill first.

use super::{MatmulPrecision, OP};
use crate::cpu_gemm::{self, Operands, Rounding};
use crate::error::mismatch;
use candle_core::{CpuStorage, WithDType};
use half::{bf16, f16};

/// A matrix operand: a pointer's worth of elements with its row and column strides.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

/// The element types gemm multiplies natively.
trait GemmElem: WithDType + Copy + 'static {
    /// `dst[m, n] (= or +=) sum_k a[m, k] b[k, n]`, `dst` row-major with `n` columns.
    fn gemm(
        dst: &mut [Self],
        accumulate: bool,
        m: usize,
        n: usize,
        k: usize,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
    );
}

fn parallelism() -> gemm::Parallelism {
    // asked once: `get_num_threads` parses `/proc/cpuinfo` on every call
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let threads = *THREADS.get_or_init(candle_core::utils::get_num_threads);
    if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    }
}

macro_rules! gemm_elem {
    ($t:ty, $zero:expr, $one:expr) => {
        impl GemmElem for $t {
            fn gemm(
                dst: &mut [Self],
                accumulate: bool,
                m: usize,
                n: usize,
                k: usize,
                a: Mat<'_, Self>,
                b: Mat<'_, Self>,
            ) {
                debug_assert!(dst.len() >= m * n);
                if m == 0 || n == 0 {
                    return;
                }
                if k == 0 {
                    if !accumulate {
                        dst[..m * n].fill($zero);
                    }
                    return;
                }
                // SAFETY: `dst` holds `m * n` elements written with row stride `n`; `a` and
                // `b` were checked by the callers to cover `m x k` and `k x n` elements at
                // their strides (the largest offset read is `(m-1) rs + (k-1) cs` < len).
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        dst.as_mut_ptr(),
                        1,
                        n as isize,
                        accumulate,
                        a.data.as_ptr(),
                        a.cs as isize,
                        a.rs as isize,
                        b.data.as_ptr(),
                        b.cs as isize,
                        b.rs as isize,
                        $one,
                        $one,
                        false,
                        false,
                        false,
                        parallelism(),
                    )
                }
            }
        }
    };
}
gemm_elem!(f32, 0f32, 1f32);
gemm_elem!(f64, 0f64, 1f64);
gemm_elem!(f16, f16::ZERO, f16::ONE);

/// Whether `m` covers `rows x cols` elements at its strides.
pub(super) fn covers<T>(m: &Mat<'_, T>, rows: usize, cols: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * m.rs + (cols - 1) * m.cs < m.data.len()
}

/// `dst = a b` (or `dst += a b` with `accumulate`) for any of kiln's float types: gemm's kernel
/// for f32, f64 and f16, [`bf16_gemm`] for bf16.
pub(crate) fn matmul_into<T: DenseElem>(
    dst: &mut [T],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
) -> candle_core::Result<()> {
    matmul_prec(dst, accumulate, (m, n, k), a, b, MatmulPrecision::Highest)
}

/// [`matmul_into`] at `precision`: f32 operands rounded to bf16 and multiplied by the bf16
/// kernel into the f32 `dst`, or rounded to f16 and multiplied by the f32 kernel.
pub(super) fn matmul_prec<T: DenseElem>(
    dst: &mut [T],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    precision: MatmulPrecision,
) -> candle_core::Result<()> {
    if dst.len() < m * n || !covers(&a, m, k) || !covers(&b, k, n) {
        return Err(mismatch(
            OP,
            format!("operands do not cover a {m} x {k} by {k} x {n} product"),
        ));
    }
    match precision {
        MatmulPrecision::Highest => {}
        MatmulPrecision::Bf16 if copy_rounding(precision).is_none() => {
            if let Some((dst, a, b)) = T::as_f32(dst, a, b) {
                cpu_gemm::gemm_f32_bf16(dst, accumulate, (m, n, k), a, b);
                return Ok(());
            }
        }
        MatmulPrecision::Bf16 | MatmulPrecision::F16 => {
            let rounding = copy_rounding(precision);
            if let (Some(r), Some((dst, a, b))) = (rounding, T::as_f32(&mut *dst, a, b)) {
                // rounded as they are packed, no copies
                if cpu_gemm::gemm_f32(dst, accumulate, (m, n, k), a, b, Operands::Rounded(r)) {
                    return Ok(());
                }
            }
            if let Some((ar, br)) = rounding.and_then(|r| {
                Some((
                    T::rounded_operand(a.data, r)?,
                    T::rounded_operand(b.data, r)?,
                ))
            }) {
                let a = Mat { data: &ar, ..a };
                let b = Mat { data: &br, ..b };
                T::matmul(dst, accumulate, (m, n, k), a, b);
                return Ok(());
            }
        }
    }
    T::matmul(dst, accumulate, (m, n, k), a, b);
    Ok(())
}

/// How the f32 operands of a product at `precision` are rounded for the f32 kernel: to f16
/// always (this CPU family has no f16 dot product), to bf16 where the f32 kernel multiplies
/// them ([`cpu_gemm::Bf16Kernel::Fma`]); `None` where the kernel takes them as they are (f32,
/// or the bf16 dot product, which rounds to pairs as it packs). kiln's kernel rounds them as it
/// packs them; gemm's (no AVX-512) takes rounded copies.
pub(super) fn copy_rounding(precision: MatmulPrecision) -> Option<Rounding> {
    match precision {
        MatmulPrecision::Highest => None,
        MatmulPrecision::Bf16 => {
            (cpu_gemm::bf16_kernel() == cpu_gemm::Bf16Kernel::Fma).then_some(Rounding::Bf16)
        }
        MatmulPrecision::F16 => Some(Rounding::F16),
    }
}

/// `x` rounded to bf16 or f16 (to nearest even; beyond f16's range to infinity) and widened
/// back: the products of such operands are exact in f32, so an f32 product of them is what a
/// bf16 or f16 unit with f32 accumulation computes. One vectorised pass, each element written
/// once.
pub(super) fn rounded(x: &[f32], r: Rounding) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    round_into(x, &mut out, r);
    out
}

fn round_into(x: &[f32], out: &mut Vec<f32>, r: Rounding) {
    crate::simd_dispatch!(round_into_avx512, round_into_impl, (x, out, r))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn round_into_avx512(x: &[f32], out: &mut Vec<f32>, r: Rounding) {
    round_into_impl(x, out, r)
}

#[inline(always)]
fn round_into_impl(x: &[f32], out: &mut Vec<f32>, r: Rounding) {
    match r {
        Rounding::Bf16 => out.extend(x.iter().map(|&v| crate::fastmath::round_bf16(v))),
        Rounding::F16 => out.extend(x.iter().map(|&v| crate::fastmath::round_f16(v))),
    }
}

/// The storage types of the linear op.
pub(crate) trait DenseElem: WithDType + Copy + Send + Sync + 'static {
    /// See [`matmul_into`]; the operands are checked.
    fn matmul(
        dst: &mut [Self],
        accumulate: bool,
        mnk: (usize, usize, usize),
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
    );
    /// Into f32 (bias sums).
    fn to_f(self) -> f64;
    /// From f32.
    fn from_f(v: f64) -> Self;
    /// Wraps a vector as candle storage.
    fn storage(v: Vec<Self>) -> CpuStorage;
    /// A copy rounded to bf16 or f16 and widened back, when `Self` is f32.
    fn rounded_operand(_data: &[Self], _r: Rounding) -> Option<Vec<Self>> {
        None
    }
    /// The same operands as f32, when `Self` is f32.
    #[allow(clippy::type_complexity)]
    fn as_f32<'a>(
        _dst: &'a mut [Self],
        _a: Mat<'a, Self>,
        _b: Mat<'a, Self>,
    ) -> Option<(&'a mut [f32], Mat<'a, f32>, Mat<'a, f32>)> {
        None
    }
    /// `a b` into a new vector written once, with no zero fill first, where kiln's kernel
    /// computes this type at `precision` on this CPU (f32 at `Highest` and `Bf16`); `None`
    /// elsewhere. The operands are checked.
    fn fresh_product(
        _mnk: (usize, usize, usize),
        _a: Mat<'_, Self>,
        _b: Mat<'_, Self>,
        _precision: MatmulPrecision,
    ) -> Option<Vec<Self>> {
        None
    }
}

/// `a b` (`m x k` by `k x n`) as a new row-major vector at `precision`: written once by the
/// kernel where [`DenseElem::fresh_product`] applies, zero-filled and accumulated into
/// otherwise.
pub(super) fn product<T: DenseElem>(
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    precision: MatmulPrecision,
) -> candle_core::Result<Vec<T>> {
    if covers(&a, m, k) && covers(&b, k, n) {
        if let Some(v) = T::fresh_product((m, n, k), a, b, precision) {
            return Ok(v);
        }
    }
    let mut out = vec![T::from_f(0.0); m * n];
    matmul_prec(&mut out, false, (m, n, k), a, b, precision)?;
    Ok(out)
}

macro_rules! dense_gemm {
    ($t:ty, $var:ident, $to:expr, $from:expr) => {
        impl DenseElem for $t {
            fn matmul(
                dst: &mut [Self],
                accumulate: bool,
                (m, n, k): (usize, usize, usize),
                a: Mat<'_, Self>,
                b: Mat<'_, Self>,
            ) {
                <$t as GemmElem>::gemm(dst, accumulate, m, n, k, a, b)
            }
            fn to_f(self) -> f64 {
                $to(self)
            }
            fn from_f(v: f64) -> Self {
                $from(v)
            }
            fn storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$var(v)
            }
        }
    };
}
impl DenseElem for f32 {
    fn matmul(
        dst: &mut [Self],
        accumulate: bool,
        (m, n, k): (usize, usize, usize),
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
    ) {
        if !cpu_gemm::gemm_f32_exact(dst, accumulate, (m, n, k), a, b) {
            <f32 as GemmElem>::gemm(dst, accumulate, m, n, k, a, b)
        }
    }
    fn to_f(self) -> f64 {
        f64::from(self)
    }
    fn from_f(v: f64) -> Self {
        v as f32
    }
    fn storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::F32(v)
    }
    fn rounded_operand(data: &[Self], r: Rounding) -> Option<Vec<Self>> {
        Some(rounded(data, r))
    }
    fn as_f32<'a>(
        dst: &'a mut [f32],
        a: Mat<'a, f32>,
        b: Mat<'a, f32>,
    ) -> Option<(&'a mut [f32], Mat<'a, f32>, Mat<'a, f32>)> {
        Some((dst, a, b))
    }
    fn fresh_product(
        (m, n, k): (usize, usize, usize),
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        precision: MatmulPrecision,
    ) -> Option<Vec<Self>> {
        let operands = match (precision, copy_rounding(precision)) {
            (_, Some(r)) => Operands::Rounded(r),
            (MatmulPrecision::Bf16, None) => Operands::Bf16Dot,
            _ => Operands::Exact,
        };
        let mut out = Vec::with_capacity(m * n);
        if !cpu_gemm::gemm_f32_fresh(out.spare_capacity_mut(), operands, (m, n, k), a, b) {
            return None;
        }
        // SAFETY: `gemm_f32_fresh` returned true, so it initialised the first `m * n`
        // elements, all within the capacity reserved above
        unsafe { out.set_len(m * n) };
        Some(out)
    }
}
dense_gemm!(f64, F64, |v: f64| v, |v: f64| v);
dense_gemm!(f16, F16, |v: f16| v.to_f64(), f16::from_f64);

impl DenseElem for bf16 {
    fn matmul(
        dst: &mut [Self],
        accumulate: bool,
        mnk: (usize, usize, usize),
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
    ) {
        cpu_gemm::gemm_bf16(dst, accumulate, mnk, a, b)
    }
    fn to_f(self) -> f64 {
        self.to_f64()
    }
    fn from_f(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::BF16(v)
    }
}
