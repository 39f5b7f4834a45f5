//! The linear-layer seam: the model builds every projection through a [`LayerFactory`], so a
//! tensor-parallel, LoRA-wrapped or fake-quantised layer replaces the dense one without
//! forking the model.

use crate::error::{ModelError, Result};
use crate::init::{Init, Initializer};
use crate::params::ParamSource;
use candle_core::{Tensor, Var};
use kiln_optim::ParamKind;
use kiln_parallel::tp::TpSplit;

/// Which projection of a block a linear layer is; tells a tensor-parallel factory how to split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinearKind {
    /// The fused query/key/value projection `d -> 3d`; column-parallel (Megatron), output laid
    /// out as `[q | k | v]`, each `n_heads * head_dim` wide.
    AttnQkv,
    /// The attention output projection `d -> d`; row-parallel.
    AttnOut,
    /// The MLP's first layer `d -> 4d` (fc1); column-parallel.
    MlpUp,
    /// The MLP's second layer `4d -> d` (fc2, or a SwiGLU's down projection); row-parallel.
    MlpDown,
    /// The query projection of grouped-query attention `d -> heads * head_dim`;
    /// column-parallel by heads.
    AttnQ,
    /// The key projection of grouped-query attention `d -> kv_heads * head_dim`;
    /// column-parallel by key/value heads, or replicated where the tensor-parallel degree
    /// exceeds them ([`crate::TensorParallelFactory`]).
    AttnK,
    /// The value projection of grouped-query attention; split as [`LinearKind::AttnK`].
    AttnV,
    /// A SwiGLU MLP's fused gate and up projection `d -> 2f`, output `[gate | up]`;
    /// column-parallel, rank `r` holding `[gate_r | up_r]`.
    MlpGateUp,
}

/// How Megatron splits a layer across tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParallelStyle {
    /// Split the output features; the input is replicated.
    Column,
    /// Split the input features; the partial outputs are summed (all-reduce).
    Row,
}

impl LinearKind {
    /// The Megatron split of this layer.
    pub fn parallel_style(self) -> ParallelStyle {
        match self {
            LinearKind::AttnQkv
            | LinearKind::MlpUp
            | LinearKind::AttnQ
            | LinearKind::AttnK
            | LinearKind::AttnV
            | LinearKind::MlpGateUp => ParallelStyle::Column,
            LinearKind::AttnOut | LinearKind::MlpDown => ParallelStyle::Row,
        }
    }
}

/// Everything a factory needs to build one linear layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearSpec {
    /// Parameter prefix, e.g. `h.0.attn.c_attn`; the weight is `{name}.weight`, the bias
    /// `{name}.bias`.
    pub name: String,
    /// Input features (of the whole, unsplit layer).
    pub in_features: usize,
    /// Output features (of the whole, unsplit layer).
    pub out_features: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
    /// Which projection this is.
    pub kind: LinearKind,
    /// Initialisation of the `[out_features, in_features]` weight; biases start at zero.
    pub weight_init: Init,
}

impl LinearSpec {
    /// How the layer's parameters are split over tensor-parallel ranks (Megatron-LM): the
    /// fused QKV by heads, fc1 and the query, key and value projections (column-parallel) by
    /// output rows, a SwiGLU's gate and up by rows of each half, the row-parallel output
    /// projections' weights by input columns with their biases replicated. The answer does not
    /// depend on the degree: at tp = 1 it shapes checkpoints (a QKV weight is stored
    /// `[3, d, in]`), so they reshard to any degree. (Key and value projections replicated
    /// over a degree above their heads say so themselves,
    /// [`LinearLayer::param_splits`]: the checkpoint shape is the same.)
    pub fn param_splits(&self) -> Vec<(String, TpSplit)> {
        let (w, b) = match self.kind {
            LinearKind::AttnQkv => (TpSplit::Qkv, TpSplit::Qkv),
            LinearKind::MlpGateUp => (TpSplit::GateUp, TpSplit::GateUp),
            LinearKind::MlpUp | LinearKind::AttnQ | LinearKind::AttnK | LinearKind::AttnV => {
                (TpSplit::Rows, TpSplit::Rows)
            }
            LinearKind::AttnOut | LinearKind::MlpDown => (TpSplit::Cols, TpSplit::Replicated),
        };
        let mut out = vec![(format!("{}.weight", self.name), w)];
        if self.bias {
            out.push((format!("{}.bias", self.name), b));
        }
        out
    }

