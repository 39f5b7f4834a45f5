//! The transformer block and its LayerNorms.

use crate::config::GptConfig;
use crate::error::{ModelError, Result};
use crate::init::{Init, Initializer};
use crate::linear::{LayerFactory, LinearKind, LinearLayer, LinearSpec};
use crate::ops;
use crate::params::ParamSource;
use candle_core::{Tensor, Var};
use kiln_optim::ParamKind;
use kiln_parallel::tp::{self as tpops, TpComm, TpSplit};

/// A LayerNorm's gain and bias.
#[derive(Debug, Clone)]
pub(crate) struct Norm {
    name: String,
    weight: Var,
    bias: Var,
    eps: f64,
    /// Under sequence parallelism, the group over which the gain's and shift's gradients (each
    /// rank's from its own rows) are summed.
    pub(crate) split_rows: Option<TpComm>,
}

impl Norm {
    pub(crate) fn new(init: &Initializer, name: &str, d: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            name: name.to_string(),
            weight: init.var(&format!("{name}.weight"), &[d], Init::Ones)?,
            bias: init.var(&format!("{name}.bias"), &[d], Init::Zeros)?,
            eps,
            split_rows: None,
        })
    }

    pub(crate) fn forward_with(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let (w, b) = self.params_with(x, p)?;
        ops::layer_norm(x, &w, &b, self.eps)
    }

    /// [`Norm::forward_with`] as rows `[n, d]` (see [`ops::layer_norm_rows`]).
    pub(crate) fn forward_rows_with(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let (w, b) = self.params_with(x, p)?;
        ops::layer_norm_rows(x, &w, &b, self.eps)
    }

    /// The gain and bias from `p`, in `x`'s dtype.
    fn params_with(&self, x: &Tensor, p: &dyn ParamSource) -> Result<(Tensor, Tensor)> {
        let w = p
            .param(&format!("{}.weight", self.name))?
            .to_dtype(x.dtype())?;
        let b = p
            .param(&format!("{}.bias", self.name))?
            .to_dtype(x.dtype())?;
        match &self.split_rows {
            Some(c) => Ok((
                tpops::copy_to_tp_region(&w, c)?,
                tpops::copy_to_tp_region(&b, c)?,
            )),
            None => Ok((w, b)),
        }
    }

    pub(crate) fn parameters(&self, out: &mut Vec<(String, Var)>) {
        out.push((format!("{}.weight", self.name), self.weight.clone()));
        out.push((format!("{}.bias", self.name), self.bias.clone()));
    }
}

/// One pre-LayerNorm transformer block.
#[derive(Debug)]
pub(crate) struct Block {
    ln_1: Norm,
    c_attn: Box<dyn LinearLayer>,
    attn_proj: Box<dyn LinearLayer>,
    ln_2: Norm,
    c_fc: Box<dyn LinearLayer>,
    mlp_proj: Box<dyn LinearLayer>,
    head_dim: usize,
    /// How the factory's layers split their parameters (from their specs).
    pub(crate) splits: Vec<(String, TpSplit)>,
    /// What the factory's layers' parameters are (from their specs).
    pub(crate) kinds: Vec<(String, ParamKind)>,
}

