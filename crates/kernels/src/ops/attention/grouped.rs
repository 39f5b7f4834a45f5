//! Grouped-query causal attention (Llama's GQA; multi-query attention with one key/value head)
//! on q, k and v as three projections write them, `[b, t, heads * dh]` and `[b, t, kv_heads *
//! dh]`: the CPU kernels of [`CausalAttention`](super::CausalAttention) read every head's rows
//! in place ([`cpu::Rows::Split`]), the key/value heads neither permuted nor repeated.

use super::{cpu, interleave_heads, internal, size_error};
use crate::custom_op::{contiguous, output_vec, par_rows, same_type, Elem, Float};
use crate::with_float_storage;
use crate::KernelError;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use std::sync::{Arc, Mutex};

const OP: &str = "grouped_attention";

/// Causal attention with `kv_heads` key/value heads shared by `heads` query heads, straight
/// from the projections' outputs, on the CPU: `q` `[batch, seq, heads * head_dim]`, `k` and
/// `v` `[batch, seq, kv_heads * head_dim]` (contiguous, one float dtype), the output `[batch,
/// seq, heads * head_dim]`, the heads side by side. Query head `h` attends with key/value head
/// `h / (heads / kv_heads)` (Hugging Face's `repeat_kv` grouping); `kv_heads == heads` is
/// multi-head attention, `kv_heads == 1` multi-query attention.
///
/// The same numbers as permuting to `[batch, heads, seq, head_dim]`, repeating the key/value
/// heads ([`RepeatKv`](crate::ops::RepeatKv)) and applying
/// [`CausalAttention`](crate::ops::CausalAttention), bitwise in every float dtype, forward and
/// gradients: the kernels are those of [`CausalAttention`](crate::ops::CausalAttention), each
/// head reading its rows where they are, and the gradient of a key/value head is its group's
/// query heads' gradients (each rounded to the storage type) summed in head order in the
/// arithmetic type, as `RepeatKv`'s backward sums them. One op object serves one forward.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::ops::GroupedAttention;
/// let q = Tensor::randn(0f32, 1.0, (2, 5, 4 * 8), &Device::Cpu)?; // 4 query heads of 8
/// let kv = Tensor::randn(0f32, 1.0, (2, 5, 8), &Device::Cpu)?; // 1 key/value head
/// let y = q.apply_op3(&kv, &kv, GroupedAttention::new(4, 1, 0.125))?;
/// assert_eq!(y.dims(), &[2, 5, 32]);
/// // the first position sees only itself: every query head's output is the value row
/// let first = y.get(0)?.get(0)?.reshape((4, 8))?;
/// let v0 = kv.get(0)?.get(0)?.to_vec1::<f32>()?;
/// assert!(first.to_vec2::<f32>()?.iter().all(|row| row == &v0));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct GroupedAttention {
    heads: usize,
    kv_heads: usize,
    scale: f64,
    lse: Mutex<Option<Arc<Vec<f64>>>>,
}

impl std::fmt::Debug for GroupedAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupedAttention")
            .field("heads", &self.heads)
            .field("kv_heads", &self.kv_heads)
            .field("scale", &self.scale)
            .finish_non_exhaustive()
    }
}

impl GroupedAttention {
    /// The op for one forward of `heads` query heads over `kv_heads` key/value heads (which
    /// must divide `heads`), the scores scaled by `scale` (`1 / sqrt(head_dim)`).
    pub fn new(heads: usize, kv_heads: usize, scale: f64) -> Self {
        Self {
            heads,
            kv_heads,
            scale,
            lse: Mutex::new(None),
        }
    }
}

fn poisoned() -> candle_core::Error {
    internal(OP, "the logsumexp slot is poisoned")
}