    /// What each of the layer's parameters is, for optimizer parameter groups: the weight a
    /// [`ParamKind::Weight`], the bias a [`ParamKind::Bias`].
    pub fn param_kinds(&self) -> Vec<(String, ParamKind)> {
        let mut out = vec![(format!("{}.weight", self.name), ParamKind::Weight)];
        if self.bias {
            out.push((format!("{}.bias", self.name), ParamKind::Bias));
        }
        out
    }
}

/// A linear layer `y = x W^T + b` over the last dimension.
pub trait LinearLayer: Send + Sync + std::fmt::Debug {
    /// Applies the layer to `x` of shape `[.., in]`, computing in `x`'s dtype (the layer casts
    /// its weights, differentiably, when they are stored in another dtype), with the weights
    /// read by name (`{name}.weight`, `{name}.bias`) from `params`.
    fn forward_with(&self, x: &Tensor, params: &dyn ParamSource) -> Result<Tensor>;
    /// Applies the layer with its own weights.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, &self.parameters())
    }
    /// `gelu(self.forward_with(x, params))`, the MLP's first layer and activation;
    /// implementations may fuse the bias add into the activation ([`DenseLinear`] does, with
    /// [`ops::bias_gelu`](crate::ops::bias_gelu)).
    fn forward_gelu_with(&self, x: &Tensor, params: &dyn ParamSource) -> Result<Tensor> {
        crate::ops::gelu(&self.forward_with(x, params)?)
    }
    /// `gelu(self.forward(x))` with the layer's own weights.
    fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_gelu_with(x, &self.parameters())
    }
    /// Every parameter this layer holds with its full name, in a fixed order (a wrapper such
    /// as a LoRA adapter lists the wrapped layer's and its own; the model decides which of them
    /// train, see [`crate::Gpt::freeze`]).
    fn parameters(&self) -> Vec<(String, Var)>;
    /// Output features this layer produces locally (a column-parallel shard produces fewer
    /// than the spec's `out_features`).
    fn local_out_features(&self) -> usize;
    /// How this layer's parameters split over tensor-parallel ranks, when they are not exactly
    /// the spec's weight and bias ([`LinearSpec::param_splits`], the default `None`): a layer
    /// with parameters of its own lists all of them.
    fn param_splits(&self) -> Option<Vec<(String, TpSplit)>> {
        None
    }
    /// What this layer's parameters are, when they are not exactly the spec's weight and bias
    /// ([`LinearSpec::param_kinds`], the default `None`).
    fn param_kinds(&self) -> Option<Vec<(String, ParamKind)>> {
        None
    }
    /// Whether the layer takes and gives this rank's token rows under sequence parallelism (a
    /// column-parallel layer gathers them before its product, a row-parallel one
    /// reduce-scatters its output to them; see [`crate::GptOptions::sequence_parallel`]). The
    /// default `false`: the layer takes and gives every row.
    fn sequence_parallel(&self) -> bool {
        false
    }
}

/// Builds the linear layers of a model.
pub trait LayerFactory {
    /// Builds the layer described by `spec`, creating its parameters with `init`.
    fn linear(&self, init: &Initializer, spec: &LinearSpec) -> Result<Box<dyn LinearLayer>>;
}

/// The default factory: plain dense layers owning their `Var`s.
#[derive(Debug, Clone, Copy, Default)]
pub struct DenseFactory;

impl LayerFactory for DenseFactory {
    fn linear(&self, init: &Initializer, spec: &LinearSpec) -> Result<Box<dyn LinearLayer>> {
        Ok(Box::new(DenseLinear::new(init, spec)?))
    }
}

