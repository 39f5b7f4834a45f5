//! Rotary position embedding (Su et al., 2021; the Llama family's positions) applied to query
//! and key heads, and its backward (the inverse rotation).

use crate::custom_op::{contiguous, output_vec, par_rows, same_type, Elem, Float};
use crate::error::mismatch;
use crate::with_float_storage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

/// Which elements of a head a rotation pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RotaryLayout {
    /// Element `j` with `j + d/2` (Hugging Face's `rotate_half`, the `LlamaForCausalLM` layout
    /// of the q and k projections' rows).
    #[default]
    Half,
    /// Element `2j` with `2j + 1` (the original Llama and GPT-J layout).
    Interleaved,
}

/// Rotates the first `heads` heads of `head_dim` elements in each row of `x [.., s, width]`
/// by the angles of the row's position (its index along the second-to-last dimension) and
/// passes the rest of the row through: with `table [s, head_dim]` holding `cos` in its first
/// half and `sin` in its second (`head_dim / 2` frequencies each, [`RotaryLayout`] deciding
/// which elements each frequency pairs), pair `(a, b)` at frequency `i` becomes
/// `(a cos_i - b sin_i, b cos_i + a sin_i)`. One op covers a query tensor (`width = heads x
/// head_dim`), a head-major `[b, h, s, d]` tensor (`heads = 1`), and a fused QKV projection
/// whose first `heads` heads are the queries and keys (the values pass through). `x` and
/// `table` are contiguous and of one float dtype (half types compute in f32). The backward is
/// the inverse rotation of the output gradient; the table gets none.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::ops::{Rotary, RotaryLayout};
/// // one head of 2 at positions 0 and 1, angle 0 then pi/2
/// let table = Tensor::new(&[[1f32, 0.0], [0.0, 1.0]], &Device::Cpu)?;
/// let x = Tensor::new(&[[1f32, 2.0], [1.0, 2.0]], &Device::Cpu)?;
/// let y = x.apply_op2(&table, Rotary::new(2, 1, RotaryLayout::Half))?.to_vec2::<f32>()?;
/// assert_eq!(y, [[1.0, 2.0], [-2.0, 1.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Rotary {
    /// Elements of a head (even).
    pub head_dim: usize,
    /// Heads rotated at the start of each row.
    pub heads: usize,
    /// Which elements a rotation pairs.
    pub layout: RotaryLayout,
    /// The inverse rotation (the backward).
    inverse: bool,
}

impl Rotary {
    /// The rotation of the first `heads` heads of `head_dim` elements of each row.
    pub fn new(head_dim: usize, heads: usize, layout: RotaryLayout) -> Self {
        Self {
            head_dim,
            heads,
            layout,
            inverse: false,
        }
    }
}

/// The sizes of one application, checked.
#[derive(Clone, Copy)]
struct Dims {
    seq: usize,
    width: usize,
}

fn dims(op: &'static str, r: &Rotary, lx: &Layout, lt: &Layout) -> candle_core::Result<Dims> {
    let xd = lx.shape().dims();
    let d = r.head_dim;
    if d == 0 || d % 2 != 0 {
        return Err(mismatch(
            op,
            format!("the rotary dimension (head_dim) is {d}: it must be even and non-zero"),
        ));
    }
    let (seq, td) = lt.shape().dims2()?;
    if td != d {
        return Err(mismatch(
            op,
            format!("the table is [{seq}, {td}]: it must be [seq, {d}] (cos, then sin)"),
        ));
    }
    let (s, width) = match xd {
        [.., s, w] => (*s, *w),
        _ => {
            return Err(mismatch(
                op,
                format!("x is {xd:?}: it must be [.., seq, width]"),
            ))
        }
    };
    if s != seq || width < r.heads * d {
        return Err(mismatch(
            op,
            format!(
                "x is {xd:?}: it must be [.., {seq}, width] with width >= {} ({} heads of {d})",
                r.heads * d,
                r.heads
            ),
        ));
    }
    Ok(Dims { seq, width })
}

/// One row: `out = R(angles) x` over its first `heads` heads, the rest copied.
#[inline(always)]
fn row<T: Elem>(out: &mut [T], x: &[T], cos: &[T::F], sin: &[T::F], r: &Rotary) {
    let (d, half) = (r.head_dim, r.head_dim / 2);
    let rot = r.heads * d;
    for h in 0..r.heads {
        let (xo, oo) = (&x[h * d..(h + 1) * d], &mut out[h * d..(h + 1) * d]);
        for i in 0..half {
            let (ia, ib) = match r.layout {
                RotaryLayout::Half => (i, i + half),
                RotaryLayout::Interleaved => (2 * i, 2 * i + 1),
            };
            let (a, b) = (xo[ia].load(), xo[ib].load());
            let s = if r.inverse {
                <T::F as Float>::ZERO - sin[i]
            } else {
                sin[i]
            };
            let c = cos[i];
            oo[ia] = T::store(a * c - b * s);
            oo[ib] = T::store(b * c + a * s);
        }
    }
    out[rot..].copy_from_slice(&x[rot..]);
}

fn rotate<T: Elem>(x: &[T], table: &[T], r: &Rotary, d: Dims) -> candle_core::Result<Vec<T>> {
    let half = r.head_dim / 2;
    let table: Vec<T::F> = table.iter().map(|v| v.load()).collect();
    let mut out = output_vec::<T>(x.len());
    par_rows(&mut out, d.width, 4 * d.width, |row0, chunk| {
        for (k, o) in chunk.chunks_mut(d.width).enumerate() {
            let rix = row0 + k;
            let t = &table[(rix % d.seq) * r.head_dim..(rix % d.seq + 1) * r.head_dim];
            let (cos, sin) = t.split_at(half);
            row(o, &x[rix * d.width..(rix + 1) * d.width], cos, sin, r);
        }
    })?;
    Ok(out)
}

impl CustomOp2 for Rotary {
    fn name(&self) -> &'static str {
        if self.inverse {
            "kiln-rotary-bwd"
        } else {
            "kiln-rotary"
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        dims(self.name(), self, l1, l2)?;
        crate::cuda::llama::rotary(
            (s1, l1),
            (s2, l2),
            self.head_dim,
            self.heads,
            self.layout == RotaryLayout::Interleaved,
            self.inverse,
        )
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let d = dims(op, self, l1, l2)?;
        with_float_storage!(s1, op, |xs| {
            let x = contiguous(xs, l1, op)?;
            let table = contiguous(same_type(x, s2, op)?, l2, op)?;
            let y = rotate(x, table, self, d)?;
            Ok((Elem::into_storage(y), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        _x: &Tensor,
        table: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(table.dtype())?.contiguous()?;
        let inverse = Rotary {
            inverse: !self.inverse,
            ..*self
        };
        Ok((Some(grad.apply_op2_no_bwd(table, &inverse)?), None))
    }
}