/// `(b, t, head_dim)` of `q [b, t, heads * dh]`, `k` and `v` `[b, t, kv_heads * dh]`.
fn grouped_dims(
    [lq, lk, lv]: [&Layout; 3],
    heads: usize,
    kv_heads: usize,
    op: &'static str,
) -> candle_core::Result<(usize, usize, usize)> {
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(KernelError::Mismatch {
            op,
            reason: format!("kv_heads ({kv_heads}) must be > 0 and divide heads ({heads})"),
        }
        .into());
    }
    let (b, t, dh) = match *lq.dims() {
        [b, t, w] if b > 0 && t > 0 && w > 0 && w % heads == 0 => (b, t, w / heads),
        ref d => {
            return Err(KernelError::Shape {
                op,
                what: "q",
                expected: format!("[batch, seq, {heads} heads * head_dim] with no zero size"),
                got: format!("{d:?}"),
            }
            .into())
        }
    };
    for (what, l) in [("k", lk), ("v", lv)] {
        if l.dims() != [b, t, kv_heads * dh] {
            return Err(KernelError::Shape {
                op,
                what,
                expected: format!("[{b}, {t}, {}] ({kv_heads} heads of {dh})", kv_heads * dh),
                got: format!("{:?}", l.dims()),
            }
            .into());
        }
    }
    Ok((b, t, dh))
}

/// Head-major per-query-head rows `src` `[b * heads, t, dh]` to the token-major `dst` `[b, t,
/// heads / groups, dh]`, each output head the sum of its `groups` query heads in head order
/// (in the arithmetic type from zero, as `RepeatKv`'s backward sums; with `groups` 1 a copy).
/// Tokens in parallel blocks.
fn token_major<T: Elem>(
    dst: &mut [T],
    src: &[T],
    (t, heads, groups, dh): (usize, usize, usize, usize),
) -> candle_core::Result<()> {
    let row = heads / groups * dh;
    par_rows(dst, row, row * groups, |r0, rows| {
        let mut acc = vec![<T::F as Float>::ZERO; dh];
        for (r, dst) in rows.chunks_exact_mut(row).enumerate() {
            let (bi, j) = ((r0 + r) / t, (r0 + r) % t);
            for (g, out) in dst.chunks_exact_mut(dh).enumerate() {
                let head = |i: usize| {
                    let at = ((bi * heads + g * groups + i) * t + j) * dh;
                    &src[at..at + dh]
                };
                if groups == 1 {
                    out.copy_from_slice(head(0));
                    continue;
                }
                acc.fill(<T::F as Float>::ZERO);
                for i in 0..groups {
                    for (a, v) in acc.iter_mut().zip(head(i)) {
                        *a += v.load();
                    }
                }
                for (o, &a) in out.iter_mut().zip(&acc) {
                    *o = T::store(a);
                }
            }
        }
    })?;
    Ok(())
}

/// `[dq, dk, dv]` in the inputs' layouts, one after the other, from every query head's
/// gradients.
fn backward<T: Elem>(
    x: &cpu::Qkv<'_, T>,
    g: &cpu::Grads<'_, T>,
    scale: f64,
    (heads, kv_heads): (usize, usize),
) -> candle_core::Result<Vec<T>> {
    let (t, dh, nq) = (x.t, x.dh, x.q.len());
    let (nkv, groups) = (nq / heads * kv_heads, heads / kv_heads);
    // every query head's dq, dk, dv, `[b * heads, t, dh]` each
    let per_head = cpu::backward(x, g, scale)?;
    let (dq_h, rest) = per_head.split_at(nq);
    let (dk_h, dv_h) = rest.split_at(nq);
    let mut out = output_vec::<T>(nq + 2 * nkv);
    let (dq, rest) = out.split_at_mut(nq);
    let (dk, dv) = rest.split_at_mut(nkv);
    token_major(dq, dq_h, (t, heads, 1, dh))?;
    token_major(dk, dk_h, (t, heads, groups, dh))?;
    token_major(dv, dv_h, (t, heads, groups, dh))?;
    Ok(out)
}

