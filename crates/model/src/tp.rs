//! [`TensorParallelFactory`]: Megatron-LM linear layers for [`crate::Gpt`] through the
//! [`LayerFactory`] seam.

use crate::error::Result;
use crate::init::Initializer;
use crate::linear::{
    init_linear, LayerFactory, LinearKind, LinearLayer, LinearSpec, ParallelStyle,
};
use crate::params::ParamSource;
use candle_core::{Tensor, Var};
use kiln_parallel::tp::{
    column_parallel_linear, column_parallel_linear_sp, row_parallel_linear, row_parallel_linear_sp,
    shard_column, shard_qkv, shard_row, TpComm,
};

/// Builds column-parallel QKV (split by heads) and fc1, and row-parallel attention output and
/// fc2, over a tensor-parallel group. Each weight is initialised whole from its `(seed, name)`
/// stream and then sharded, so the layers equal the dense ones at any degree.
#[derive(Clone)]
pub struct TensorParallelFactory {
    comm: TpComm,
    n_heads: usize,
    sequence_parallel: bool,
}

impl std::fmt::Debug for TensorParallelFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallelFactory")
            .field("tp", &self.comm.world_size())
            .field("rank", &self.comm.rank())
            .field("n_heads", &self.n_heads)
            .field("sequence_parallel", &self.sequence_parallel)
            .finish()
    }
}

impl TensorParallelFactory {
    /// A factory over the group `comm`, for a model with `n_heads` attention heads.
    pub fn new(comm: TpComm, n_heads: usize) -> Self {
        Self {
            comm,
            n_heads,
            sequence_parallel: false,
        }
    }

    /// The same factory building layers for sequence parallelism (`on`): column-parallel
    /// layers all-gather this rank's token rows before their product, row-parallel ones
    /// reduce-scatter their output to them ([`column_parallel_linear_sp`],
    /// [`row_parallel_linear_sp`]). With one rank the layers are the plain ones.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on && self.comm.world_size() > 1;
        self
    }
}

impl LayerFactory for TensorParallelFactory {
    fn linear(&self, init: &Initializer, spec: &LinearSpec) -> Result<Box<dyn LinearLayer>> {
        let (full_w, full_b) = init_linear(init, spec)?;
        let (tp, rank) = (self.comm.world_size(), self.comm.rank());
        let (w, b) = match spec.kind {
            LinearKind::AttnQkv => shard_qkv(&full_w, full_b.as_ref(), self.n_heads, tp, rank)?,
            LinearKind::MlpUp => shard_column(&full_w, full_b.as_ref(), tp, rank)?,
            LinearKind::AttnOut | LinearKind::MlpDown => {
                shard_row(&full_w, full_b.as_ref(), tp, rank)?
            }
        };
        let local_out = w.dim(0)?;
        Ok(Box::new(TpLinear {
            name: spec.name.clone(),
            style: spec.kind.parallel_style(),
            weight: Var::from_tensor(&w)?,
            bias: b.map(|b| Var::from_tensor(&b)).transpose()?,
            comm: self.comm.clone(),
            local_out,
            sequence_parallel: self.sequence_parallel,
        }))
    }
}

/// One rank's shard of a column- or row-parallel linear layer.
pub struct TpLinear {
    name: String,
    style: ParallelStyle,
    weight: Var,
    bias: Option<Var>,
    comm: TpComm,
    local_out: usize,
    sequence_parallel: bool,
}

impl std::fmt::Debug for TpLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpLinear")
            .field("name", &self.name)
            .field("style", &self.style)
            .field("weight", &self.weight.dims())
            .finish()
    }
}

impl LinearLayer for TpLinear {
    fn forward_with(&self, x: &Tensor, params: &dyn ParamSource) -> Result<Tensor> {
        let w = params.param(&format!("{}.weight", self.name))?;
        let b = match self.bias {
            Some(_) => Some(params.param(&format!("{}.bias", self.name))?),
            None => None,
        };
        let (b, c) = (b.as_ref(), &self.comm);
        Ok(match (self.style, self.sequence_parallel) {
            (ParallelStyle::Column, false) => column_parallel_linear(x, &w, b, c)?,
            (ParallelStyle::Row, false) => row_parallel_linear(x, &w, b, c)?,
            (ParallelStyle::Column, true) => column_parallel_linear_sp(x, &w, b, c)?,
            (ParallelStyle::Row, true) => row_parallel_linear_sp(x, &w, b, c)?,
        })
    }

    fn parameters(&self) -> Vec<(String, Var)> {
        let mut p = vec![(format!("{}.weight", self.name), self.weight.clone())];
        if let Some(b) = &self.bias {
            p.push((format!("{}.bias", self.name), b.clone()));
        }
        p
    }

    fn local_out_features(&self) -> usize {
        self.local_out
    }

    fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }
}
