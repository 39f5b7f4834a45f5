//! The launchers of `ops.cu`: layer norm, causal softmax, GELU (plain and with a bias),
//! cross-entropy, forward and backward.

use super::{block_for, by_dtype, cfg, elementwise, err, input, int, output, wrap};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaView, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, WithDType};

/// The kernels, as PTX for the compute capability the build was configured for.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kiln_kernels_ops.ptx"));
const MODULE: &str = "kiln_kernels_ops";

pub(crate) fn func(dev: &CudaDevice, name: &str, dtype: DType) -> Result<CudaFunction> {
    plain_func(dev, &format!("{name}_{}", dtype.as_str()))
}

fn plain_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

/// The u32 targets of a cross-entropy.
fn targets<'a>(s: &'a CudaStorage, l: &Layout, op: &'static str) -> Result<CudaView<'a, u32>> {
    let slice = s.as_cuda_slice::<u32>()?;
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| err(op, "targets are not contiguous"))?;
    Ok(slice.slice(a..b))
}

/// `layer_norm` forward: `(x [n, d], w [d], b [d]) -> y`.
pub(crate) fn layer_norm_fwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-layer-norm";
    let dev = x.0.device();
    by_dtype!(x.0.dtype(), OP, T => {
        let (xv, wv, bv) = (input::<T>(x.0, x.1, OP)?, input::<T>(w.0, w.1, OP)?, input::<T>(b.0, b.1, OP)?);
        let d = wv.len();
        let n = xv.len().checked_div(d).unwrap_or(0);
        let y = output::<T>(dev, xv.len())?;
        if n > 0 {
            let f = func(dev, "layer_norm_fwd", T::DTYPE)?;
            let (di, e) = (int(OP, d)?, eps as f32);
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&wv).arg(&bv).arg(&y).arg(&di).arg(&e);
            // SAFETY: the kernel's arguments match `layer_norm_fwd_*` in ops.cu.
            unsafe { l.launch(cfg(OP, n, block_for(d))?) }.w()?;
        }
        Ok(wrap(y, dev, x.1.shape().clone()))
    })
}

/// `layer_norm` backward: `(x, w, dy) -> [n + 2, d]` packing dx, d(weight), d(bias).
pub(crate) fn layer_norm_bwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-layer-norm-bwd";
    let dev = x.0.device();
    by_dtype!(x.0.dtype(), OP, T => {
        let (xv, wv, gv) = (input::<T>(x.0, x.1, OP)?, input::<T>(w.0, w.1, OP)?, input::<T>(dy.0, dy.1, OP)?);
        let d = wv.len();
        if d == 0 || xv.len() % d != 0 || gv.len() != xv.len() {
            return Err(err(OP, format!("x has {} elements, dy {}, weight {d}", xv.len(), gv.len())));
        }
        let n = xv.len() / d;
        let mut out = output::<T>(dev, (n + 2) * d)?;
        let stats = output::<f32>(dev, 2 * n.max(1))?;
        let di = int(OP, d)?;
        {
            let (mut dx, mut rest) = out.split_at_mut(n * d);
            let (mut dw, mut db) = rest.split_at_mut(d);
            if n > 0 {
                let f = func(dev, "layer_norm_bwd_rows", T::DTYPE)?;
                let e = eps as f32;
                let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
                l.arg(&xv).arg(&wv).arg(&gv).arg(&mut dx).arg(&stats).arg(&di).arg(&e);
                // SAFETY: arguments as `layer_norm_bwd_rows_*` in ops.cu.
                unsafe { l.launch(cfg(OP, n, block_for(d))?) }.w()?;
            }
            let f = func(dev, "layer_norm_bwd_cols", T::DTYPE)?;
            let ni = int(OP, n)?;
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&gv).arg(&stats).arg(&mut dw).arg(&mut db).arg(&ni).arg(&di);
            // SAFETY: arguments as `layer_norm_bwd_cols_*` in ops.cu; writes every column.
            unsafe { l.launch(elementwise(OP, d)?) }.w()?;
        }
        Ok(wrap(out, dev, Shape::from((n + 2, d))))
    })
}