impl CustomOp3 for GroupedAttention {
    fn name(&self) -> &'static str {
        "kiln-grouped-attention"
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
        let op = self.name();
        let (heads, kv_heads) = (self.heads, self.kv_heads);
        let (b, t, dh) = grouped_dims([l1, l2, l3], heads, kv_heads, op)?;
        with_float_storage!(s1, op, |qs| {
            let q = contiguous(qs, l1, op)?;
            let k = contiguous(same_type(q, s2, op)?, l2, op)?;
            let v = contiguous(same_type(q, s3, op)?, l3, op)?;
            let x = cpu::Qkv {
                q,
                k,
                v,
                t,
                dh,
                rows: cpu::Rows::Split { heads, kv_heads },
            };
            let (o, lse) = cpu::forward(&x, self.scale)?;
            *self.lse.lock().map_err(|_| poisoned())? = Some(Arc::new(lse));
            let o = interleave_heads(&[&o], b, t, heads, dh)?;
            Ok((Elem::into_storage(o), Shape::from((b, t, heads * dh))))
        })
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.lock().map_err(|_| poisoned())?.clone();
        let lse = lse.ok_or_else(|| internal(OP, "backward without the forward's logsumexp"))?;
        let bwd = GroupedAttentionBwd {
            heads: self.heads,
            kv_heads: self.kv_heads,
            scale: self.scale,
            lse,
            o: o.contiguous()?,
            d_o: grad.to_dtype(o.dtype())?.contiguous()?,
        };
        let all = q.apply_op3_no_bwd(k, v, &bwd)?;
        let (nq, nkv) = (q.elem_count(), k.elem_count());
        Ok((
            Some(all.narrow(0, 0, nq)?.reshape(q.shape())?),
            Some(all.narrow(0, nq, nkv)?.reshape(k.shape())?),
            Some(all.narrow(0, nq + nkv, nkv)?.reshape(v.shape())?),
        ))
    }
}

/// The backward op: `(q, k, v) -> [dq, dk, dv]` flattened one after the other, each in its
/// input's layout, with the forward's output `o`, its gradient `d_o` and logsumexp in the op
/// (see `CausalAttentionBwd` for why they travel as fields).
struct GroupedAttentionBwd {
    heads: usize,
    kv_heads: usize,
    scale: f64,
    lse: Arc<Vec<f64>>,
    o: Tensor,
    d_o: Tensor,
}

