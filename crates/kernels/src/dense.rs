//! The CPU linear op, the matrix product every dense layer uses: `y = x W^T + b` as one candle
//! op ([`LinearBias`], [`LinearNoBias`]) with its own backward, on kiln's AVX-512 kernels
//! ([`crate::cpu_gemm`]) or the gemm crate's, called directly. `kiln_parallel::tp::linear`
//! applies it to CPU tensors, and every linear layer of kiln's models goes through that.
//!
//! Built from candle's ops, a linear layer is five graph nodes (reshape, transpose, matmul,
//! broadcast add, reshape); candle's backward gives each node's input a gradient buffer that
//! starts as `zeros_like` and is then added to, so one layer costs six activation-sized
//! zero-fills and additions besides its three matrix products, and the bias gradient is a
//! single-threaded column sum. Here the forward writes the bias into the output and lets the
//! matrix product accumulate onto it, and the backward runs the two products straight into
//! fresh buffers (`dx = dy W`, `dW = dy^T x`, the transposes as strides) with the bias
//! gradient as one pass of column sums: three gradients, each written once.
//!
//! f32 and bf16 use kiln's AVX-512 kernels ([`crate::cpu_gemm`]: FMA for f32, the
//! `avx512_bf16` dot product with f32 accumulation for bf16) where the CPU has them, gemm's
//! kernels elsewhere (bf16 widened to f32); f64 and f16 use gemm's kernels of that type.

use crate::cpu_gemm::{self, Operands, Rounding};
use crate::error::mismatch;
use crate::KernelError;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Storage, Tensor, WithDType};
use half::{bf16, f16};

const OP: &str = "kiln-linear";

/// How the CPU linear op multiplies f32 tensors: PyTorch's
/// `torch.set_float32_matmul_precision`, for the linear layers of one thread.
///
/// With [`MatmulPrecision::Bf16`] the operands of every f32 product are rounded to bf16 and
/// the products accumulate in f32, the result staying f32: the tensors around the product,
/// their gradients and every other op stay f32. Where the CPU's `avx512_bf16` dot product
/// outruns f32 FMA (twice its rate on AMD Zen 4) the operands are rounded as they are packed
/// for it; elsewhere (Intel Xeons without AMX, where it runs at half FMA's rate) they are
/// rounded as they are packed for the f32 kernel (see [`crate::bf16_kernel`]). This is how
/// kiln-model computes in bf16 on the CPU (see `GptOptions::compute_dtype`), where candle's
/// element-wise bf16 kernels are slower than its f32 ones. [`MatmulPrecision::F16`] does the
/// same with f16 operands (kiln-model's f16 compute on the CPU). Tensors stored in bf16, f16 or f64 are multiplied in their own type
/// whatever the setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulPrecision {
    /// f32 operands (the default).
    #[default]
    Highest,
    /// bf16 operands, f32 accumulation and result.
    Bf16,
    /// f16 operands (rounded to nearest even, beyond 65504 to infinity), f32 accumulation and
    /// result: what an f16 matrix unit with f32 accumulation computes. This CPU family has no
    /// f16 dot product, so the operands are rounded as they are packed for the f32 kernel
    /// (rounded copies through gemm's kernel where the CPU lacks AVX-512). A scaled gradient
    /// too large for f16 becomes infinite in the product, so a dynamic loss scaler sees the
    /// overflow it exists for.
    F16,
}

thread_local! {
    static PRECISION: std::cell::Cell<MatmulPrecision> =
        const { std::cell::Cell::new(MatmulPrecision::Highest) };
}