/// A dense linear layer with weight `[out, in]` (the PyTorch `nn.Linear` layout) and an
/// optional bias `[out]`.
#[derive(Debug, Clone)]
pub struct DenseLinear {
    name: String,
    weight: Var,
    bias: Option<Var>,
}

/// The whole initial weight `[out, in]` and bias `[out]` of `spec`, drawn from their
/// `(seed, name)` streams; every factory starts from these, so layers agree across factories.
pub fn init_linear(init: &Initializer, spec: &LinearSpec) -> Result<(Tensor, Option<Tensor>)> {
    if spec.in_features == 0 || spec.out_features == 0 {
        return Err(ModelError::ZeroDimension {
            field: "linear features",
        });
    }
    let weight = init.tensor(
        &format!("{}.weight", spec.name),
        &[spec.out_features, spec.in_features],
        spec.weight_init,
    )?;
    let bias = if spec.bias {
        Some(init.tensor(
            &format!("{}.bias", spec.name),
            &[spec.out_features],
            Init::Zeros,
        )?)
    } else {
        None
    };
    Ok((weight, bias))
}

impl DenseLinear {
    /// Creates the parameters of `spec` with `init`.
    pub fn new(init: &Initializer, spec: &LinearSpec) -> Result<Self> {
        let (weight, bias) = init_linear(init, spec)?;
        Ok(Self {
            name: spec.name.clone(),
            weight: Var::from_tensor(&weight)?,
            bias: bias.map(|b| Var::from_tensor(&b)).transpose()?,
        })
    }

    /// Wraps existing parameters (weight `[out, in]`, bias `[out]`).
    pub fn from_vars(name: impl Into<String>, weight: Var, bias: Option<Var>) -> Self {
        Self {
            name: name.into(),
            weight,
            bias,
        }
    }

    /// The weight `[out, in]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The bias `[out]`, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }
}

/// `x W^T + b` for `x` `[.., in]`, computing in `x`'s dtype ([`kiln_parallel::tp::linear`]:
/// on the CPU one fused op with its own backward).
pub fn linear_forward(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (_, in_f) = weight.dims2()?;
    let dims = x.dims();
    if dims.last() != Some(&in_f) {
        return Err(ModelError::Shape {
            op: "linear",
            what: "x",
            expected: format!("[.., {in_f}]"),
            got: format!("{dims:?}"),
        });
    }
    Ok(kiln_parallel::tp::linear(x, weight, bias)?)
}

impl DenseLinear {
    fn weights_from(&self, params: &dyn ParamSource) -> Result<(Tensor, Option<Tensor>)> {
        let w = params.param(&format!("{}.weight", self.name))?;
        let b = match self.bias {
            Some(_) => Some(params.param(&format!("{}.bias", self.name))?),
            None => None,
        };
        Ok((w, b))
    }
}

impl LinearLayer for DenseLinear {
    fn forward_with(&self, x: &Tensor, params: &dyn ParamSource) -> Result<Tensor> {
        let (w, b) = self.weights_from(params)?;
        linear_forward(x, &w, b.as_ref())
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear_forward(
            x,
            self.weight.as_tensor(),
            self.bias.as_ref().map(|b| b.as_tensor()),
        )
    }

    fn forward_gelu_with(&self, x: &Tensor, params: &dyn ParamSource) -> Result<Tensor> {
        let (w, b) = self.weights_from(params)?;
        match b {
            Some(b) => {
                let y = linear_forward(x, &w, None)?;
                crate::ops::bias_gelu(&y, &b.to_dtype(y.dtype())?)
            }
            None => crate::ops::gelu(&linear_forward(x, &w, None)?),
        }
    }

    fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_gelu_with(x, &self.parameters())
    }

    fn parameters(&self) -> Vec<(String, Var)> {
        let mut p = vec![(format!("{}.weight", self.name), self.weight.clone())];
        if let Some(b) = &self.bias {
            p.push((format!("{}.bias", self.name), b.clone()));
        }
        p
    }

    fn local_out_features(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0)
    }
}
