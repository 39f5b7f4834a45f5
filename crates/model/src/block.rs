//! The transformer block and its LayerNorms.

use crate::config::{GptConfig, MlpKind, NormKind, PositionKind};
use crate::error::{ModelError, Result};
use crate::init::{Init, Initializer};
use crate::linear::{LayerFactory, LinearKind, LinearLayer, LinearSpec};
use crate::ops;
use crate::params::ParamSource;
use candle_core::{DType, Device, DeviceLocation, Tensor, Var};
use kiln_optim::ParamKind;
use kiln_parallel::tp::{self as tpops, TpComm, TpSplit};
use std::sync::{Arc, Mutex};

/// A norm's gain, and a LayerNorm's shift (when the model has biases).
#[derive(Debug, Clone)]
pub(crate) struct Norm {
    name: String,
    kind: NormKind,
    weight: Var,
    bias: Option<Var>,
    eps: f64,
    /// Under sequence parallelism, the group over which the gain's and shift's gradients (each
    /// rank's from its own rows) are summed.
    pub(crate) split_rows: Option<TpComm>,
}

impl Norm {
    /// The norm of `cfg` ([`GptConfig::norm`], with a shift if a LayerNorm and
    /// [`GptConfig::bias`]) over `d` features.
    pub(crate) fn new(init: &Initializer, name: &str, cfg: &GptConfig) -> Result<Self> {
        let d = cfg.d_model;
        let shift = cfg.norm == NormKind::LayerNorm && cfg.bias;
        Ok(Self {
            name: name.to_string(),
            kind: cfg.norm,
            weight: init.var(&format!("{name}.weight"), &[d], Init::Ones)?,
            bias: shift
                .then(|| init.var(&format!("{name}.bias"), &[d], Init::Zeros))
                .transpose()?,
            eps: cfg.layer_norm_eps,
            split_rows: None,
        })
    }

    pub(crate) fn forward_with(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        self.apply(x, p, false)
    }

    /// [`Norm::forward_with`] as rows `[n, d]` (see [`ops::layer_norm_rows`]).
    pub(crate) fn forward_rows_with(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        self.apply(x, p, true)
    }

    fn apply(&self, x: &Tensor, p: &dyn ParamSource, rows: bool) -> Result<Tensor> {
        let (w, b) = self.params_with(x, p)?;
        match (self.kind, rows) {
            (NormKind::RmsNorm, false) => ops::rms_norm(x, &w, self.eps),
            (NormKind::RmsNorm, true) => ops::rms_norm_rows(x, &w, self.eps),
            (NormKind::LayerNorm, _) => {
                // a LayerNorm without a shift adds zeros, a constant
                let b = match b {
                    Some(b) => b,
                    None => w.zeros_like()?,
                };
                match rows {
                    false => ops::layer_norm(x, &w, &b, self.eps),
                    true => ops::layer_norm_rows(x, &w, &b, self.eps),
                }
            }
        }
    }

    /// The gain and shift from `p`, in `x`'s dtype.
    fn params_with(&self, x: &Tensor, p: &dyn ParamSource) -> Result<(Tensor, Option<Tensor>)> {
        let read = |suffix: &str| -> Result<Tensor> {
            let t = p
                .param(&format!("{}.{suffix}", self.name))?
                .to_dtype(x.dtype())?;
            Ok(match &self.split_rows {
                Some(c) => tpops::copy_to_tp_region(&t, c)?,
                None => t,
            })
        };
        let b = self.bias.as_ref().map(|_| read("bias")).transpose()?;
        Ok((read("weight")?, b))
    }

    pub(crate) fn parameters(&self, out: &mut Vec<(String, Var)>) {
        out.push((format!("{}.weight", self.name), self.weight.clone()));
        if let Some(b) = &self.bias {
            out.push((format!("{}.bias", self.name), b.clone()));
        }
    }
}

/// The rotary tables of a model, built once per device and dtype for `n_ctx` positions and
/// shared by its blocks; a forward of `t` positions reads the first `t` rows.
#[derive(Debug)]
pub(crate) struct RotaryTables {
    n_ctx: usize,
    head_dim: usize,
    theta: f64,
    scaling: Option<crate::ops::Llama3Scaling>,
    built: Mutex<Vec<(DeviceLocation, DType, Tensor)>>,
}

impl RotaryTables {
    pub(crate) fn new(cfg: &GptConfig) -> Self {
        Self {
            n_ctx: cfg.n_ctx,
            head_dim: cfg.head_dim(),
            theta: cfg.rope_theta,
            scaling: cfg.rope_scaling,
            built: Mutex::new(Vec::new()),
        }
    }

