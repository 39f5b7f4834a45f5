//! Bias gradients: the column sums of an output gradient (parallel strips, rows in order),
//! and the row-parallel bias add as one op whose backward is those sums.

use super::{cpu_of, not_cpu, slice, typed, DenseElem, OP};
use crate::pool;
use crate::KernelError;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};

/// The column sums of `[rows, n]` rows, in f64 (for half types' sake), rows in order:
/// deterministic.
pub(super) fn column_sums<T: DenseElem>(dy: &[T], n: usize) -> Vec<T> {
    if n == 0 {
        return Vec::new();
    }
    let rows = dy.len() / n;
    let mut out = vec![T::from_f(0.0); n];
    // strips of columns in parallel, each summing its rows in order: the same sums
    let strip = COLUMN_STRIP.min(n);
    let strips = pool::slots(&mut out, strip);
    pool::run_items(strips.len(), strip * rows, |i| {
        let Some(dst) = pool::take(&strips[i]) else {
            return;
        };
        let c0 = i * strip;
        let mut acc = vec![0f64; dst.len()];
        for row in dy.chunks_exact(n) {
            for (a, &g) in acc.iter_mut().zip(&row[c0..c0 + dst.len()]) {
                *a += g.to_f();
            }
        }
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = T::from_f(a);
        }
    });
    out
}

/// Columns one task of [`column_sums`] sums.
const COLUMN_STRIP: usize = 256;

/// `rows` copies of the bias `b`, one after another: the start of a forward's output, which
/// the product then accumulates onto. Blocks of rows in parallel, every element written once.
pub(super) fn bias_rows<T: Copy + Send + Sync>(b: &[T], rows: usize) -> Vec<T> {
    let n = b.len();
    if n == 0 || rows == 0 {
        return Vec::new();
    }
    let len = rows * n;
    let mut y: Vec<T> = Vec::with_capacity(len);
    {
        let blocks = pool::slots(&mut y.spare_capacity_mut()[..len], BIAS_ROWS * n);
        pool::for_each_slot(&blocks, BIAS_ROWS * n, |_, dst| {
            for row in dst.chunks_exact_mut(n) {
                for (d, &v) in row.iter_mut().zip(b) {
                    d.write(v);
                }
            }
        });
    }
    // SAFETY: every block ran once (`for_each_slot`) and was filled whole (each a whole number of rows of
    // `n`), and the blocks cover the first `len` elements, inside the capacity
    unsafe { y.set_len(len) };
    y
}

/// Rows one task of [`bias_rows`] fills.
const BIAS_ROWS: usize = 64;

/// `y + b` over the last dimension of `y` (`(y [.., n], b [n])`, CPU tensors of one float
/// dtype, contiguous): the forward is candle's broadcast add element for element; the backward
/// passes the gradient on to `y` and sums its columns for `b`, rows in order, where candle's
/// broadcast add reduces over the leading dimensions with a strided sum (3% of the main job's
/// step). The row-parallel layer's bias, added after the all-reduce.
#[derive(Debug, Clone, Copy, Default)]
pub struct AddBias;

impl CustomOp2 for AddBias {
    fn name(&self) -> &'static str {
        "kiln-add-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let n = l2.shape().elem_count();
        if l2.dims().len() != 1 || l1.dims().last() != Some(&n) || n == 0 {
            return Err(KernelError::Shape {
                op: OP,
                what: "bias",
                expected: format!("[n] for y of shape {:?}", l1.dims()),
                got: format!("{:?}", l2.dims()),
            }
            .into());
        }
        dispatch!(s1, |ys: T| {
            let y = slice(ys, l1, "y")?;
            let b = slice(typed::<T>(s2, "the bias")?, l2, "the bias")?;
            let mut out = Vec::with_capacity(y.len());
            for row in y.chunks_exact(n) {
                out.extend(row.iter().zip(b).map(|(&v, &c)| v + c));
            }
            Ok((T::storage(out), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        _y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = b.elem_count();
        let g = cpu_of(&grad.to_dtype(b.dtype())?)?;
        let (sg, lg) = g.storage_and_layout();
        let Storage::Cpu(sg) = &*sg else {
            return Err(not_cpu(g.device()));
        };
        let db = dispatch!(sg, |gs: T| {
            let gv = slice(gs, lg, "the output gradient")?;
            Tensor::from_vec(column_sums::<T>(gv, n), n, b.device())
        })?;
        Ok((Some(grad.clone()), Some(db)))
    }
}
