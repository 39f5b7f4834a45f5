//! Column- and row-parallel linear layers (Megatron-LM): `Y = X W^T + b` with `W` `[out, in]`
//! split by output features (column) or by input features (row).

use crate::error::{ParallelError, Result};
use crate::tp::ops::{copy_to_tp_region, reduce_from_tp_region, TpComm};
use crate::tp::sequence::{
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use crate::tp::shard::{shard_column, shard_qkv, shard_row};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor, Var};
use kiln_kernels::dense::{linear_backward_parts, AddBias, LinearBias, LinearGrads, LinearNoBias};

/// `x W^T + b` over the last dimension of `x` `[.., in]`, computing in `x`'s dtype (the
/// weight and bias are cast differentiably when stored in another dtype).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (out_f, in_f) = weight.dims2()?;
    let dims = x.dims();
    if dims.last() != Some(&in_f) {
        return Err(ParallelError::Param {
            name: "linear input".into(),
            expected: format!("[.., {in_f}]"),
            got: format!("{dims:?}"),
        });
    }
    let w = weight.to_dtype(x.dtype())?;
    if x.device().is_cpu() {
        // one op, forward and backward, on `x` as it is shaped (`kiln_kernels::dense`): a
        // reshape would be a graph node whose backward fills and adds a gradient of `x`'s size
        let b = bias.map(|b| b.to_dtype(x.dtype())).transpose()?;
        return Ok(linear_cpu(&x.contiguous()?, &w.contiguous()?, b.as_ref())?);
    }
    let rows = x.elem_count() / in_f;
    let x2 = x.contiguous()?.reshape((rows, in_f))?;
    let y = x2.matmul(&w.t()?)?;
    let y = match bias {
        Some(b) => y.broadcast_add(&b.to_dtype(x.dtype())?)?,
        None => y,
    };
    let mut out_dims = dims.to_vec();
    if let Some(last) = out_dims.last_mut() {
        *last = out_f;
    }
    Ok(y.reshape(out_dims)?)
}

/// The column-parallel forward `f(x) W_r^T + b_r`: `x` `[.., in]` is replicated, `weight` is
/// this rank's `[out / tp, in]` rows and `bias` its `[out / tp]`; the output `[.., out / tp]`
/// stays split. Backward, the input gradient is summed over the group by `f`.
pub fn column_parallel_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    comm: &TpComm,
) -> Result<Tensor> {
    linear(&copy_to_tp_region(x, comm)?, weight, bias)
}

/// The row-parallel forward `g(x_r W_r^T) + b`: `x` `[.., in / tp]` is this rank's split input
/// (for instance a column-parallel output), `weight` this rank's `[out, in / tp]` columns and
/// `bias` the whole, replicated `[out]`, added once after the all-reduce `g`. The output
/// `[.., out]` is replicated. With one rank there is nothing to reduce, and the layer is the
/// dense [`linear`] (the bias inside the product).
pub fn row_parallel_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    comm: &TpComm,
) -> Result<Tensor> {
    if comm.world_size() == 1 {
        // no reduction to wait for: the bias goes into the product, as in a dense layer
        return linear(x, weight, bias);
    }
    let y = reduce_from_tp_region(&linear(x, weight, None)?, comm)?;
    match bias {
        Some(b) => add_bias(&y, &b.to_dtype(y.dtype())?),
        None => Ok(y),
    }
}

/// `x W^T (+ b)` for `x` `[rows, in]`, `weight` `[out, in]` and `bias` `[out]`, all CPU tensors
/// of one float dtype; `x` and `weight` contiguous: kiln-kernels' linear op at this thread's
/// [`kiln_kernels::matmul_precision`], recorded on kiln-memory's tape.
pub(crate) fn linear_cpu(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    match bias {
        Some(b) => kiln_memory::tape::apply_op3_split(
            x,
            weight,
            &b.contiguous()?,
            Dense(LinearBias::new()),
        ),
        None => kiln_memory::tape::apply_op2_split(x, weight, Dense(LinearNoBias::new())),
    }
}

/// kiln-kernels' linear op on kiln-memory's tape with its backward in parts
/// ([`kiln_memory::tape::SplitBackward`]): a zero-bubble pipeline schedule computes `dx` in
/// its input-gradient pass and `dW`, `db` in its weight pass.
#[derive(Debug, Clone, Copy)]
struct Dense<O>(O);