    /// The table of the first `t` positions (`[t, head_dim]`) on `device` in `dtype`.
    fn table(&self, t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let at = device.location();
        let mut built = self.built.lock().map_err(|_| ModelError::Device {
            device: format!("{at:?}"),
            reason: "a thread panicked while building the rotary tables".into(),
        })?;
        let table = match built.iter().find(|(l, d, _)| *l == at && *d == dtype) {
            Some((_, _, table)) => table.clone(),
            None => {
                let table = ops::rotary_table(
                    self.n_ctx,
                    self.head_dim,
                    self.theta,
                    self.scaling,
                    dtype,
                    device,
                )?;
                built.push((at, dtype, table.clone()));
                table
            }
        };
        Ok(table.narrow(0, 0, t)?)
    }

    /// Rotates the first `heads` heads of each row of `x` `[b, t, width]`.
    fn rotate(&self, x: &Tensor, heads: usize) -> Result<Tensor> {
        let t = x.dim(1)?;
        let table = self.table(t, x.dtype(), x.device())?;
        ops::rotary(x, &table, self.head_dim, heads, ops::RotaryLayout::Half)
    }
}

/// The attention's input projections: one fused `[q | k | v]` (as many key/value heads as
/// query heads), or a projection each (grouped-query attention).
#[derive(Debug)]
enum Projections {
    Fused(Box<dyn LinearLayer>),
    Grouped {
        q: Box<dyn LinearLayer>,
        k: Box<dyn LinearLayer>,
        v: Box<dyn LinearLayer>,
    },
}

