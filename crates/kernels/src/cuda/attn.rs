//! The launchers of `attn.cu`, the CUDA side of [`CausalAttention`](crate::ops::CausalAttention):
//! compiled to PTX by build.rs and loaded once per device. f32, f16 and bf16
//! storage, computed in f32; inputs contiguous `[batch, heads, seq, head_dim]`, as the op's
//! front end makes them.
//!
//! Each kernel exists per head-dimension bound `DMAX` (16, 32, 64, 128, 256: the head dim
//! rounded up). The launch shape below mirrors `Tile<DMAX>` in attn.cu: `G = DMAX / 16` threads
//! share one row, a block owns `min(64, 256 / G)` rows, grid x is the head, grid y the row tile.

use super::{by_dtype, err, input, int, output, wrap};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, WithDType};

/// The kernels, as PTX for the compute capability the build was configured for.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kiln_kernels_attn.ptx"));
const MODULE: &str = "kiln_kernels_attn";

/// The head-dimension bounds the kernels are instantiated for.
const DMAX: [usize; 5] = [16, 32, 64, 128, 256];

/// The launch shape of one `DMAX` instantiation.
struct Tiling {
    dmax: usize,
    /// Rows (queries, or keys for the dK/dV kernel) a block owns.
    rows: usize,
    threads: u32,
}

fn tiling(op: &'static str, dh: usize) -> Result<Tiling> {
    let dmax = DMAX
        .into_iter()
        .find(|&d| d >= dh)
        .ok_or_else(|| err(op, format!("head_dim {dh} exceeds the kernels' 256")))?;
    let g = dmax / 16;
    let rows = (256 / g).min(64);
    Ok(Tiling {
        dmax,
        rows,
        threads: (rows * g) as u32,
    })
}

fn func(dev: &CudaDevice, name: &str, dtype: DType, dmax: Option<usize>) -> Result<CudaFunction> {
    let name = match dmax {
        Some(d) => format!("{name}_{}_d{d}", dtype.as_str()),
        None => format!("{name}_{}", dtype.as_str()),
    };
    Ok(dev
        .get_or_load_custom_func(&name, MODULE, PTX)?
        .into_cuda_function())
}

