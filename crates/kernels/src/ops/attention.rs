//! Fused causal attention, `softmax(scale * q k^T, causal) v`, without the `t x t` score matrix,
//! and its backward.
//!
//! The forward keeps one number per query row, the logsumexp `L` of its scaled scores, in the
//! op object (candle keeps that object in the graph, so the backward finds it): the backward
//! recomputes each probability as `exp(scale * q.k - L)` instead of storing them. The CPU
//! kernels (`cpu`) take one head per task and its queries in blocks; the CUDA ones tile queries
//! and keys flash-attention-2 style (`cuda/attn.cu`, launched from `crate::cuda::attn`).

use crate::custom_op::{contiguous, same_type, Elem};
use crate::with_float_storage;
use crate::KernelError;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use std::sync::{Arc, Mutex};

mod cpu;
mod grouped;

pub use grouped::GroupedAttention;

const OP: &str = "causal_attention";
const PACKED_OP: &str = "causal_attention_packed";

/// The largest head dimension of the CUDA kernels ([`CausalAttention`] on CUDA).
pub const MAX_CUDA_HEAD_DIM: usize = 256;

/// The logsumexp of every query row's scaled scores, `[batch * heads * seq]`, as the forward
/// left it for the backward.
#[derive(Clone)]
enum Lse {
    Cpu(Arc<Vec<f64>>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>>),
}

impl Lse {
    fn cpu(&self) -> Option<&[f64]> {
        match self {
            Lse::Cpu(v) => Some(v),
            #[cfg(feature = "cuda")]
            Lse::Cuda(_) => None,
        }
    }
}

/// Causal attention `(q, k, v) -> o` of `[batch, heads, seq, head_dim]` tensors (contiguous,
/// one float dtype; on CUDA f32, f16 or bf16 with `head_dim <=` [`MAX_CUDA_HEAD_DIM`]): row `i`
/// of the output is `sum_j p_ij v_j` over the keys `j <= i`, with `p_i = softmax(scale * q_i .
/// k_j)`. No `seq x seq` matrix exists in the forward or the backward: the op keeps one
/// logsumexp per row from its forward, and its backward recomputes the probabilities from it.
/// Gradients reach `q`, `k` and `v`. One op object serves one forward (and its backward).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::ops::CausalAttention;
/// let q = Tensor::new(&[[[[1f32, 0.], [0., 1.]]]], &Device::Cpu)?; // [1, 1, 2, 2]
/// let v = Tensor::new(&[[[[1f32, 2.], [3., 4.]]]], &Device::Cpu)?;
/// let y = q.apply_op3(&q, &v, CausalAttention::new(1.0))?;
/// // row 0 sees only key 0; row 1 weighs keys 0 and 1 by softmax([0, 1])
/// let p = 1.0 / (1.0 + (-1f32).exp());
/// let r = y.flatten_all()?.to_vec1::<f32>()?;
/// assert_eq!(&r[..2], &[1., 2.]);
/// assert!((r[2] - (1. + 2. * p)).abs() < 1e-6 && (r[3] - (2. + 2. * p)).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct CausalAttention {
    scale: f64,
    lse: Mutex<Option<Lse>>,
}

impl std::fmt::Debug for CausalAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CausalAttention")
            .field("scale", &self.scale)
            .finish_non_exhaustive()
    }
}

impl CausalAttention {
    /// The op for one forward, the scores scaled by `scale` (`1 / sqrt(head_dim)`).
    pub fn new(scale: f64) -> Self {
        Self {
            scale,
            lse: Mutex::new(None),
        }
    }

    fn keep(&self, lse: Lse) -> candle_core::Result<()> {
        let mut slot = self.lse.lock().map_err(|_| poisoned())?;
        *slot = Some(lse);
        Ok(())
    }
}

fn poisoned() -> candle_core::Error {
    internal(OP, "the logsumexp slot is poisoned")
}

/// A failure of the op itself, as a candle error.
fn internal(op: &'static str, reason: &str) -> candle_core::Error {
    KernelError::Internal {
        op,
        reason: reason.into(),
    }
    .into()
}