/// One pre-norm transformer block.
#[derive(Debug)]
pub(crate) struct Block {
    ln_1: Norm,
    qkv: Projections,
    attn_proj: Box<dyn LinearLayer>,
    ln_2: Norm,
    c_fc: Box<dyn LinearLayer>,
    mlp_proj: Box<dyn LinearLayer>,
    head_dim: usize,
    mlp: MlpKind,
    rotary: Option<Arc<RotaryTables>>,
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
        rotary: Option<&Arc<RotaryTables>>,
    ) -> Result<Self> {
        let d = cfg.d_model;
        let f = cfg.d_ff();
        let (hq, hkv) = (
            cfg.n_heads * cfg.head_dim(),
            cfg.kv_heads() * cfg.head_dim(),
        );
        let residual_gain = if cfg.scaled_residual_init {
            1.0 / (2.0 * cfg.n_layers as f64).sqrt()
        } else {
            1.0
        };
        let spec = |name: &str, in_f, out_f, kind, gain| LinearSpec {
            name: format!("h.{i}.{name}"),
            in_features: in_f,
            out_features: out_f,
            bias: cfg.bias,
            kind,
            weight_init: Init::XavierUniform { gain },
        };
        let mut specs = if cfg.grouped_query() {
            vec![
                spec("attn.q_proj", d, hq, LinearKind::AttnQ, 1.0),
                spec("attn.k_proj", d, hkv, LinearKind::AttnK, 1.0),
                spec("attn.v_proj", d, hkv, LinearKind::AttnV, 1.0),
            ]
        } else {
            vec![spec("attn.c_attn", d, 3 * hq, LinearKind::AttnQkv, 1.0)]
        };
        specs.push(spec(
            "attn.c_proj",
            hq,
            d,
            LinearKind::AttnOut,
            residual_gain,
        ));
        specs.push(match cfg.mlp {
            MlpKind::Gelu => spec("mlp.c_fc", d, f, LinearKind::MlpUp, 1.0),
            MlpKind::SwiGlu => spec("mlp.c_fc", d, 2 * f, LinearKind::MlpGateUp, 1.0),
        });
        specs.push(spec("mlp.c_proj", f, d, LinearKind::MlpDown, residual_gain));
        let mut ln_1 = Norm::new(init, &format!("h.{i}.ln_1"), cfg)?;
        let mut layers = specs
            .iter()
            .map(|s| factory.linear(init, s))
            .collect::<Result<Vec<_>>>()?;
        let mut ln_2 = Norm::new(init, &format!("h.{i}.ln_2"), cfg)?;
        ln_1.split_rows = split_rows.cloned();
        ln_2.split_rows = split_rows.cloned();
        for (spec, layer) in specs.iter().zip(&layers) {
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
            .zip(&layers)
            .flat_map(|(s, l)| l.param_splits().unwrap_or_else(|| s.param_splits()))
            .collect();
        let kinds = specs
            .iter()
            .zip(&layers)
            .flat_map(|(s, l)| l.param_kinds().unwrap_or_else(|| s.param_kinds()))
            .collect();
        let short = || ModelError::Shape {
            op: "Block::new",
            what: "layers from the factory",
            expected: format!("{} layers", specs.len()),
            got: "fewer".into(),
        };
        let mlp_proj = layers.pop().ok_or_else(short)?;
        let c_fc = layers.pop().ok_or_else(short)?;
        let attn_proj = layers.pop().ok_or_else(short)?;
        let qkv = match layers.len() {
            1 => Projections::Fused(layers.pop().ok_or_else(short)?),
            _ => {
                let v = layers.pop().ok_or_else(short)?;
                let k = layers.pop().ok_or_else(short)?;
                let q = layers.pop().ok_or_else(short)?;
                Projections::Grouped { q, k, v }
            }
        };
        let rotary = match cfg.positions {
            PositionKind::Rotary => Some(rotary.cloned().ok_or_else(|| ModelError::Config {
                field: "positions",
                reason: "rotary positions without the model's rotary tables".into(),
            })?),
            PositionKind::Learned => None,
        };
        Ok(Self {
            ln_1,
            qkv,
            attn_proj,
            ln_2,
            c_fc,
            mlp_proj,
            head_dim: cfg.head_dim(),
            mlp: cfg.mlp,
            rotary,
            splits,
            kinds,
        })
    }

    /// The local heads a projection of `width` output features holds.
    fn heads_of(&self, what: &'static str, width: usize, per_head: usize) -> Result<usize> {
        if width == 0 || width % per_head != 0 {
            return Err(ModelError::Shape {
                op: "attention",
                what,
                expected: format!("a multiple of {per_head}"),
                got: format!("{width}"),
            });
        }
        Ok(width / per_head)
    }

    fn attention(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let dh = self.head_dim;
        let scale = 1.0 / (dh as f64).sqrt();
        let y = match &self.qkv {
            Projections::Fused(c_attn) => {
                let qkv = c_attn.forward_with(x, p)?;
                let h =
                    self.heads_of("qkv projection output", c_attn.local_out_features(), 3 * dh)?;
                // the queries and keys are the first 2h heads of each token's [q | k | v]
                let qkv = match &self.rotary {
                    Some(r) => r.rotate(&qkv, 2 * h)?,
                    None => qkv,
                };
                // the fused kernels, CPU and CUDA: no t x t scores, the masked half skipped,
                // heads in parallel (small_cpu trains 5-15% faster than with scores, causal
                // softmax and values as three ops on the CPU); on the CPU they read q, k and v
                // where the projection wrote them, one graph node from qkv to the heads side
                // by side
                ops::causal_attention_packed(&qkv, h, scale)?
            }
            Projections::Grouped { q, k, v } => {
                let h = self.heads_of("query projection output", q.local_out_features(), dh)?;
                let hkv = self.heads_of("key projection output", k.local_out_features(), dh)?;
                let (mut q, mut k) = (q.forward_with(x, p)?, k.forward_with(x, p)?);
                let v = v.forward_with(x, p)?;
                if let Some(r) = &self.rotary {
                    q = r.rotate(&q, h)?;
                    k = r.rotate(&k, hkv)?;
                }
                // one fused op reading q, k and v where the projections wrote them: no
                // repeated key/value heads, no permuted copies
                ops::grouped_attention(&q, &k, &v, h, hkv, scale)?
            }
        };
        self.attn_proj.forward_with(&y, p)
    }

    pub(crate) fn forward_with(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        // kiln ops end to end, so the segment's backward can run from its tape
        let x = ops::residual_add(x, &self.attention(&self.ln_1.forward_with(x, p)?, p)?)?;
        let h = self.ln_2.forward_with(&x, p)?;
        let h = match self.mlp {
            MlpKind::Gelu => self.c_fc.forward_gelu_with(&h, p)?,
            MlpKind::SwiGlu => ops::swiglu(&self.c_fc.forward_with(&h, p)?)?,
        };
        ops::residual_add(&x, &self.mlp_proj.forward_with(&h, p)?)
    }

    pub(crate) fn own(&self) -> Vec<(String, Var)> {
        let mut v = Vec::new();
        self.parameters(&mut v);
        v
    }

    pub(crate) fn parameters(&self, out: &mut Vec<(String, Var)>) {
        self.ln_1.parameters(out);
        match &self.qkv {
            Projections::Fused(c_attn) => out.extend(c_attn.parameters()),
            Projections::Grouped { q, k, v } => {
                out.extend(q.parameters());
                out.extend(k.parameters());
                out.extend(v.parameters());
            }
        }
        out.extend(self.attn_proj.parameters());
        self.ln_2.parameters(out);
        out.extend(self.c_fc.parameters());
        out.extend(self.mlp_proj.parameters());
    }
}