/// The parts of the linear op's backward for the inputs `wanted` marks (`x`, the weight, the
/// bias where there is one).
fn dense_parts(
    inputs: &[Tensor],
    grad: &Tensor,
    wanted: &[bool],
    precision: kiln_kernels::MatmulPrecision,
) -> candle_core::Result<Vec<Option<Tensor>>> {
    let (x, w) = match inputs {
        [x, w] | [x, w, _] => (x, w),
        _ => {
            return Err(candle_core::Error::msg(format!(
                "kiln-linear: backward of {} inputs, not 2 or 3",
                inputs.len()
            )))
        }
    };
    let want = LinearGrads {
        x: wanted.first().copied().unwrap_or(false),
        weight: wanted.get(1).copied().unwrap_or(false),
        bias: inputs.len() == 3 && wanted.get(2).copied().unwrap_or(false),
    };
    let (dx, dw, db) = linear_backward_parts(x, w, grad, want, precision)?;
    let mut out = vec![dx, dw];
    if inputs.len() == 3 {
        out.push(db);
    }
    Ok(out)
}

impl kiln_memory::tape::SplitBackward for Dense<LinearBias> {
    fn backward_part(
        &self,
        inputs: &[Tensor],
        grad: &Tensor,
        wanted: &[bool],
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        dense_parts(inputs, grad, wanted, self.0.precision)
    }
}

impl kiln_memory::tape::SplitBackward for Dense<LinearNoBias> {
    fn backward_part(
        &self,
        inputs: &[Tensor],
        grad: &Tensor,
        wanted: &[bool],
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        dense_parts(inputs, grad, wanted, self.0.precision)
    }
}

impl CustomOp3 for Dense<LinearBias> {
    fn name(&self) -> &'static str {
        self.0.name()
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
        self.0.cpu_fwd(s1, l1, s2, l2, s3, l3)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.0.bwd(x, w, b, y, grad)
    }
}

impl CustomOp2 for Dense<LinearNoBias> {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.0.cpu_fwd(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        self.0.bwd(x, w, y, grad)
    }
}

/// `y + b` over the last dimension: on the CPU kiln-kernels' op whose backward sums the bias
/// gradient row by row ([`AddBias`]), elsewhere candle's broadcast add.
fn add_bias(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(if y.device().is_cpu() {
        kiln_memory::tape::apply_op2(&y.contiguous()?, &b.contiguous()?, AddBias)?
    } else {
        y.broadcast_add(b)?
    })
}

/// [`column_parallel_linear`] under sequence parallelism: `x` `[.., s / tp, in]` is this
/// rank's token rows (see [`crate::tp::sequence_parallel_rows`]), all-gathered into the whole
/// `[.., s, in]` before the product; the output `[.., s, out / tp]` stays split by features.
/// Backward, the input gradient is summed over the group and scattered back to the rows
/// (reduce-scatter), which is what `f` and the split together would give.
pub fn column_parallel_linear_sp(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    comm: &TpComm,
) -> Result<Tensor> {
    linear(
        &gather_from_sequence_parallel_region(x, comm)?,
        weight,
        bias,
    )
}

/// [`row_parallel_linear`] under sequence parallelism: the partial products `x_r W_r^T`
/// `[.., s, out]` are reduce-scattered over the group (the all-reduce's sum, each rank keeping
/// its token rows `[.., s / tp, out]`), and the replicated `bias` is added to those rows; its
/// gradient, partial on each rank, is summed over the group ([`copy_to_tp_region`]). Backward,
/// the output gradient's rows are all-gathered. With one rank this is the dense [`linear`].
pub fn row_parallel_linear_sp(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    comm: &TpComm,
) -> Result<Tensor> {
    if comm.world_size() == 1 {
        return linear(x, weight, bias);
    }
    let y = reduce_scatter_to_sequence_parallel_region(&linear(x, weight, None)?, comm)?;
    match bias {
        Some(b) => add_bias(&y, &copy_to_tp_region(&b.to_dtype(y.dtype())?, comm)?),
        None => Ok(y),
    }
}

fn check_bias(bias: Option<&Var>, out: usize, what: &str) -> Result<()> {
    match bias {
        Some(b) if b.dims() != [out] => Err(ParallelError::Param {
            name: what.to_string(),
            expected: format!("[{out}]"),
            got: format!("{:?}", b.dims()),
        }),
        _ => Ok(()),
    }
}

fn group_fmt(comm: &TpComm) -> (usize, usize) {
    (comm.rank(), comm.world_size())
}

/// A column-parallel linear layer: this rank holds rows `rank * out / tp ..` of the weight
/// `[out, in]` and of the bias; input replicated, output split (see
/// [`column_parallel_linear`]). Megatron uses it for the fused QKV projection and fc1.
#[derive(Clone)]
pub struct ColumnParallelLinear {
    weight: Var,
    bias: Option<Var>,
    comm: TpComm,
}

impl std::fmt::Debug for ColumnParallelLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ColumnParallelLinear")
            .field("weight", &self.weight.dims())
            .field("bias", &self.bias.as_ref().map(|b| b.dims().to_vec()))
            .field("rank_of_world", &group_fmt(&self.comm))
            .finish()
    }
}