/// `(seq, head_dim)` of a `[batch, heads, seq, head_dim]` layout.
fn seq_dims(l: &Layout, op: &'static str) -> candle_core::Result<(usize, usize)> {
    match *l.dims() {
        [_, _, t, dh] if t > 0 && dh > 0 => Ok((t, dh)),
        ref d => Err(KernelError::Shape {
            op,
            what: "q",
            expected: "[batch, heads, seq, head_dim] with no zero size".into(),
            got: format!("{d:?}"),
        }
        .into()),
    }
}

fn size_error(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> candle_core::Error {
    KernelError::Shape {
        op,
        what,
        expected: format!("{expected} elements"),
        got: format!("{got} elements"),
    }
    .into()
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "kiln-causal-attention"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (o, shape, lse) =
            crate::cuda::attn::attn_fwd((s1, l1), (s2, l2), (s3, l3), self.scale)?;
        self.keep(Lse::Cuda(Arc::new(lse)))?;
        Ok((o, shape))
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
        let (t, dh) = seq_dims(l1, op)?;
        with_float_storage!(s1, op, |qs| {
            let q = contiguous(qs, l1, op)?;
            let k = contiguous(same_type(q, s2, op)?, l2, op)?;
            let v = contiguous(same_type(q, s3, op)?, l3, op)?;
            for (what, x) in [("k", k), ("v", v)] {
                if x.len() != q.len() {
                    return Err(size_error(op, what, q.len(), x.len()));
                }
            }
            let x = cpu::Qkv {
                q,
                k,
                v,
                t,
                dh,
                rows: cpu::Rows::HeadMajor,
            };
            let (o, lse) = cpu::forward(&x, self.scale)?;
            self.keep(Lse::Cpu(Arc::new(lse)))?;
            Ok((Elem::into_storage(o), l1.shape().clone()))
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
        let bwd = CausalAttentionBwd {
            scale: self.scale,
            lse,
            o: o.contiguous()?,
            d_o: grad.to_dtype(o.dtype())?.contiguous()?,
        };
        let packed = q.apply_op3_no_bwd(k, v, &bwd)?;
        Ok((
            Some(packed.get(0)?),
            Some(packed.get(1)?),
            Some(packed.get(2)?),
        ))
    }
}

/// The backward op: `(q, k, v) -> [dq; dk; dv]` (stacked on a new first dimension), with the
/// forward's output `o`, its gradient `d_o` and logsumexp in the op. A custom op takes three
/// tensors, so `o` and `d_o` travel as fields and the kernels borrow their storage, as
/// candle-flash-attn does with its ALiBi slopes: neither can share storage with q, k or v (`o`
/// is the forward's fresh output, `d_o` a gradient made by the ops after it), so the read locks
/// never meet a writer.
struct CausalAttentionBwd {
    scale: f64,
    lse: Lse,
    o: Tensor,
    d_o: Tensor,
}

/// The storage and layout of a tensor held by an op.
type Held<'a> = (candle_core::StorageRef<'a>, &'a Layout);

impl CausalAttentionBwd {
    fn held(&self) -> (Held<'_>, Held<'_>) {
        (self.o.storage_and_layout(), self.d_o.storage_and_layout())
    }

    fn wrong_device(&self) -> candle_core::Error {
        KernelError::Device {
            op: self.name(),
            expected: "the forward's output, its gradient and q, k, v on one device",
            got: "them on several".into(),
        }
        .into()
    }
}

impl CustomOp3 for CausalAttentionBwd {
    fn name(&self) -> &'static str {
        "kiln-causal-attention-bwd"
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let Lse::Cuda(lse) = &self.lse else {
            return Err(self.wrong_device());
        };
        let ((o, lo), (g, lg)) = self.held();
        let (candle_core::Storage::Cuda(o), candle_core::Storage::Cuda(g)) = (&*o, &*g) else {
            return Err(self.wrong_device());
        };
        crate::cuda::attn::attn_bwd(
            [(s1, l1), (s2, l2), (s3, l3), (o, lo), (g, lg)],
            lse,
            self.scale,
        )
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
        let (t, dh) = seq_dims(l1, op)?;
        let lse = self.lse.cpu().ok_or_else(|| self.wrong_device())?;
        let ((os, lo), (gs, lg)) = self.held();
        let (candle_core::Storage::Cpu(os), candle_core::Storage::Cpu(gs)) = (&*os, &*gs) else {
            return Err(self.wrong_device());
        };
        with_float_storage!(s1, op, |qs| {
            let q = contiguous(qs, l1, op)?;
            let k = contiguous(same_type(q, s2, op)?, l2, op)?;
            let v = contiguous(same_type(q, s3, op)?, l3, op)?;
            let o = contiguous(same_type(q, os, op)?, lo, op)?;
            let d_o = contiguous(same_type(q, gs, op)?, lg, op)?;
            let n = q.len();
            for (what, x) in [("k", k), ("v", v), ("o", o), ("dO", d_o)] {
                if x.len() != n {
                    return Err(size_error(op, what, n, x.len()));
                }
            }
            if lse.len() * dh != n {
                return Err(size_error(op, "logsumexp", n / dh, lse.len()));
            }
            let out = cpu::backward(
                &cpu::Qkv {
                    q,
                    k,
                    v,
                    t,
                    dh,
                    rows: cpu::Rows::HeadMajor,
                },
                &cpu::Grads { d_o, o, lse },
                self.scale,
            )?;
            let mut dims = vec![3];
            dims.extend_from_slice(l1.dims());
            Ok((Elem::into_storage(out), Shape::from(dims)))
        })
    }
}

/// `(b, t, head_dim)` of a packed `[b, t, 3 * heads * head_dim]` layout.
fn packed_dims(
    l: &Layout,
    heads: usize,
    op: &'static str,
) -> candle_core::Result<(usize, usize, usize)> {
    match *l.dims() {
        [b, t, w] if heads > 0 && b > 0 && t > 0 && w > 0 && w % (3 * heads) == 0 => {
            Ok((b, t, w / (3 * heads)))
        }
        ref d => Err(KernelError::Shape {
            op,
            what: "qkv",
            expected: format!("[batch, seq, 3 * {heads} heads * head_dim] with no zero size"),
            got: format!("{d:?}"),
        }
        .into()),
    }
}

/// Head-major parts `[b * heads, t, dh]` each, interleaved into `[b, t, parts, heads, dh]`:
/// the packed layout of `o` (one part) and of the gradient of `qkv` (three). Tokens in
/// parallel blocks, every element written once.
fn interleave_heads<T: Copy + Send + Sync>(
    parts: &[&[T]],
    b: usize,
    t: usize,
    heads: usize,
    dh: usize,
) -> candle_core::Result<Vec<T>> {
    let row = parts.len() * heads * dh;
    let len = b * t * row;
    let mut out: Vec<T> = Vec::with_capacity(len);
    crate::custom_op::par_rows(
        &mut out.spare_capacity_mut()[..len],
        row,
        row,
        |r0, rows| {
            for (r, dst) in rows.chunks_exact_mut(row).enumerate() {
                let (bi, j) = ((r0 + r) / t, (r0 + r) % t);
                let mut d = dst.chunks_exact_mut(dh);
                for part in parts {
                    for h in 0..heads {
                        let at = ((bi * heads + h) * t + j) * dh;
                        if let Some(d) = d.next() {
                            for (o, &v) in d.iter_mut().zip(&part[at..at + dh]) {
                                o.write(v);
                            }
                        }
                    }
                }
            }
        },
    )?;
    // SAFETY: `par_rows` returned Ok, so every block of rows ran, and each wrote all of its
    // rows' `parts * heads` runs of `dh` values: the first `len` elements, inside the capacity
    unsafe { out.set_len(len) };
    Ok(out)
}

/// [`CausalAttention`] straight from a fused QKV projection's output, on the CPU: `qkv` `[batch,
/// seq, 3 * heads * head_dim]` holds each token's queries, keys and values for every head, in
/// that order (`[b, t, 3, heads, head_dim]`), and the output is `[batch, seq, heads *
/// head_dim]`, the heads side by side. The same numbers as splitting, permuting and applying
/// [`CausalAttention`], bitwise, but one graph node: the kernels read the rows where they are,
/// and the backward writes the gradient of `qkv` once. One op object serves one forward.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::ops::PackedAttention;
/// let qkv = Tensor::randn(0f32, 1.0, (2, 5, 3 * 4 * 8), &Device::Cpu)?; // 4 heads of 8
/// let y = qkv.apply_op1(PackedAttention::new(4, 0.125))?;
/// assert_eq!(y.dims(), &[2, 5, 32]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct PackedAttention {
    heads: usize,
    scale: f64,
    lse: Mutex<Option<Arc<Vec<f64>>>>,
}

