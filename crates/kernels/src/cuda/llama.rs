//! The launchers of the Llama family's kernels in `ops.cu`: RMSNorm, SwiGLU, the rotary
//! embedding and repeated key/value heads, forward and backward.

use super::ops::func;
use super::{block_for, by_dtype, cfg, elementwise, err, input, int, output, wrap};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

/// RMSNorm forward: `(x [n, d], w [d]) -> y`.
pub(crate) fn rms_norm_fwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-rms-norm";
    let dev = x.0.device();
    by_dtype!(x.0.dtype(), OP, T => {
        let (xv, wv) = (input::<T>(x.0, x.1, OP)?, input::<T>(w.0, w.1, OP)?);
        let d = wv.len();
        if d == 0 || xv.len() % d != 0 {
            return Err(err(OP, format!("x has {} elements, weight {d}", xv.len())));
        }
        let n = xv.len() / d;
        let y = output::<T>(dev, xv.len())?;
        if n > 0 {
            let f = func(dev, "rms_norm_fwd", T::DTYPE)?;
            let (di, e) = (int(OP, d)?, eps as f32);
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&wv).arg(&y).arg(&di).arg(&e);
            // SAFETY: the kernel's arguments match `rms_norm_fwd_*` in ops.cu.
            unsafe { l.launch(cfg(OP, n, block_for(d))?) }.w()?;
        }
        Ok(wrap(y, dev, x.1.shape().clone()))
    })
}

/// RMSNorm backward: `(x, w, dy) -> [n + 1, d]` packing dx and d(weight).
pub(crate) fn rms_norm_bwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-rms-norm-bwd";
    let dev = x.0.device();
    by_dtype!(x.0.dtype(), OP, T => {
        let (xv, wv, gv) = (input::<T>(x.0, x.1, OP)?, input::<T>(w.0, w.1, OP)?, input::<T>(dy.0, dy.1, OP)?);
        let d = wv.len();
        if d == 0 || xv.len() % d != 0 || gv.len() != xv.len() {
            return Err(err(OP, format!("x has {} elements, dy {}, weight {d}", xv.len(), gv.len())));
        }
        let n = xv.len() / d;
        let mut out = output::<T>(dev, (n + 1) * d)?;
        let stats = output::<f32>(dev, n.max(1))?;
        let di = int(OP, d)?;
        {
            let (mut dx, mut dw) = out.split_at_mut(n * d);
            if n > 0 {
                let f = func(dev, "rms_norm_bwd_rows", T::DTYPE)?;
                let e = eps as f32;
                let stream = dev.cuda_stream();
                let mut l = stream.launch_builder(&f);
                l.arg(&xv).arg(&wv).arg(&gv).arg(&mut dx).arg(&stats).arg(&di).arg(&e);
                // SAFETY: arguments as `rms_norm_bwd_rows_*` in ops.cu.
                unsafe { l.launch(cfg(OP, n, block_for(d))?) }.w()?;
            }
            let f = func(dev, "rms_norm_bwd_cols", T::DTYPE)?;
            let ni = int(OP, n)?;
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&gv).arg(&stats).arg(&mut dw).arg(&ni).arg(&di);
            // SAFETY: arguments as `rms_norm_bwd_cols_*` in ops.cu; writes every column.
            unsafe { l.launch(elementwise(OP, d)?) }.w()?;
        }
        Ok(wrap(out, dev, Shape::from((n + 1, d))))
    })
}

/// SwiGLU forward (`x [.., 2n] -> y [.., n]`) or backward (`(x, dy) -> dx [.., 2n]`).
pub(crate) fn swiglu(
    x: (&CudaStorage, &Layout),
    dy: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-swiglu";
    let dev = x.0.device();
    let mut dims = x.1.dims().to_vec();
    let width = dims.last().copied().unwrap_or(0);
    if width == 0 || width % 2 != 0 {
        return Err(err(
            OP,
            format!("x is {dims:?}: it must be [.., 2n] with n > 0"),
        ));
    }
    let n = width / 2;
    by_dtype!(x.0.dtype(), OP, T => {
        let xv = input::<T>(x.0, x.1, OP)?;
        let len = xv.len() / 2;
        let ni = int(OP, n)?;
        let count = len as u64;
        let stream = dev.cuda_stream();
        match dy {
            None => {
                let out = output::<T>(dev, len)?;
                if len > 0 {
                    let f = func(dev, "swiglu_fwd", T::DTYPE)?;
                    let mut l = stream.launch_builder(&f);
                    l.arg(&xv).arg(&out).arg(&count).arg(&ni);
                    // SAFETY: arguments as `swiglu_fwd_*` in ops.cu.
                    unsafe { l.launch(elementwise(OP, len)?) }.w()?;
                }
                if let Some(last) = dims.last_mut() {
                    *last = n;
                }
                Ok(wrap(out, dev, Shape::from(dims)))
            }
            Some(g) => {
                let gv = input::<T>(g.0, g.1, OP)?;
                if gv.len() != len {
                    return Err(err(OP, "dy must have half the elements of x"));
                }
                let out = output::<T>(dev, xv.len())?;
                if len > 0 {
                    let f = func(dev, "swiglu_bwd", T::DTYPE)?;
                    let mut l = stream.launch_builder(&f);
                    l.arg(&xv).arg(&gv).arg(&out).arg(&count).arg(&ni);
                    // SAFETY: arguments as `swiglu_bwd_*` in ops.cu; writes both halves.
                    unsafe { l.launch(elementwise(OP, len)?) }.w()?;
                }
                Ok(wrap(out, dev, x.1.shape().clone()))
            }
        }
    })
}