/// Causal softmax forward (`bwd == false`: `x -> y`) or backward (`(y, dy) -> dx`) over the
/// last two dimensions `[.., tq, tk]` of `layout`.
pub(crate) fn causal_softmax(
    a: (&CudaStorage, &Layout),
    dy: Option<(&CudaStorage, &Layout)>,
    scale: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-causal-softmax";
    let dev = a.0.device();
    let dims = a.1.dims();
    if dims.len() < 2 {
        return Err(err(OP, format!("expected [.., tq, tk], got {dims:?}")));
    }
    let (tq, tk) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    by_dtype!(a.0.dtype(), OP, T => {
        let av = input::<T>(a.0, a.1, OP)?;
        let rows = av.len().checked_div(tk).unwrap_or(0);
        let out = output::<T>(dev, av.len())?;
        if rows > 0 {
            let (tqi, tki, s) = (int(OP, tq)?, int(OP, tk)?, scale as f32);
            let cfg = cfg(OP, rows, block_for(tk))?;
            match dy {
                None => {
                    let f = func(dev, "causal_softmax_fwd", T::DTYPE)?;
                    let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
                    l.arg(&av).arg(&out).arg(&tqi).arg(&tki).arg(&s);
                    // SAFETY: arguments as `causal_softmax_fwd_*` in ops.cu.
                    unsafe { l.launch(cfg) }.w()?;
                }
                Some(g) => {
                    let gv = input::<T>(g.0, g.1, OP)?;
                    if gv.len() != av.len() {
                        return Err(err(OP, "dy and y differ in size"));
                    }
                    let f = func(dev, "causal_softmax_bwd", T::DTYPE)?;
                    let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
                    l.arg(&av).arg(&gv).arg(&out).arg(&tqi).arg(&tki).arg(&s);
                    // SAFETY: arguments as `causal_softmax_bwd_*` in ops.cu.
                    unsafe { l.launch(cfg) }.w()?;
                }
            }
        }
        Ok(wrap(out, dev, a.1.shape().clone()))
    })
}

/// GELU forward (`x -> y`) or backward (`(x, dy) -> dx`), element-wise.
pub(crate) fn gelu(
    x: (&CudaStorage, &Layout),
    dy: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-gelu";
    let dev = x.0.device();
    by_dtype!(x.0.dtype(), OP, T => {
        let xv = input::<T>(x.0, x.1, OP)?;
        let len = xv.len();
        let out = output::<T>(dev, len)?;
        if len > 0 {
            let n = len as u64;
            match dy {
                None => {
                    let f = func(dev, "gelu_fwd", T::DTYPE)?;
                    let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
                    l.arg(&xv).arg(&out).arg(&n);
                    // SAFETY: arguments as `gelu_fwd_*` in ops.cu.
                    unsafe { l.launch(elementwise(OP, len)?) }.w()?;
                }
                Some(g) => {
                    let gv = input::<T>(g.0, g.1, OP)?;
                    if gv.len() != len {
                        return Err(err(OP, "dy and x differ in size"));
                    }
                    let f = func(dev, "gelu_bwd", T::DTYPE)?;
                    let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
                    l.arg(&xv).arg(&gv).arg(&out).arg(&n);
                    // SAFETY: arguments as `gelu_bwd_*` in ops.cu.
                    unsafe { l.launch(elementwise(OP, len)?) }.w()?;
                }
            }
        }
        Ok(wrap(out, dev, x.1.shape().clone()))
    })
}

/// `gelu(x + b)` forward, `b` `[n]` broadcast over the last dimension.
pub(crate) fn bias_gelu_fwd(
    x: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-bias-gelu";
    let dev = x.0.device();
    by_dtype!(x.0.dtype(), OP, T => {
        let (xv, bv) = (input::<T>(x.0, x.1, OP)?, input::<T>(b.0, b.1, OP)?);
        let (len, n) = (xv.len(), bv.len());
        if n == 0 || len % n != 0 {
            return Err(err(OP, "bias does not fit x"));
        }
        let out = output::<T>(dev, len)?;
        if len > 0 {
            let f = func(dev, "bias_gelu_fwd", T::DTYPE)?;
            let (lu, ni) = (len as u64, int(OP, n)?);
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&bv).arg(&out).arg(&lu).arg(&ni);
            // SAFETY: arguments as `bias_gelu_fwd_*` in ops.cu.
            unsafe { l.launch(elementwise(OP, len)?) }.w()?;
        }
        Ok(wrap(out, dev, x.1.shape().clone()))
    })
}

/// `gelu(x + b)` backward: `(x, b, dy) -> [rows + 1, n]` packing dx and d(bias).
pub(crate) fn bias_gelu_bwd(
    x: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-bias-gelu-bwd";
    let dev = x.0.device();
    by_dtype!(x.0.dtype(), OP, T => {
        let (xv, bv, gv) = (input::<T>(x.0, x.1, OP)?, input::<T>(b.0, b.1, OP)?, input::<T>(dy.0, dy.1, OP)?);
        let (len, n) = (xv.len(), bv.len());
        if n == 0 || len % n != 0 || gv.len() != len {
            return Err(err(OP, "sizes disagree"));
        }
        let rows = len / n;
        let mut out = output::<T>(dev, len + n)?;
        {
            let (mut dx, mut db) = out.split_at_mut(len);
            let ni = int(OP, n)?;
            if len > 0 {
                let f = func(dev, "bias_gelu_bwd_rows", T::DTYPE)?;
                let lu = len as u64;
                let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
                l.arg(&xv).arg(&bv).arg(&gv).arg(&mut dx).arg(&lu).arg(&ni);
                // SAFETY: arguments as `bias_gelu_bwd_rows_*` in ops.cu.
                unsafe { l.launch(elementwise(OP, len)?) }.w()?;
            }
            let f = func(dev, "bias_gelu_bwd_cols", T::DTYPE)?;
            let ri = int(OP, rows)?;
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&bv).arg(&gv).arg(&mut db).arg(&ri).arg(&ni);
            // SAFETY: arguments as `bias_gelu_bwd_cols_*` in ops.cu; writes every column.
            unsafe { l.launch(elementwise(OP, n)?) }.w()?;
        }
        Ok(wrap(out, dev, Shape::from((rows + 1, n))))
    })
}