/// Runs `f` with this thread's f32 linear products at `precision`, restoring the previous
/// setting afterwards (also when `f` unwinds). The setting is read when an op is built in the
/// forward; its backward uses the same precision whichever thread runs it.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::dense::LinearNoBias;
/// use kiln_kernels::{with_matmul_precision, MatmulPrecision};
/// let x = Tensor::new(&[[1.0f32 + 1.0 / 1024.0]], &Device::Cpu)?;
/// let w = Tensor::new(&[[1.0f32]], &Device::Cpu)?;
/// let exact = x.apply_op2(&w, LinearNoBias::new())?.to_vec2::<f32>()?[0][0];
/// let rounded = with_matmul_precision(MatmulPrecision::Bf16, || {
///     x.apply_op2(&w, LinearNoBias::new())
/// })?;
/// assert_eq!(exact, 1.0 + 1.0 / 1024.0);
/// assert_eq!(rounded.to_vec2::<f32>()?[0][0], 1.0); // x rounded to bf16's 8 bits
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn with_matmul_precision<R>(precision: MatmulPrecision, f: impl FnOnce() -> R) -> R {
    struct Restore(MatmulPrecision);
    impl Drop for Restore {
        fn drop(&mut self) {
            PRECISION.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(PRECISION.with(|p| p.replace(precision)));
    f()
}

/// This thread's current [`MatmulPrecision`].
pub fn matmul_precision() -> MatmulPrecision {
    PRECISION.with(|p| p.get())
}

/// The CPU linear op without a bias: `(x [.., in], weight [out, in]) -> x W^T` `[.., out]`, both
/// CPU tensors of one float dtype and contiguous, f32 products at `precision` (read from
/// [`matmul_precision`] when the op is built, so the backward uses the forward's). Its backward
/// gives `x` and `weight` their gradients, each written once.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::dense::LinearNoBias;
/// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
/// let w = Tensor::new(&[[1f32, 0.], [1., 1.], [0., -1.]], &Device::Cpu)?; // [out 3, in 2]
/// let y = x.apply_op2(&w, LinearNoBias::new())?;
/// assert_eq!(y.to_vec2::<f32>()?, [[1., 3., -2.], [3., 7., -4.]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct LinearNoBias {
    /// How f32 operands are multiplied.
    pub precision: MatmulPrecision,
}

impl LinearNoBias {
    /// The op at this thread's [`matmul_precision`].
    pub fn new() -> Self {
        Self {
            precision: matmul_precision(),
        }
    }
}

impl Default for LinearNoBias {
    fn default() -> Self {
        Self::new()
    }
}

/// The CPU linear op with a bias: `(x [.., in], weight [out, in], bias [out]) -> x W^T + b`,
/// the bias written into the output first and the product accumulated onto it; otherwise as
/// [`LinearNoBias`], the backward also giving the bias its gradient (column sums, rows in
/// order).
#[derive(Debug, Clone, Copy)]
pub struct LinearBias {
    /// How f32 operands are multiplied.
    pub precision: MatmulPrecision,
}

impl LinearBias {
    /// The op at this thread's [`matmul_precision`].
    pub fn new() -> Self {
        Self {
            precision: matmul_precision(),
        }
    }
}

impl Default for LinearBias {
    fn default() -> Self {
        Self::new()
    }
}

/// The sizes of one product, checked against the layouts.
#[derive(Clone, Copy)]
struct Dims {
    rows: usize,
    inf: usize,
    outf: usize,
}

fn dims(lx: &Layout, lw: &Layout, lb: Option<&Layout>) -> candle_core::Result<Dims> {
    let xd = lx.shape().dims();
    let (outf, inw) = lw.shape().dims2()?;
    let inf = match xd.last() {
        Some(&inf) if inf == inw => inf,
        _ => {
            return Err(KernelError::Shape {
                op: OP,
                what: "x",
                expected: format!("[.., {inw}] for a weight of shape [{outf}, {inw}]"),
                got: format!("{xd:?}"),
            }
            .into())
        }
    };
    let rows = lx
        .shape()
        .elem_count()
        .checked_div(inf)
        .unwrap_or_else(|| xd[..xd.len() - 1].iter().product());
    if let Some(lb) = lb {
        if lb.shape().dims() != [outf] {
            return Err(KernelError::Shape {
                op: OP,
                what: "bias",
                expected: format!("[{outf}]"),
                got: format!("{:?}", lb.shape().dims()),
            }
            .into());
        }
    }
    Ok(Dims { rows, inf, outf })
}

/// The contiguous elements `l` addresses ([`crate::custom_op::contiguous`]), the error naming
/// which input was strided.
fn slice<'a, T>(data: &'a [T], l: &Layout, what: &'static str) -> candle_core::Result<&'a [T]> {
    crate::custom_op::contiguous(data, l, OP)
        .map_err(|_| KernelError::NotContiguous { op: OP, what }.into())
}

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
fn covers<T>(m: &Mat<'_, T>, rows: usize, cols: usize) -> bool {
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
fn matmul_prec<T: DenseElem>(
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
fn copy_rounding(precision: MatmulPrecision) -> Option<Rounding> {
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
fn rounded(x: &[f32], r: Rounding) -> Vec<f32> {
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
fn product<T: DenseElem>(
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

/// `y = x W^T + b`: the bias written into every row first, the product accumulated onto it.
fn forward<T: DenseElem>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    d: Dims,
    precision: MatmulPrecision,
) -> candle_core::Result<Vec<T>> {
    let Dims { rows, inf, outf } = d;
    let xm = Mat {
        data: x,
        rs: inf,
        cs: 1,
    };
    // y[r, o] (+)= sum_i x[r, i] w[o, i]: the weight read transposed through its strides
    let wt = Mat {
        data: w,
        rs: 1,
        cs: inf,
    };
    let Some(b) = b else {
        return product((rows, outf, inf), xm, wt, precision);
    };
    let mut y = bias_rows(b, rows);
    matmul_prec(&mut y, true, (rows, outf, inf), xm, wt, precision)?;
    Ok(y)
}

/// `(dx, dW, db)`: `dx = dy W`, `dW = dy^T x`, `db` the column sums of `dy` (in f64 for half
/// types' sake, rows in order: deterministic).
#[allow(clippy::type_complexity)]
fn backward<T: DenseElem>(
    x: &[T],
    w: &[T],
    dy: &[T],
    bias: bool,
    d: Dims,
    precision: MatmulPrecision,
) -> candle_core::Result<(Vec<T>, Vec<T>, Option<Vec<T>>)> {
    let Dims { rows, inf, outf } = d;
    if dy.len() != rows * outf {
        return Err(KernelError::Shape {
            op: OP,
            what: "the output gradient",
            expected: format!("{rows} x {outf} elements"),
            got: format!("{} elements", dy.len()),
        }
        .into());
    }
    let db = bias.then(|| column_sums(dy, outf));
    // where the kernel cannot round as it packs (no AVX-512), rounded copies: `dy` feeds both
    // products, so it is rounded once here (as are `W` and `x`), not once per product
    let by_copy = !crate::fastmath::has_avx512();
    let rounded = copy_rounding(precision).filter(|_| by_copy).and_then(|r| {
        Some((
            T::rounded_operand(dy, r)?,
            T::rounded_operand(w, r)?,
            T::rounded_operand(x, r)?,
        ))
    });
    let (dy, w, x, precision) = match &rounded {
        Some((dy, w, x)) => (&dy[..], &w[..], &x[..], MatmulPrecision::Highest),
        None => (dy, w, x, precision),
    };
    let dyr = Mat {
        data: dy,
        rs: outf,
        cs: 1,
    };
    let dx = product(
        (rows, inf, outf),
        dyr,
        Mat {
            data: w,
            rs: inf,
            cs: 1,
        },
        precision,
    )?;
    let dw = product(
        (outf, inf, rows),
        Mat {
            data: dy,
            rs: 1,
            cs: outf,
        },
        Mat {
            data: x,
            rs: inf,
            cs: 1,
        },
        precision,
    )?;
    Ok((dx, dw, db))
}

/// Runs `f` on the slices of the storages, which must share one float type.
macro_rules! dispatch {
    ($s:expr, |$v:ident : $t:ident| $body:expr) => {
        match $s {
            CpuStorage::F32($v) => {
                type $t = f32;
                $body
            }
            CpuStorage::F64($v) => {
                type $t = f64;
                $body
            }
            CpuStorage::F16($v) => {
                type $t = f16;
                $body
            }
            CpuStorage::BF16($v) => {
                type $t = bf16;
                $body
            }
            other => Err(candle_core::Error::UnsupportedDTypeForOp(other.dtype(), OP)),
        }
    };
}

/// The slice of `s`, which must hold `T`.
fn typed<'a, T: WithDType>(s: &'a CpuStorage, what: &'static str) -> candle_core::Result<&'a [T]> {
    T::cpu_storage_as_slice(s).map_err(|_| {
        KernelError::Dtype {
            op: OP,
            what,
            expected: "the dtype of x",
            got: s.dtype(),
        }
        .into()
    })
}

fn fwd_storage(
    sx: &CpuStorage,
    lx: &Layout,
    sw: &CpuStorage,
    lw: &Layout,
    sb: Option<(&CpuStorage, &Layout)>,
    precision: MatmulPrecision,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let d = dims(lx, lw, sb.map(|(_, l)| l))?;
    dispatch!(sx, |xs: T| {
        let x = slice(xs, lx, "x")?;
        let w = slice(typed::<T>(sw, "the weight")?, lw, "the weight")?;
        let b = match sb {
            Some((s, l)) => Some(slice(typed::<T>(s, "the bias")?, l, "the bias")?),
            None => None,
        };
        let y = forward(x, w, b, d, precision)?;
        Ok((T::storage(y), out_shape(lx, d.outf)))
    })
}

/// The output shape: `x`'s leading dimensions, then `outf`.
fn out_shape(lx: &Layout, outf: usize) -> Shape {
    let mut dims = lx.shape().dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = outf;
    }
    Shape::from(dims)
}

/// The CPU storage of a tensor, contiguous.
fn cpu_of(t: &Tensor) -> candle_core::Result<Tensor> {
    if !t.device().is_cpu() {
        return Err(not_cpu(t.device()));
    }
    t.contiguous()
}

/// A device tensor given to a CPU op.
fn not_cpu(dev: &candle_core::Device) -> candle_core::Error {
    KernelError::Device {
        op: OP,
        expected: "CPU tensors",
        got: format!("a tensor on {:?}", dev.location()),
    }
    .into()
}

/// The gradients of the linear op's inputs `(dx, dW, db)` for the output gradient `grad`:
/// `dx = grad W`, `dW = grad^T x`, `db` (with `bias`) the column sums of `grad`, the products at
/// `precision`. For ops that hold a product's output gradient themselves (a fused head and
/// loss).
#[allow(clippy::type_complexity)]
pub fn linear_backward(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    bias: bool,
    precision: MatmulPrecision,
) -> candle_core::Result<(Tensor, Tensor, Option<Tensor>)> {
    let grad = cpu_of(&grad.to_dtype(x.dtype())?)?;
    let (x, w) = (cpu_of(x)?, cpu_of(w)?);
    let (sx, lx) = x.storage_and_layout();
    let (sw, lw) = w.storage_and_layout();
    let (sg, lg) = grad.storage_and_layout();
    let (Storage::Cpu(sx), Storage::Cpu(sw), Storage::Cpu(sg)) = (&*sx, &*sw, &*sg) else {
        return Err(not_cpu(x.device()));
    };
    let d = dims(lx, lw, None)?;
    let dev = x.device();
    dispatch!(sx, |xs: T| {
        let xv = slice(xs, lx, "x")?;
        let wv = slice(typed::<T>(sw, "the weight")?, lw, "the weight")?;
        let gv = slice(
            typed::<T>(sg, "the output gradient")?,
            lg,
            "the output gradient",
        )?;
        let (dx, dw, db) = backward(xv, wv, gv, bias, d, precision)?;
        Ok((
            Tensor::from_vec(dx, lx.shape(), dev)?,
            Tensor::from_vec(dw, (d.outf, d.inf), dev)?,
            db.map(|v| Tensor::from_vec(v, d.outf, dev)).transpose()?,
        ))
    })
}

impl CustomOp2 for LinearNoBias {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        fwd_storage(s1, l1, s2, l2, None, self.precision)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = linear_backward(x, w, grad, false, self.precision)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for LinearBias {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        fwd_storage(s1, l1, s2, l2, Some((s3, l3)), self.precision)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = linear_backward(x, w, grad, true, self.precision)?;
        Ok((Some(dx), Some(dw), db))
    }
}

mod bias;
pub use bias::AddBias;
use bias::{bias_rows, column_sums};

#[cfg(test)]
mod tests;