/// The rotation of the first `heads` heads of each row of `x [.., seq, width]` by `table
/// [seq, head_dim]`; `inverse` for the backward.
pub(crate) fn rotary(
    x: (&CudaStorage, &Layout),
    table: (&CudaStorage, &Layout),
    head_dim: usize,
    heads: usize,
    interleaved: bool,
    inverse: bool,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-rotary";
    let dev = x.0.device();
    let (seq, width) = match x.1.dims() {
        [.., s, w] => (*s, *w),
        d => return Err(err(OP, format!("x is {d:?}: it must be [.., seq, width]"))),
    };
    by_dtype!(x.0.dtype(), OP, T => {
        let (xv, tv) = (input::<T>(x.0, x.1, OP)?, input::<T>(table.0, table.1, OP)?);
        if tv.len() != seq * head_dim || width < heads * head_dim {
            return Err(err(OP, format!("table of {} elements for seq {seq}, head_dim {head_dim}; width {width}", tv.len())));
        }
        let len = xv.len();
        let out = output::<T>(dev, len)?;
        if len > 0 {
            let f = func(dev, "rotary", T::DTYPE)?;
            let count = len as u64;
            let (si, wi, di, hi) = (int(OP, seq)?, int(OP, width)?, int(OP, head_dim)?, int(OP, heads)?);
            let inter = i32::from(interleaved);
            let sign: f32 = if inverse { -1.0 } else { 1.0 };
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&tv).arg(&out).arg(&count).arg(&si).arg(&wi).arg(&di).arg(&hi)
                .arg(&inter).arg(&sign);
            // SAFETY: arguments as `rotary_*` in ops.cu.
            unsafe { l.launch(elementwise(OP, len)?) }.w()?;
        }
        Ok(wrap(out, dev, x.1.shape().clone()))
    })
}

/// Key/value heads repeated `groups` times (`x [batch, kv, ..]` → `[batch, kv x groups, ..]`),
/// or with `sum` the backward's group sums (`[batch, kv x groups, ..]` → `[batch, kv, ..]`).
pub(crate) fn repeat_kv(
    x: (&CudaStorage, &Layout),
    groups: usize,
    sum: bool,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-repeat-kv";
    let dev = x.0.device();
    let mut dims = x.1.dims().to_vec();
    if dims.len() < 2 || groups == 0 || (sum && dims[1] % groups != 0) {
        return Err(err(OP, format!("x is {dims:?} with groups {groups}")));
    }
    let inner: usize = dims[2..].iter().product();
    let kv = if sum { dims[1] / groups } else { dims[1] };
    dims[1] = if sum { kv } else { kv * groups };
    by_dtype!(x.0.dtype(), OP, T => {
        let xv = input::<T>(x.0, x.1, OP)?;
        let len = if sum { xv.len() / groups } else { xv.len() * groups };
        let out = output::<T>(dev, len)?;
        if len > 0 {
            let name = if sum { "repeat_kv_sum" } else { "repeat_kv" };
            let f = func(dev, name, T::DTYPE)?;
            let count = len as u64;
            let (ki, ii, gi) = (int(OP, kv)?, int(OP, inner)?, int(OP, groups)?);
            let stream = dev.cuda_stream();
            let mut l = stream.launch_builder(&f);
            l.arg(&xv).arg(&out).arg(&count).arg(&ki).arg(&ii).arg(&gi);
            // SAFETY: arguments as `repeat_kv_*` / `repeat_kv_sum_*` in ops.cu.
            unsafe { l.launch(elementwise(OP, len)?) }.w()?;
        }
        Ok(wrap(out, dev, Shape::from(dims.clone())))
    })
}