impl std::fmt::Debug for PackedAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedAttention")
            .field("heads", &self.heads)
            .field("scale", &self.scale)
            .finish_non_exhaustive()
    }
}

impl PackedAttention {
    /// The op for one forward over `heads` heads, the scores scaled by `scale`.
    pub fn new(heads: usize, scale: f64) -> Self {
        Self {
            heads,
            scale,
            lse: Mutex::new(None),
        }
    }
}

impl candle_core::CustomOp1 for PackedAttention {
    fn name(&self) -> &'static str {
        "kiln-causal-attention-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (b, t, dh) = packed_dims(l, self.heads, op)?;
        with_float_storage!(s, op, |xs| {
            let x = contiguous(xs, l, op)?;
            let qkv = cpu::Qkv {
                q: x,
                k: x,
                v: x,
                t,
                dh,
                rows: cpu::Rows::Packed { heads: self.heads },
            };
            let (o, lse) = cpu::forward(&qkv, self.scale)?;
            *self.lse.lock().map_err(|_| poisoned())? = Some(Arc::new(lse));
            let o = interleave_heads(&[&o], b, t, self.heads, dh)?;
            Ok((Elem::into_storage(o), Shape::from((b, t, self.heads * dh))))
        })
    }

    fn bwd(&self, qkv: &Tensor, o: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let lse = self.lse.lock().map_err(|_| poisoned())?.clone();
        let lse =
            lse.ok_or_else(|| internal(PACKED_OP, "backward without the forward's logsumexp"))?;
        let bwd = PackedAttentionBwd {
            heads: self.heads,
            scale: self.scale,
            lse,
            o: o.contiguous()?,
            d_o: grad.to_dtype(o.dtype())?.contiguous()?,
        };
        Ok(Some(qkv.apply_op1_no_bwd(&bwd)?))
    }
}