/// The ignore index as the kernels take it: `(has_ignore, ignore)`.
fn ignore_args(ignore: Option<u32>) -> (i32, u32) {
    (i32::from(ignore.is_some()), ignore.unwrap_or(0))
}

/// Cross-entropy forward: `(logits [n, v], targets [n]) -> mean loss` (an f32 scalar).
pub(crate) fn cross_entropy_fwd(
    x: (&CudaStorage, &Layout),
    t: (&CudaStorage, &Layout),
    ignore: Option<u32>,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-cross-entropy";
    let dev = x.0.device();
    let tv = targets(t.0, t.1, OP)?;
    let n = tv.len();
    let v = x.1.dims().last().copied().unwrap_or(0);
    if v == 0 || x.1.shape().elem_count() != n * v {
        return Err(err(OP, "logits and targets disagree"));
    }
    let (has, ign) = ignore_args(ignore);
    let (ni, vi) = (int(OP, n)?, int(OP, v)?);
    let per_row = output::<f64>(dev, n.max(1))?;
    by_dtype!(x.0.dtype(), OP, T => {
        let xv = input::<T>(x.0, x.1, OP)?;
        if n > 0 {
            let f = func(dev, "cross_entropy_rows", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&tv).arg(&per_row).arg(&vi).arg(&has).arg(&ign);
            // SAFETY: arguments as `cross_entropy_rows_*` in ops.cu.
            unsafe { l.launch(cfg(OP, n, block_for(v))?) }.w()?;
        }
        Ok::<(), candle_core::Error>(())
    })?;
    let out = output::<f32>(dev, 1)?;
    let f = plain_func(dev, "cross_entropy_mean")?;
    let stream = dev.cuda_stream();
    let mut l = stream.launch_builder(&f);
    l.arg(&per_row)
        .arg(&tv)
        .arg(&out)
        .arg(&ni)
        .arg(&has)
        .arg(&ign);
    // SAFETY: arguments as `cross_entropy_mean` in ops.cu; one block writes the one output.
    unsafe { l.launch(cfg(OP, 1, 1024)?) }.w()?;
    Ok(wrap(out, dev, Shape::from(())))
}

/// Cross-entropy backward: `(logits, targets) -> grad * (softmax - onehot) / count`.
pub(crate) fn cross_entropy_bwd(
    x: (&CudaStorage, &Layout),
    t: (&CudaStorage, &Layout),
    ignore: Option<u32>,
    grad: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-cross-entropy-bwd";
    let dev = x.0.device();
    let tv = targets(t.0, t.1, OP)?;
    let n = tv.len();
    let v = x.1.dims().last().copied().unwrap_or(0);
    if v == 0 || x.1.shape().elem_count() != n * v {
        return Err(err(OP, "logits and targets disagree"));
    }
    let (has, ign) = ignore_args(ignore);
    let (ni, vi) = (int(OP, n)?, int(OP, v)?);
    let count = output::<i32>(dev, 1)?;
    let f = plain_func(dev, "cross_entropy_count")?;
    let stream = dev.cuda_stream();
    let mut l = stream.launch_builder(&f);
    l.arg(&tv).arg(&count).arg(&ni).arg(&has).arg(&ign);
    // SAFETY: arguments as `cross_entropy_count` in ops.cu.
    unsafe { l.launch(cfg(OP, 1, 1024)?) }.w()?;
    by_dtype!(x.0.dtype(), OP, T => {
        let xv = input::<T>(x.0, x.1, OP)?;
        let out = output::<T>(dev, xv.len())?;
        if n > 0 {
            let f = func(dev, "cross_entropy_bwd", T::DTYPE)?;
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&tv).arg(&count).arg(&out).arg(&vi).arg(&has).arg(&ign).arg(&grad);
            // SAFETY: arguments as `cross_entropy_bwd_*` in ops.cu.
            unsafe { l.launch(cfg(OP, n, block_for(v))?) }.w()?;
        }
        Ok(wrap(out, dev, x.1.shape().clone()))
    })
}