impl CustomOp3 for GroupedAttentionBwd {
    fn name(&self) -> &'static str {
        "kiln-grouped-attention-bwd"
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
        let op = self.name();
        let (heads, kv_heads) = (self.heads, self.kv_heads);
        let (b, t, dh) = grouped_dims([l1, l2, l3], heads, kv_heads, op)?;
        let (os, lo) = self.o.storage_and_layout();
        let (gs, lg) = self.d_o.storage_and_layout();
        let (candle_core::Storage::Cpu(os), candle_core::Storage::Cpu(gs)) = (&*os, &*gs) else {
            return Err(KernelError::Device {
                op,
                expected: "the forward's output and its gradient on the CPU",
                got: format!("them on {:?}", self.o.device().location()),
            }
            .into());
        };
        with_float_storage!(s1, op, |qs| {
            let q = contiguous(qs, l1, op)?;
            let k = contiguous(same_type(q, s2, op)?, l2, op)?;
            let v = contiguous(same_type(q, s3, op)?, l3, op)?;
            let o = contiguous(same_type(q, os, op)?, lo, op)?;
            let d_o = contiguous(same_type(q, gs, op)?, lg, op)?;
            let (nq, nkv) = (q.len(), k.len());
            for (what, x) in [("o", o), ("dO", d_o)] {
                if x.len() != nq {
                    return Err(size_error(op, what, nq, x.len()));
                }
            }
            if self.lse.len() * dh != nq {
                return Err(size_error(op, "logsumexp", nq / dh, self.lse.len()));
            }
            let x = cpu::Qkv {
                q,
                k,
                v,
                t,
                dh,
                rows: cpu::Rows::Split { heads, kv_heads },
            };
            let g = cpu::Grads {
                d_o,
                o,
                lse: &self.lse,
            };
            let out = backward(&x, &g, self.scale, (heads, kv_heads))?;
            debug_assert_eq!(out.len(), b * t * (heads + 2 * kv_heads) * dh);
            Ok((Elem::into_storage(out), Shape::from(nq + 2 * nkv)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{CausalAttention, RepeatKv};
    use candle_core::{DType, Device, Var};

    /// `[b, t, n * dh] -> [b, n, t, dh]`, contiguous.
    fn heads_first(x: &Tensor, n: usize) -> candle_core::Result<Tensor> {
        let (b, t, w) = x.dims3()?;
        x.reshape((b, t, n, w / n))?.transpose(1, 2)?.contiguous()
    }

    /// The output and the gradients of q, k, v of `sum(y * r)`.
    fn run(
        f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
        xs: &[Tensor; 3],
        r: &Tensor,
    ) -> candle_core::Result<Vec<Tensor>> {
        let vars = xs
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let y = f(&vars[0], &vars[1], &vars[2])?;
        let grads = (&y * r)?.sum_all()?.backward()?;
        let mut out = vec![y];
        for v in &vars {
            out.push(
                grads
                    .get(v)
                    .ok_or_else(|| internal(OP, "no gradient"))?
                    .clone(),
            );
        }
        Ok(out)
    }

    /// The kernel op is the permute + `RepeatKv` + `CausalAttention` composite bitwise, output
    /// and the three gradients, in every float dtype and grouping, over more than one query
    /// block.
    #[test]
    fn matches_the_repeated_composite_bitwise() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (b, t, heads, dh) = (2, 41, 4, 8);
        for kv in [4, 2, 1] {
            for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                let xs = [heads, kv, kv].map(|n| {
                    Tensor::randn(0f32, 1.0, (b, t, n * dh), &dev).and_then(|x| x.to_dtype(dtype))
                });
                let [q, k, v] = xs;
                let xs = [q?, k?, v?];
                let r = Tensor::randn(0f32, 1.0, (b, t, heads * dh), &dev)?.to_dtype(dtype)?;
                let scale = 0.35;
                let fused = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    q.apply_op3(k, v, GroupedAttention::new(heads, kv, scale))
                };
                let composite = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    let groups = heads / kv;
                    let k = heads_first(k, kv)?.apply_op1(RepeatKv::new(groups))?;
                    let v = heads_first(v, kv)?.apply_op1(RepeatKv::new(groups))?;
                    let y =
                        heads_first(q, heads)?.apply_op3(&k, &v, CausalAttention::new(scale))?;
                    y.transpose(1, 2)?.contiguous()?.reshape((b, t, heads * dh))
                };
                let a = run(&fused, &xs, &r)?;
                let c = run(&composite, &xs, &r)?;
                let bits = |t: &Tensor| -> candle_core::Result<Vec<u64>> {
                    let v = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                    Ok(v.into_iter().map(f64::to_bits).collect())
                };
                for (i, what) in ["y", "dq", "dk", "dv"].iter().enumerate() {
                    assert_eq!(a[i].dims(), c[i].dims(), "{what}");
                    let same = bits(&a[i])? == bits(&c[i])?;
                    assert!(same, "{what} differs, kv_heads {kv}, {dtype:?}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn rejects_mismatched_shapes() {
        let l = |d: &[usize]| Layout::contiguous(d);
        let (q, k) = (l(&[1, 3, 32]), l(&[1, 3, 16]));
        assert!(grouped_dims([&q, &k, &k], 4, 2, OP).is_ok());
        for (heads, kv) in [(4, 3), (0, 1), (4, 0)] {
            let e = grouped_dims([&q, &k, &k], heads, kv, OP).unwrap_err();
            assert!(e.to_string().contains(&format!("kv_heads ({kv})")), "{e}");
        }
        let e = grouped_dims([&q, &l(&[1, 2, 16]), &k], 4, 2, OP).unwrap_err();
        assert!(e.to_string().contains("k has shape [1, 2, 16]"), "{e}");
        let e = grouped_dims([&q, &k, &l(&[1, 3, 8])], 4, 2, OP).unwrap_err();
        assert!(e.to_string().contains("v has shape [1, 3, 8]"), "{e}");
        let e = grouped_dims([&l(&[1, 3, 30]), &k, &k], 4, 2, OP).unwrap_err();
        assert!(e.to_string().contains("q has shape [1, 3, 30]"), "{e}");
    }
}
