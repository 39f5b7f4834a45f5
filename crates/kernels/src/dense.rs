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

use crate::KernelError;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Storage, Tensor, WithDType};
use half::{bf16, f16};

mod precision;
mod product;

pub use bias::AddBias;
use bias::{bias_rows, column_sums};
pub use precision::{matmul_precision, with_matmul_precision, MatmulPrecision};
use product::{copy_rounding, matmul_prec, product, DenseElem};
pub(crate) use product::{matmul_into, Mat};

const OP: &str = "kiln-linear";

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

/// Which gradients of the linear op a backward computes ([`linear_backward_parts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearGrads {
    /// `dx = dy W`.
    pub x: bool,
    /// `dW = dy^T x`.
    pub weight: bool,
    /// `db`, the column sums of `dy`.
    pub bias: bool,
}

/// The backward's results, each where [`LinearGrads`] asked for it.
type Parts<T> = (Option<Vec<T>>, Option<Vec<T>>, Option<Vec<T>>);

/// `(dx, dW, db)` as `want` asks: `dx = dy W`, `dW = dy^T x`, `db` the column sums of `dy` (in
/// f64 for half types' sake, rows in order: deterministic). Each is computed alone, so a part
/// is bitwise the same whether or not the others are asked for.
fn backward<T: DenseElem>(
    x: &[T],
    w: &[T],
    dy: &[T],
    want: LinearGrads,
    d: Dims,
    precision: MatmulPrecision,
) -> candle_core::Result<Parts<T>> {
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
    let db = want.bias.then(|| column_sums(dy, outf));
    if !want.x && !want.weight {
        return Ok((None, None, db));
    }
    // where the kernel cannot round as it packs (no AVX-512), rounded copies: `dy` feeds both
    // products, so it is rounded once here (as are `W` and `x` where their product is asked
    // for), not once per product
    let by_copy = !crate::fastmath::has_avx512();
    let round = copy_rounding(precision).filter(|_| by_copy);
    let rounded = |v: &[T], used: bool| match (round, used) {
        (Some(r), true) => T::rounded_operand(v, r),
        _ => None,
    };
    let (rdy, rw, rx) = (
        rounded(dy, true),
        rounded(w, want.x),
        rounded(x, want.weight),
    );
    let (dy, w, x, precision) = match &rdy {
        Some(rdy) => (
            &rdy[..],
            rw.as_deref().unwrap_or(w),
            rx.as_deref().unwrap_or(x),
            MatmulPrecision::Highest,
        ),
        None => (dy, w, x, precision),
    };
    let dyr = Mat {
        data: dy,
        rs: outf,
        cs: 1,
    };
    let dx = want
        .x
        .then(|| {
            product(
                (rows, inf, outf),
                dyr,
                Mat {
                    data: w,
                    rs: inf,
                    cs: 1,
                },
                precision,
            )
        })
        .transpose()?;
    let dw = want
        .weight
        .then(|| {
            product(
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
            )
        })
        .transpose()?;
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
    let want = LinearGrads {
        x: true,
        weight: true,
        bias,
    };
    let (dx, dw, db) = linear_backward_parts(x, w, grad, want, precision)?;
    match (dx, dw) {
        (Some(dx), Some(dw)) => Ok((dx, dw, db)),
        _ => Err(candle_core::Error::msg(format!(
            "{OP}: the backward gave no input or weight gradient"
        ))),
    }
}

/// The gradients [`linear_backward`] gives, only those `want` asks for, each bitwise what
/// [`linear_backward`] gives it: a zero-bubble pipeline schedule computes `dx` first and `dW`
/// and `db` later (`x` is not read without `want.weight`, nor `w` without `want.x`).
#[allow(clippy::type_complexity)]
pub fn linear_backward_parts(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    want: LinearGrads,
    precision: MatmulPrecision,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
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
        let (dx, dw, db) = backward(xv, wv, gv, want, d, precision)?;
        Ok((
            dx.map(|v| Tensor::from_vec(v, lx.shape(), dev))
                .transpose()?,
            dw.map(|v| Tensor::from_vec(v, (d.outf, d.inf), dev))
                .transpose()?,
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

// after `dispatch!`, which it uses
mod bias;

#[cfg(test)]
mod tests;
