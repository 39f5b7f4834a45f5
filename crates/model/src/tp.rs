//! [`TensorParallelFactory`]: Megatron-LM linear layers for [`crate::Gpt`] through the
//! [`LayerFactory`] seam.

use crate::error::{ModelError, Result};
use crate::init::Initializer;
use crate::linear::{
    init_linear, LayerFactory, LinearKind, LinearLayer, LinearSpec, ParallelStyle,
};
use crate::params::ParamSource;
use candle_core::{Tensor, Var};
use kiln_parallel::tp::{
    self as tpops, column_parallel_linear, column_parallel_linear_sp, row_parallel_linear,
    row_parallel_linear_sp, shard_column, shard_qkv, shard_row, TpComm, TpSplit,
};

/// Builds column-parallel QKV (split by heads) and fc1, and row-parallel attention output and
/// fc2, over a tensor-parallel group; for the Llama layout column-parallel query, key and
/// value projections (by heads) and a fused gate and up (each half by rows). Each weight is
/// initialised whole from its `(seed, name)` stream and then sharded, so the layers equal the
/// dense ones at any degree.
///
/// Key/value heads: where the degree divides them each rank holds its `kv_heads / tp`; where
/// it exceeds them (a multiple of them), every rank holds the whole key and value projections
/// and computes only the head its query heads read, `rank / (tp / kv_heads)`, and their
/// gradients are summed over the group (the weight enters through `f`, identity forward and
/// all-reduce backward), so the replicas stay equal. That costs the memory of every key/value
/// head on every rank; any other degree is an error naming both numbers.
#[derive(Clone)]
pub struct TensorParallelFactory {
    comm: TpComm,
    n_heads: usize,
    kv_heads: usize,
    sequence_parallel: bool,
}

impl std::fmt::Debug for TensorParallelFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallelFactory")
            .field("tp", &self.comm.world_size())
            .field("rank", &self.comm.rank())
            .field("n_heads", &self.n_heads)
            .field("kv_heads", &self.kv_heads)
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
            kv_heads: n_heads,
            sequence_parallel: false,
        }
    }

    /// A factory over the group `comm` for the model `cfg`: its query and key/value heads.
    pub fn for_config(comm: TpComm, cfg: &crate::GptConfig) -> Self {
        Self::new(comm, cfg.n_heads).with_kv_heads(cfg.kv_heads())
    }

    /// The same factory for a model with `kv_heads` key/value heads (grouped-query attention;
    /// [`crate::GptConfig::kv_heads`]).
    pub fn with_kv_heads(mut self, kv_heads: usize) -> Self {
        self.kv_heads = kv_heads;
        self
    }

    /// Whether the degree exceeds the key/value heads, so their projections are replicated
    /// ([`kv_replicated`]).
    pub fn replicates_kv(&self) -> Result<bool> {
        kv_replicated(self.n_heads, self.kv_heads, self.comm.world_size())
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

/// Whether a tensor-parallel degree `tp` replicates the key/value projections of a model with
/// `n_heads` query heads and `kv_heads` key/value heads (it is a multiple of them) rather
/// than splitting them (it divides them); an error naming the numbers where it does neither,
/// or does not divide the query heads.
pub fn kv_replicated(n_heads: usize, kv_heads: usize, tp: usize) -> Result<bool> {
    if tp == 0 || n_heads % tp != 0 {
        return Err(ModelError::Config {
            field: "tensor_parallel_degree",
            reason: format!(
                "the tensor-parallel degree ({tp}) must divide n_heads ({n_heads}): each rank \
                 runs whole query heads"
            ),
        });
    }
    if kv_heads > 0 && kv_heads % tp == 0 {
        return Ok(false);
    }
    if kv_heads > 0 && tp % kv_heads == 0 {
        return Ok(true);
    }
    Err(ModelError::Config {
        field: "tensor_parallel_degree",
        reason: format!(
            "the tensor-parallel degree ({tp}) must divide the key/value heads (n_kv_heads \
             {kv_heads}) or be a multiple of them (each replicated over tp / n_kv_heads ranks)"
        ),
    })
}

impl LayerFactory for TensorParallelFactory {
    fn linear(&self, init: &Initializer, spec: &LinearSpec) -> Result<Box<dyn LinearLayer>> {
        let (full_w, full_b) = init_linear(init, spec)?;
        let (tp, rank) = (self.comm.world_size(), self.comm.rank());
        let mut replicated = None;
        let (w, b) = match spec.kind {
            LinearKind::AttnQkv => shard_qkv(&full_w, full_b.as_ref(), self.n_heads, tp, rank)?,
            LinearKind::MlpUp => shard_column(&full_w, full_b.as_ref(), tp, rank)?,
            LinearKind::AttnQ => {
                self.replicates_kv()?;
                shard_column(&full_w, full_b.as_ref(), tp, rank)?
            }
            LinearKind::AttnK | LinearKind::AttnV => {
                if self.replicates_kv()? {
                    // every key/value head here; this rank's one chosen at each forward
                    let rows = spec.out_features / self.kv_heads;
                    let head = rank / (tp / self.kv_heads);
                    replicated = Some((head * rows, rows));
                    (full_w.detach(), full_b.map(|b| b.detach()))
                } else {
                    shard_column(&full_w, full_b.as_ref(), tp, rank)?
                }
            }
            LinearKind::MlpGateUp => (
                TpSplit::GateUp.shard(&full_w, tp, rank)?,
                full_b
                    .map(|b| TpSplit::GateUp.shard(&b, tp, rank))
                    .transpose()?,
            ),
            LinearKind::AttnOut | LinearKind::MlpDown => {
                shard_row(&full_w, full_b.as_ref(), tp, rank)?
            }
        };
        let local_out = replicated.map_or(w.dim(0)?, |(_, rows)| rows);
        Ok(Box::new(TpLinear {
            name: spec.name.clone(),
            style: spec.kind.parallel_style(),
            weight: Var::from_tensor(&w)?,
            bias: b.map(|b| Var::from_tensor(&b)).transpose()?,
            comm: self.comm.clone(),
            local_out,
            sequence_parallel: self.sequence_parallel,
            replicated,
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
    /// A column-parallel layer held whole on every rank (key/value projections over a degree
    /// above their heads): the first output row and the number of rows this rank computes.
    replicated: Option<(usize, usize)>,
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
        let mut w = params.param(&format!("{}.weight", self.name))?;
        let mut b = match self.bias {
            Some(_) => Some(params.param(&format!("{}.bias", self.name))?),
            None => None,
        };
        if let Some((start, rows)) = self.replicated {
            // identity forward, gradient all-reduced: each rank adds its head's part, so every
            // replica gets the whole gradient
            let part = |t: &Tensor| -> Result<Tensor> {
                Ok(tpops::copy_to_tp_region(t, &self.comm)?.narrow(0, start, rows)?)
            };
            w = part(&w)?;
            b = b.as_ref().map(part).transpose()?;
        }
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

    fn param_splits(&self) -> Option<Vec<(String, TpSplit)>> {
        self.replicated.map(|_| {
            let mut v = vec![(format!("{}.weight", self.name), TpSplit::Replicated)];
            if self.bias.is_some() {
                v.push((format!("{}.bias", self.name), TpSplit::Replicated));
            }
            v
        })
    }

    fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }
}
