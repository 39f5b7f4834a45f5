//! Grouped-query attention's key and value heads repeated for their query heads, and the
//! backward that sums each group's gradients.

use crate::custom_op::{contiguous, output_vec, par_rows, Elem, Float};
use crate::error::mismatch;
use crate::with_float_storage;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// `x [batch, kv_heads, ..] -> [batch, kv_heads x groups, ..]`, output head `h` a copy of input
/// head `h / groups` (Hugging Face's `repeat_kv`): the keys and values of grouped-query
/// attention (`groups` query heads per key/value head; multi-query attention is one key/value
/// head) made as many as the query heads, for an attention op that takes them one to one. The
/// backward sums each group's `groups` gradients in head order (half types in f32). A
/// contiguous float tensor of at least two dimensions.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::ops::RepeatKv;
/// let kv = Tensor::new(&[[[1f32, 2.], [3., 4.]]], &Device::Cpu)?; // [1, 2 heads, 2]
/// let r = kv.apply_op1(RepeatKv::new(2))?;
/// assert_eq!(r.to_vec3::<f32>()?, [[[1., 2.], [1., 2.], [3., 4.], [3., 4.]]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RepeatKv {
    /// Query heads per key/value head.
    pub groups: usize,
    /// The backward: `[batch, kv_heads x groups, ..] -> [batch, kv_heads, ..]` group sums.
    sum: bool,
}

impl RepeatKv {
    /// Each head repeated `groups` times.
    pub fn new(groups: usize) -> Self {
        Self { groups, sum: false }
    }
}

/// `(heads in, elements per head)` of a `[batch, heads, ..]` layout.
fn split(
    op: &'static str,
    l: &Layout,
    groups: usize,
    sum: bool,
) -> candle_core::Result<(usize, usize)> {
    let d = l.shape().dims();
    if d.len() < 2 || groups == 0 {
        return Err(mismatch(
            op,
            format!("x is {d:?} with groups {groups}: it must be [batch, heads, ..], groups > 0"),
        ));
    }
    let inner: usize = d[2..].iter().product();
    if sum && d[1] % groups != 0 {
        return Err(mismatch(
            op,
            format!("{} heads are not a multiple of the groups {groups}", d[1]),
        ));
    }
    Ok((d[1], inner))
}

fn repeat<T: Elem>(
    x: &[T],
    heads: usize,
    inner: usize,
    groups: usize,
) -> candle_core::Result<Vec<T>> {
    let mut out = output_vec::<T>(x.len() * groups);
    par_rows(&mut out, inner, inner, |row0, chunk| {
        for (k, o) in chunk.chunks_mut(inner).enumerate() {
            // output row = (batch, head out); its source is (batch, head out / groups)
            let r = row0 + k;
            let (b, h) = (r / (heads * groups), r % (heads * groups));
            let src = (b * heads + h / groups) * inner;
            o.copy_from_slice(&x[src..src + inner]);
        }
    })?;
    Ok(out)
}

fn group_sums<T: Elem>(
    dy: &[T],
    heads_out: usize,
    inner: usize,
    groups: usize,
) -> candle_core::Result<Vec<T>> {
    let kv = heads_out / groups;
    let mut out = output_vec::<T>(dy.len() / groups);
    par_rows(&mut out, inner, inner * groups, |row0, chunk| {
        let mut acc = vec![<T::F as Float>::ZERO; inner];
        for (k, o) in chunk.chunks_mut(inner).enumerate() {
            let r = row0 + k;
            let (b, h) = (r / kv, r % kv);
            acc.iter_mut().for_each(|a| *a = <T::F as Float>::ZERO);
            for g in 0..groups {
                let src = (b * heads_out + h * groups + g) * inner;
                for (a, v) in acc.iter_mut().zip(&dy[src..src + inner]) {
                    *a += v.load();
                }
            }
            for (o, &a) in o.iter_mut().zip(&acc) {
                *o = T::store(a);
            }
        }
    })?;
    Ok(out)
}

impl CustomOp1 for RepeatKv {
    fn name(&self) -> &'static str {
        if self.sum {
            "kiln-repeat-kv-bwd"
        } else {
            "kiln-repeat-kv"
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::llama::repeat_kv((s, l), self.groups, self.sum)
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (heads, inner) = split(op, l, self.groups, self.sum)?;
        let mut dims = l.shape().dims().to_vec();
        dims[1] = if self.sum {
            heads / self.groups
        } else {
            heads * self.groups
        };
        with_float_storage!(s, op, |xs| {
            let x = contiguous(xs, l, op)?;
            let y = if self.sum {
                group_sums(x, heads, inner, self.groups)?
            } else {
                repeat(x, heads, inner, self.groups)?
            };
            Ok((Elem::into_storage(y), Shape::from(dims.clone())))
        })
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if self.sum {
            return Err(mismatch(
                "kiln-repeat-kv-bwd",
                "the group sums are a backward and have none of their own",
            ));
        }
        let grad = grad.to_dtype(x.dtype())?.contiguous()?;
        let sum = RepeatKv {
            groups: self.groups,
            sum: true,
        };
        Ok(Some(grad.apply_op1_no_bwd(&sum)?))
    }
}