impl Block {
    pub(crate) fn new(
        cfg: &GptConfig,
        i: usize,
        init: &Initializer,
        factory: &dyn LayerFactory,
        split_rows: Option<&TpComm>,
    ) -> Result<Self> {
        let d = cfg.d_model;
        let f = cfg.d_ff();
        let eps = cfg.layer_norm_eps;
        let residual_gain = if cfg.scaled_residual_init {
            1.0 / (2.0 * cfg.n_layers as f64).sqrt()
        } else {
            1.0
        };
        let spec = |name: &str, in_f, out_f, kind, gain| LinearSpec {
            name: format!("h.{i}.{name}"),
            in_features: in_f,
            out_features: out_f,
            bias: true,
            kind,
            weight_init: Init::XavierUniform { gain },
        };
        let specs = [
            spec("attn.c_attn", d, 3 * d, LinearKind::AttnQkv, 1.0),
            spec("attn.c_proj", d, d, LinearKind::AttnOut, residual_gain),
            spec("mlp.c_fc", d, f, LinearKind::MlpUp, 1.0),
            spec("mlp.c_proj", f, d, LinearKind::MlpDown, residual_gain),
        ];
        let [qkv, out, up, down] = &specs;
        let mut ln_1 = Norm::new(init, &format!("h.{i}.ln_1"), d, eps)?;
        let c_attn = factory.linear(init, qkv)?;
        let attn_proj = factory.linear(init, out)?;
        let mut ln_2 = Norm::new(init, &format!("h.{i}.ln_2"), d, eps)?;
        let c_fc = factory.linear(init, up)?;
        let mlp_proj = factory.linear(init, down)?;
        ln_1.split_rows = split_rows.cloned();
        ln_2.split_rows = split_rows.cloned();
        let layers = [&c_attn, &attn_proj, &c_fc, &mlp_proj];
        for (spec, layer) in specs.iter().zip(layers) {
            if layer.sequence_parallel() != split_rows.is_some() {
                let (model, layer_says) = match split_rows {
                    Some(_) => ("is", "does not take"),
                    None => ("is not", "takes"),
                };
                return Err(ModelError::SequenceParallel {
                    reason: format!(
                        "the model {model} sequence-parallel but the layer {} {layer_says} \
                         split token rows (build the layers with \
                         TensorParallelFactory::with_sequence_parallel)",
                        spec.name
                    ),
                });
            }
        }
        // a layer with parameters of its own (a LoRA adapter) says how they split; a plain one
        // has its spec's weight and bias
        let splits = specs
            .iter()
            .zip(layers)
            .flat_map(|(s, l)| l.param_splits().unwrap_or_else(|| s.param_splits()))
            .collect();
        let kinds = specs
            .iter()
            .zip(layers)
            .flat_map(|(s, l)| l.param_kinds().unwrap_or_else(|| s.param_kinds()))
            .collect();
        Ok(Self {
            ln_1,
            c_attn,
            attn_proj,
            ln_2,
            c_fc,
            mlp_proj,
            head_dim: cfg.head_dim(),
            splits,
            kinds,
        })
    }

    fn attention(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let dh = self.head_dim;
        let qkv = self.c_attn.forward_with(x, p)?;
        let width = self.c_attn.local_out_features();
        if width % (3 * dh) != 0 {
            return Err(ModelError::Shape {
                op: "attention",
                what: "qkv projection output",
                expected: format!("a multiple of 3 * head_dim = {}", 3 * dh),
                got: format!("{width}"),
            });
        }
        let h = width / (3 * dh);
        let scale = 1.0 / (dh as f64).sqrt();
        // the fused kernels, CPU and CUDA: no t x t scores, the masked half skipped, heads in
        // parallel (small_cpu trains 5-15% faster than with scores, causal softmax and values
        // as three ops on the CPU); on the CPU they read q, k and v where the projection wrote
        // them, one graph node from qkv to the heads side by side
        let y = ops::causal_attention_packed(&qkv, h, scale)?;
        self.attn_proj.forward_with(&y, p)
    }

    pub(crate) fn forward_with(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        // kiln ops end to end, so the segment's backward can run from its tape
        let x = ops::residual_add(x, &self.attention(&self.ln_1.forward_with(x, p)?, p)?)?;
        let h = self
            .c_fc
            .forward_gelu_with(&self.ln_2.forward_with(&x, p)?, p)?;
        ops::residual_add(&x, &self.mlp_proj.forward_with(&h, p)?)
    }

    pub(crate) fn own(&self) -> Vec<(String, Var)> {
        let mut v = Vec::new();
        self.parameters(&mut v);
        v
    }

    pub(crate) fn parameters(&self, out: &mut Vec<(String, Var)>) {
        self.ln_1.parameters(out);
        out.extend(self.c_attn.parameters());
        out.extend(self.attn_proj.parameters());
        self.ln_2.parameters(out);
        out.extend(self.c_fc.parameters());
        out.extend(self.mlp_proj.parameters());
    }
}