/// The packed backward op: `qkv -> d qkv` (same layout), with the forward's output `o`, its
/// gradient and logsumexp in the op (see [`CausalAttentionBwd`] for why they travel as fields).
struct PackedAttentionBwd {
    heads: usize,
    scale: f64,
    lse: Arc<Vec<f64>>,
    o: Tensor,
    d_o: Tensor,
}

impl candle_core::CustomOp1 for PackedAttentionBwd {
    fn name(&self) -> &'static str {
        "kiln-causal-attention-packed-bwd"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = self.name();
        let heads = self.heads;
        let (b, t, dh) = packed_dims(l, heads, op)?;
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
        with_float_storage!(s, op, |xs| {
            let x = contiguous(xs, l, op)?;
            let o = contiguous(same_type(x, os, op)?, lo, op)?;
            let d_o = contiguous(same_type(x, gs, op)?, lg, op)?;
            let n = b * t * heads * dh;
            for (what, v) in [("o", o), ("dO", d_o)] {
                if v.len() != n {
                    return Err(size_error(op, what, n, v.len()));
                }
            }
            if self.lse.len() * dh != n {
                return Err(size_error(op, "logsumexp", n / dh, self.lse.len()));
            }
            let rows = cpu::Rows::Packed { heads };
            let out = cpu::backward(
                &cpu::Qkv {
                    q: x,
                    k: x,
                    v: x,
                    t,
                    dh,
                    rows,
                },
                &cpu::Grads {
                    d_o,
                    o,
                    lse: &self.lse,
                },
                self.scale,
            )?;
            let (dq, rest) = out.split_at(n);
            let (dk, dv) = rest.split_at(n);
            let d = interleave_heads(&[dq, dk, dv], b, t, heads, dh)?;
            Ok((Elem::into_storage(d), l.shape().clone()))
        })
    }
}