impl ColumnParallelLinear {
    /// Wraps this rank's shard: weight `[out / tp, in]`, bias `[out / tp]`.
    pub fn new(weight: Var, bias: Option<Var>, comm: TpComm) -> Result<Self> {
        let (out, _) = weight.as_tensor().dims2()?;
        check_bias(bias.as_ref(), out, "column-parallel bias")?;
        Ok(Self { weight, bias, comm })
    }

    /// Takes this rank's shard of a whole layer (weight `[out, in]`, bias `[out]`) with
    /// [`shard_column`], as new `Var`s.
    pub fn from_full(weight: &Tensor, bias: Option<&Tensor>, comm: TpComm) -> Result<Self> {
        let (w, b) = shard_column(weight, bias, comm.world_size(), comm.rank())?;
        Self::new(
            Var::from_tensor(&w)?,
            b.map(|b| Var::from_tensor(&b)).transpose()?,
            comm,
        )
    }

    /// Takes this rank's heads of a whole fused QKV projection (weight `[3d, in]`, bias
    /// `[3d]`) with [`shard_qkv`], as new `Var`s: the output is `[q_r | k_r | v_r]` of
    /// `n_heads / tp` heads.
    pub fn from_full_qkv(
        weight: &Tensor,
        bias: Option<&Tensor>,
        n_heads: usize,
        comm: TpComm,
    ) -> Result<Self> {
        let (w, b) = shard_qkv(weight, bias, n_heads, comm.world_size(), comm.rank())?;
        Self::new(
            Var::from_tensor(&w)?,
            b.map(|b| Var::from_tensor(&b)).transpose()?,
            comm,
        )
    }

    /// `[.., in]` (replicated) to `[.., out / tp]` (this rank's features).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        column_parallel_linear(
            x,
            self.weight.as_tensor(),
            self.bias.as_ref().map(|b| b.as_tensor()),
            &self.comm,
        )
    }

    /// This rank's weight shard `[out / tp, in]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// This rank's bias shard `[out / tp]`, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The tensor-parallel group.
    pub fn comm(&self) -> &TpComm {
        &self.comm
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.weight.dims().get(1).copied().unwrap_or(0)
    }

    /// Output features this rank produces (`out / tp`).
    pub fn local_out_features(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0)
    }

    /// Output features of the whole layer.
    pub fn out_features(&self) -> usize {
        self.local_out_features() * self.comm.world_size()
    }
}

/// A row-parallel linear layer: this rank holds columns `rank * in / tp ..` of the weight
/// `[out, in]`; the bias `[out]` is replicated and added after the reduction. Input split,
/// output replicated (see [`row_parallel_linear`]). Megatron uses it for the attention output
/// projection and fc2.
#[derive(Clone)]
pub struct RowParallelLinear {
    weight: Var,
    bias: Option<Var>,
    comm: TpComm,
}

impl std::fmt::Debug for RowParallelLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowParallelLinear")
            .field("weight", &self.weight.dims())
            .field("bias", &self.bias.as_ref().map(|b| b.dims().to_vec()))
            .field("rank_of_world", &group_fmt(&self.comm))
            .finish()
    }
}

impl RowParallelLinear {
    /// Wraps this rank's shard: weight `[out, in / tp]`, the whole bias `[out]`.
    pub fn new(weight: Var, bias: Option<Var>, comm: TpComm) -> Result<Self> {
        let (out, _) = weight.as_tensor().dims2()?;
        check_bias(bias.as_ref(), out, "row-parallel bias")?;
        Ok(Self { weight, bias, comm })
    }

    /// Takes this rank's shard of a whole layer (weight `[out, in]`, bias `[out]`) with
    /// [`shard_row`], as new `Var`s.
    pub fn from_full(weight: &Tensor, bias: Option<&Tensor>, comm: TpComm) -> Result<Self> {
        let (w, b) = shard_row(weight, bias, comm.world_size(), comm.rank())?;
        Self::new(
            Var::from_tensor(&w)?,
            b.map(|b| Var::from_tensor(&b)).transpose()?,
            comm,
        )
    }

    /// `[.., in / tp]` (this rank's features) to `[.., out]` (replicated).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        row_parallel_linear(
            x,
            self.weight.as_tensor(),
            self.bias.as_ref().map(|b| b.as_tensor()),
            &self.comm,
        )
    }

    /// This rank's weight shard `[out, in / tp]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The replicated bias `[out]`, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The tensor-parallel group.
    pub fn comm(&self) -> &TpComm {
        &self.comm
    }

    /// Input features this rank consumes (`in / tp`).
    pub fn local_in_features(&self) -> usize {
        self.weight.dims().get(1).copied().unwrap_or(0)
    }

    /// Input features of the whole layer.
    pub fn in_features(&self) -> usize {
        self.local_in_features() * self.comm.world_size()
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0)
    }
}