/// Grid x: the `heads` (batch times heads); grid y: the tiles of `rows` rows of `t`.
fn grid(op: &'static str, heads: usize, t: usize, tl: &Tiling) -> Result<LaunchConfig> {
    let x = u32::try_from(heads)
        .ok()
        .filter(|&x| x < i32::MAX as u32)
        .ok_or_else(|| err(op, format!("{heads} heads is too many for one launch")))?;
    let tiles = t.div_ceil(tl.rows);
    let y = u32::try_from(tiles)
        .ok()
        .filter(|&y| y <= 65_535)
        .ok_or_else(|| err(op, format!("a sequence of {t} is too long for one launch")))?;
    Ok(LaunchConfig {
        grid_dim: (x, y, 1),
        block_dim: (tl.threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `(batch * heads, seq, head_dim)` of a `[batch, heads, seq, head_dim]` layout.
fn dims(l: &Layout, op: &'static str) -> Result<(usize, usize, usize)> {
    match *l.dims() {
        [b, h, t, dh] if t > 0 && dh > 0 => Ok((b * h, t, dh)),
        ref d => Err(err(
            op,
            format!("expected [batch, heads, seq, head_dim], got {d:?}"),
        )),
    }
}

/// Forward: `(q, k, v) -> (o, lse)`, `lse` the f32 logsumexp of every row's scaled scores.
pub(crate) fn attn_fwd(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    scale: f64,
) -> Result<(CudaStorage, Shape, CudaSlice<f32>)> {
    const OP: &str = "kiln-causal-attention";
    let dev = q.0.device();
    let (heads, t, dh) = dims(q.1, OP)?;
    let tl = tiling(OP, dh)?;
    by_dtype!(q.0.dtype(), OP, T => {
        let (qv, kv, vv) = (input::<T>(q.0, q.1, OP)?, input::<T>(k.0, k.1, OP)?, input::<T>(v.0, v.1, OP)?);
        let n = heads * t * dh;
        if qv.len() != n || kv.len() != n || vv.len() != n {
            return Err(err(OP, format!("q, k, v have {}, {}, {} elements, expected {n}", qv.len(), kv.len(), vv.len())));
        }
        let o = output::<T>(dev, n)?;
        let lse = output::<f32>(dev, heads * t)?;
        let f = func(dev, "attn_fwd", T::DTYPE, Some(tl.dmax))?;
        let (ti, di, s) = (int(OP, t)?, int(OP, dh)?, scale as f32);
        let stream = dev.cuda_stream();
        let mut l = stream.launch_builder(&f);
        l.arg(&qv).arg(&kv).arg(&vv).arg(&o).arg(&lse).arg(&ti).arg(&di).arg(&s);
        // SAFETY: the arguments match `attn_fwd_*` in attn.cu; the grid covers every row of
        // every head, so every element of `o` and `lse` is written.
        unsafe { l.launch(grid(OP, heads, t, &tl)?) }.w()?;
        let (storage, shape) = wrap(o, dev, q.1.shape().clone());
        Ok((storage, shape, lse))
    })
}

/// Backward: `(q, k, v, o, dO)` and the forward's `lse` -> `[dq; dk; dv]`, stacked on a new
/// first dimension.
pub(crate) fn attn_bwd(
    inputs: [(&CudaStorage, &Layout); 5],
    lse: &CudaSlice<f32>,
    scale: f64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "kiln-causal-attention-bwd";
    let q = inputs[0];
    let dev = q.0.device();
    let (heads, t, dh) = dims(q.1, OP)?;
    let tl = tiling(OP, dh)?;
    let rows = heads * t;
    let n = rows * dh;
    if lse.len() != rows {
        return Err(err(
            OP,
            format!("logsumexp has {} rows, expected {rows}", lse.len()),
        ));
    }
    let mut out_dims = vec![3];
    out_dims.extend_from_slice(q.1.dims());
    by_dtype!(q.0.dtype(), OP, T => {
        let mut views = Vec::with_capacity(5);
        for (what, x) in ["q", "k", "v", "o", "dO"].into_iter().zip(inputs) {
            let view = input::<T>(x.0, x.1, OP)?;
            if view.len() != n {
                return Err(err(OP, format!("{what} has {} elements, expected {n}", view.len())));
            }
            views.push(view);
        }
        let [qv, kv, vv, ov, dov] = <[_; 5]>::try_from(views).map_err(|_| err(OP, "five inputs"))?;
        let (ti, di, ri, s) = (int(OP, t)?, int(OP, dh)?, int(OP, rows)?, scale as f32);
        let stream = dev.cuda_stream();
        // D = rowsum(dO * o): one warp per row, 8 rows per block
        let delta = output::<f32>(dev, rows)?;
        let f = func(dev, "attn_delta", T::DTYPE, None)?;
        let mut l = stream.launch_builder(&f);
        l.arg(&ov).arg(&dov).arg(&delta).arg(&ri).arg(&di);
        let blocks = u32::try_from(rows.div_ceil(8)).map_err(|_| err(OP, format!("{rows} rows is too many")))?;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match `attn_delta_*` in attn.cu; one warp writes each row.
        unsafe { l.launch(cfg) }.w()?;
        let mut out = output::<T>(dev, 3 * n)?;
        {
            let (mut dq, mut rest) = out.split_at_mut(n);
            let (mut dk, mut dv) = rest.split_at_mut(n);
            let cfg = grid(OP, heads, t, &tl)?;
            let f = func(dev, "attn_bwd_dkv", T::DTYPE, Some(tl.dmax))?;
            let mut l = stream.launch_builder(&f);
            l.arg(&qv).arg(&kv).arg(&vv).arg(&dov).arg(lse).arg(&delta).arg(&mut dk).arg(&mut dv)
                .arg(&ti).arg(&di).arg(&s);
            // SAFETY: the arguments match `attn_bwd_dkv_*` in attn.cu; the grid covers every
            // key row of every head, so all of dk and dv is written.
            unsafe { l.launch(cfg) }.w()?;
            let f = func(dev, "attn_bwd_dq", T::DTYPE, Some(tl.dmax))?;
            let mut l = stream.launch_builder(&f);
            l.arg(&qv).arg(&kv).arg(&vv).arg(&dov).arg(lse).arg(&delta).arg(&mut dq)
                .arg(&ti).arg(&di).arg(&s);
            // SAFETY: the arguments match `attn_bwd_dq_*` in attn.cu; the grid covers every
            // query row of every head, so all of dq is written.
            unsafe { l.launch(cfg) }.w()?;
        }
        Ok(wrap(out, dev, Shape::from(out_dims)))
    })
}
