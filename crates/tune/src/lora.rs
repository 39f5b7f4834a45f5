//! LoRA (Hu et al., 2021): low-rank adapters `W + (alpha / r) B A` on chosen linear layers of
//! kiln-model's GPT, built through its [`LayerFactory`] seam, with the base weights frozen.
//!
//! Each adapted layer keeps its base layer (dense or a Megatron shard) and adds, per adapted
//! projection, `A` `[r, in]` (Kaiming-uniform, as PEFT) and `B` `[out, r]` (zeros, so the model
//! equals its base at initialisation). The fused QKV projection takes one adapter pair per
//! chosen part (`q`, `k`, `v`), so any subset can be adapted.
//!
//! Under tensor parallelism the adapters split as PEFT's Megatron layers do: for a
//! column-parallel base (QKV, fc1) `A` is replicated and `B` is split by rows like the base
//! weight, with Megatron's `f` between them (so `A`'s gradient is summed over the group); for
//! a row-parallel base (attention output, fc2) `A` is split by columns like the base weight, its
//! partial products summed by Megatron's `g`, and `B` is replicated. Every adapter is
//! initialised whole from its `(seed, name)` stream and then sharded, so the model equals the
//! `tp = 1` one at any degree.

use crate::error::{Result, TuneError};
use crate::shared::Shared;
use candle_core::{DType, Tensor, Var};
use kiln_comm::{CommExt, Communicator};
use kiln_model::{
    Gpt, GptConfig, GptOptions, Init, Initializer, LayerFactory, LinearLayer, LinearSpec,
    ParallelStyle, ParamSource, TensorParallelFactory,
};
use kiln_optim::ParamKind;
use kiln_parallel::tp::{copy_to_tp_region, reduce_from_tp_region, TpComm, TpSplit};
use kiln_state::{splitmix64, TensorData};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The file [`Lora::save_adapter`] writes the adapter weights to (PEFT's name).
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The file [`Lora::save_adapter`] writes the [`LoraConfig`] to.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";

mod config;
use config::fused_parts;
pub use config::{LoraConfig, LoraTarget};

/// True for the name of an adapter parameter (`...lora_A...` or `...lora_B...`): the predicate
/// to keep trainable when everything else is frozen.
pub fn is_adapter_param(name: &str) -> bool {
    name.contains(".lora_A") || name.contains(".lora_B")
}

/// What every adapter of one model shares: the training step, which keys the dropout masks.
#[derive(Debug, Default)]
struct Control {
    step: AtomicU64,
}

/// One adapter pair on one projection (or one third of the QKV projection).
#[derive(Debug)]
struct Part {
    /// 0, 1, 2 for q, k, v of the QKV projection, 0 and 1 for the gate and up halves of a
    /// fused gate and up; 0 otherwise.
    third: usize,
    a_name: String,
    b_name: String,
    a: Var,
    b: Var,
    a_split: TpSplit,
    b_split: TpSplit,
}

/// A linear layer with LoRA adapters around a base layer.
#[derive(Debug)]
pub struct LoraLinear {
    name: String,
    base: Box<dyn LinearLayer>,
    spec: LinearSpec,
    style: ParallelStyle,
    parts: Vec<Part>,
    scale: f64,
    dropout: f64,
    seed: u64,
    tp: Option<TpComm>,
    merged: AtomicBool,
    control: Arc<Control>,
}

impl LoraLinear {
    /// This layer's name (`h.0.attn.c_attn`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The adapter's update of this layer's local weight: `scale * B A` laid out as the base
    /// weight (the QKV thirds in place, zeros for the parts without an adapter).
    fn delta_weight(&self) -> Result<Tensor> {
        let w = self.base_weight()?;
        let (out_local, in_local) = w.dims2()?;
        let mut rows: Vec<Tensor> = Vec::new();
        let thirds = fused_parts(self.spec.kind);
        let per = out_local / thirds;
        for t in 0..thirds {
            let block = match self.parts.iter().find(|p| p.third == t) {
                Some(p) => {
                    p.b.as_tensor()
                        .to_dtype(DType::F64)?
                        .matmul(&p.a.as_tensor().to_dtype(DType::F64)?)?
                        .affine(self.scale, 0.0)?
                }
                None => Tensor::zeros((per, in_local), DType::F64, w.device())?,
            };
            rows.push(block);
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    fn base_weight(&self) -> Result<Var> {
        let want = format!("{}.weight", self.name);
        self.base
            .parameters()
            .into_iter()
            .find(|(n, _)| *n == want)
            .map(|(_, v)| v)
            .ok_or_else(|| TuneError::Tensor {
                name: want,
                file: "the base layer".into(),
                reason: "the layer under the adapter holds no such weight".into(),
            })
    }

    /// Adds (`sign = 1`) or subtracts (`-1`) the update to the base weight, in f64.
    fn fold(&self, sign: f64) -> Result<()> {
        let w = self.base_weight()?;
        let delta = self.delta_weight()?;
        let new = (w.as_tensor().to_dtype(DType::F64)? + delta.affine(sign, 0.0)?)?;
        w.set(&new.to_dtype(w.dtype())?)?;
        Ok(())
    }

    /// The dropout mask (already divided by `1 - p`) for `x`, keyed by the seed, the layer, the
    /// step and `x`'s contents, so that a recomputed forward (activation recomputation) draws
    /// the same mask.
    fn dropout_mask(&self, x: &Tensor) -> Result<Tensor> {
        let values: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let mut h = splitmix64(self.seed ^ self.control.step.load(Ordering::Relaxed));
        for b in self.name.bytes() {
            h = splitmix64(h ^ u64::from(b));
        }
        for chunk in values.chunks(4096) {
            let mut acc = 0u64;
            for v in chunk {
                acc = acc.rotate_left(5) ^ u64::from(v.to_bits());
                acc = acc.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            }
            h = splitmix64(h ^ acc);
        }
        let keep = 1.0 - self.dropout;
        let threshold = (keep * (1u64 << 53) as f64) as u64;
        let inv = (1.0 / keep) as f32;
        let mask: Vec<f32> = (0..values.len() as u64)
            .map(|i| {
                if splitmix64(h.wrapping_add(i)) >> 11 < threshold {
                    inv
                } else {
                    0.0
                }
            })
            .collect();
        Ok(Tensor::from_vec(mask, x.dims(), x.device())?.to_dtype(x.dtype())?)
    }

    fn adapter_forward(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let x = if self.dropout > 0.0 {
            x.mul(&self.dropout_mask(x)?)?
        } else {
            x.clone()
        };
        let lin = |x: &Tensor, w: &Tensor| kiln_model::linear_forward(x, w, None);
        let mut outs: Vec<(usize, Tensor)> = Vec::with_capacity(self.parts.len());
        for part in &self.parts {
            let a = p.param(&part.a_name)?;
            let b = p.param(&part.b_name)?;
            let y = match (self.style, &self.tp) {
                (ParallelStyle::Column, Some(tp)) => {
                    // A replicated; f before the row-split B sums A's gradient over the group
                    lin(&copy_to_tp_region(&lin(&x, &a)?, tp)?, &b)?
                }
                (ParallelStyle::Row, Some(tp)) => {
                    // A split by columns like the base weight: partial products summed by g
                    lin(&reduce_from_tp_region(&lin(&x, &a)?, tp)?, &b)?
                }
                (_, None) => lin(&lin(&x, &a)?, &b)?,
            };
            outs.push((part.third, y));
        }
        let parts = fused_parts(self.spec.kind);
        let y = if parts > 1 {
            let width = self.base.local_out_features() / parts;
            let mut dims = x.dims().to_vec();
            if let Some(last) = dims.last_mut() {
                *last = width;
            }
            let thirds = (0..parts)
                .map(|t| match outs.iter().find(|(i, _)| *i == t) {
                    Some((_, y)) => Ok(y.clone()),
                    None => Tensor::zeros(dims.as_slice(), x.dtype(), x.device()),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&thirds, x.rank() - 1)?
        } else {
            match outs.pop() {
                Some((_, y)) => y,
                None => return Err(TuneError::config("lora.targets", "a layer without parts")),
            }
        };
        Ok(y.affine(self.scale, 0.0)?)
    }
}

impl LinearLayer for LoraLinear {
    fn forward_with(&self, x: &Tensor, params: &dyn ParamSource) -> kiln_model::Result<Tensor> {
        let base = self.base.forward_with(x, params)?;
        if self.merged.load(Ordering::Acquire) {
            return Ok(base);
        }
        let delta = self
            .adapter_forward(x, params)
            .map_err(|e| kiln_model::ModelError::Candle(candle_core::Error::wrap(e)))?;
        Ok((base + delta)?)
    }

    fn parameters(&self) -> Vec<(String, Var)> {
        let mut p = self.base.parameters();
        for part in &self.parts {
            p.push((part.a_name.clone(), part.a.clone()));
            p.push((part.b_name.clone(), part.b.clone()));
        }
        p
    }

    fn local_out_features(&self) -> usize {
        self.base.local_out_features()
    }

    fn param_splits(&self) -> Option<Vec<(String, TpSplit)>> {
        let mut s = self
            .base
            .param_splits()
            .unwrap_or_else(|| self.spec.param_splits());
        for part in &self.parts {
            s.push((part.a_name.clone(), part.a_split));
            s.push((part.b_name.clone(), part.b_split));
        }
        Some(s)
    }

    fn param_kinds(&self) -> Option<Vec<(String, ParamKind)>> {
        let mut k = self
            .base
            .param_kinds()
            .unwrap_or_else(|| self.spec.param_kinds());
        for part in &self.parts {
            k.push((part.a_name.clone(), ParamKind::Weight));
            k.push((part.b_name.clone(), ParamKind::Weight));
        }
        Some(k)
    }
}

/// Wraps another [`LayerFactory`] (dense, or Megatron's over `tp`) and puts LoRA adapters on
/// the layers [`LoraConfig::targets`] names. After building the model, [`LoraFactory::lora`]
/// gives the handle that merges, saves and loads them.
pub struct LoraFactory<F: LayerFactory> {
    inner: F,
    cfg: LoraConfig,
    tp: Option<TpComm>,
    control: Arc<Control>,
    built: Mutex<Vec<Arc<LoraLinear>>>,
}

impl<F: LayerFactory> std::fmt::Debug for LoraFactory<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraFactory")
            .field("cfg", &self.cfg)
            .field("tp", &self.tp.as_ref().map(|c| c.world_size()))
            .finish_non_exhaustive()
    }
}

impl<F: LayerFactory> LoraFactory<F> {
    /// Adapters from `cfg` around the layers `inner` builds; `tp` is the tensor-parallel group
    /// `inner` splits over (`None` for dense layers).
    pub fn new(inner: F, cfg: LoraConfig, tp: Option<TpComm>) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            inner,
            cfg,
            tp: tp.filter(|c| c.world_size() > 1),
            control: Arc::new(Control::default()),
            built: Mutex::new(Vec::new()),
        })
    }

    /// The handle to every adapter built so far.
    pub fn lora(&self) -> Lora {
        let layers = match self.built.lock() {
            Ok(b) => b.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        Lora {
            layers,
            cfg: self.cfg.clone(),
            control: self.control.clone(),
            tp: self.tp.clone(),
        }
    }

    fn build(&self, init: &Initializer, spec: &LinearSpec) -> Result<Option<LoraLinear>> {
        let parts_wanted = self.cfg.targets_kind(spec.kind);
        if parts_wanted.is_empty() {
            return Ok(None);
        }
        let base = self.inner.linear(init, spec)?;
        let replicated = base
            .param_splits()
            .is_some_and(|v| v.iter().any(|(_, s)| *s == TpSplit::Replicated));
        if replicated && spec.kind.parallel_style() == ParallelStyle::Column {
            return Err(TuneError::config(
                "lora.targets",
                format!(
                    "{} is replicated over the tensor-parallel ranks (a degree above the \
                     key/value heads); adapters on it are not supported: leave k and v out of \
                     the targets or use a degree that divides n_kv_heads",
                    spec.name
                ),
            ));
        }
        let (tp, rank) = self
            .tp
            .as_ref()
            .map_or((1, 0), |c| (c.world_size(), c.rank()));
        let r = self.cfg.rank;
        let style = spec.kind.parallel_style();
        let out_part = spec.out_features / fused_parts(spec.kind);
        let fan_in = spec.in_features;
        // Kaiming-uniform with a = sqrt(5) (PEFT's A): the bound 1 / sqrt(fan_in), written as
        // Xavier-uniform over [r, fan_in] with the gain that gives it
        let gain = ((fan_in + r) as f64 / (6.0 * fan_in as f64)).sqrt();
        let (a_split, b_split) = match style {
            ParallelStyle::Column => (TpSplit::Replicated, TpSplit::Rows),
            ParallelStyle::Row => (TpSplit::Cols, TpSplit::Replicated),
        };
        let mut parts = Vec::with_capacity(parts_wanted.len());
        for (third, tag) in parts_wanted {
            let suffix = if tag.is_empty() {
                String::new()
            } else {
                format!("_{tag}")
            };
            let a_name = format!("{}.lora_A{suffix}.weight", spec.name);
            let b_name = format!("{}.lora_B{suffix}.weight", spec.name);
            let a_full = init.tensor(&a_name, &[r, fan_in], Init::XavierUniform { gain })?;
            let b_full = init.tensor(&b_name, &[out_part, r], Init::Zeros)?;
            let a = a_split.shard(&a_full, tp, rank)?;
            let b = b_split.shard(&b_full, tp, rank)?;
            parts.push(Part {
                third,
                a_name,
                b_name,
                a: Var::from_tensor(&a)?,
                b: Var::from_tensor(&b)?,
                a_split,
                b_split,
            });
        }
        Ok(Some(LoraLinear {
            name: spec.name.clone(),
            base,
            spec: spec.clone(),
            style,
            parts,
            scale: self.cfg.scale(),
            dropout: self.cfg.dropout,
            seed: init.seed(),
            tp: self.tp.clone(),
            merged: AtomicBool::new(false),
            control: self.control.clone(),
        }))
    }
}

impl<F: LayerFactory> LayerFactory for LoraFactory<F> {
    fn linear(
        &self,
        init: &Initializer,
        spec: &LinearSpec,
    ) -> kiln_model::Result<Box<dyn LinearLayer>> {
        let built = self
            .build(init, spec)
            .map_err(|e| kiln_model::ModelError::Candle(candle_core::Error::wrap(e)))?;
        match built {
            None => self.inner.linear(init, spec),
            Some(layer) => {
                let layer = Arc::new(layer);
                match self.built.lock() {
                    Ok(mut b) => b.push(layer.clone()),
                    Err(poisoned) => poisoned.into_inner().push(layer.clone()),
                }
                Ok(Box::new(Shared(layer)))
            }
        }
    }
}

/// Builds a GPT with LoRA adapters (dense, or this rank's Megatron shard over `tp` when it has
/// more than one rank) and freezes everything but the adapters: the model an engine then
/// trains holds gradients and optimizer state for the adapters only.
///
/// ```
/// # fn main() -> anyhow::Result<()> {
/// use candle_core::{Device, Tensor};
/// use kiln_model::{Gpt, GptConfig, GptOptions};
/// use kiln_tune::{lora_gpt, LoraConfig};
///
/// let cfg = GptConfig::tiny();
/// let (model, lora) = lora_gpt(&cfg, &GptOptions::seeded(3), &LoraConfig::default(), None)?;
/// let base = Gpt::new(&cfg, &GptOptions::seeded(3))?;
/// // B starts at zero: the adapted model is its base
/// let x = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu)?;
/// let diff = (model.forward(&x)? - base.forward(&x)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert_eq!(diff, 0.0);
/// // 2 blocks x (q, v) x (A [8, 128] + B [128, 8]) trainable
/// assert_eq!(model.num_trainable_parameters(), 2 * 2 * 2 * 8 * 128);
/// assert_eq!(lora.num_layers(), 2);
/// # Ok(()) }
/// ```
pub fn lora_gpt(
    cfg: &GptConfig,
    opts: &GptOptions,
    lora: &LoraConfig,
    tp: Option<TpComm>,
) -> Result<(Gpt, Lora)> {
    let (mut model, handle) = match tp.filter(|c| c.world_size() > 1) {
        Some(tp) => {
            let inner = TensorParallelFactory::for_config(tp.clone(), cfg);
            let factory = LoraFactory::new(inner, lora.clone(), Some(tp.clone()))?;
            let m = Gpt::tensor_parallel_with_factory(cfg, opts, tp, &factory)?;
            (m, factory.lora())
        }
        None => {
            let factory = LoraFactory::new(kiln_model::DenseFactory, lora.clone(), None)?;
            let m = Gpt::with_factory(cfg, opts, &factory)?;
            (m, factory.lora())
        }
    };
    model.freeze(|n| !is_adapter_param(n));
    Ok((model, handle))
}

/// The handle to every adapter of one model: merge and unmerge them into the base weights,
/// set the step that keys dropout, and save or load the adapters alone.
#[derive(Debug, Clone)]
pub struct Lora {
    layers: Vec<Arc<LoraLinear>>,
    cfg: LoraConfig,
    control: Arc<Control>,
    tp: Option<TpComm>,
}

impl Lora {
    /// The configuration.
    pub fn config(&self) -> &LoraConfig {
        &self.cfg
    }

    /// The number of adapted layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Every adapter variable (this rank's shard), by name.
    pub fn parameters(&self) -> Vec<(String, Var)> {
        self.layers
            .iter()
            .flat_map(|l| {
                l.parts.iter().flat_map(|p| {
                    [
                        (p.a_name.clone(), p.a.clone()),
                        (p.b_name.clone(), p.b.clone()),
                    ]
                })
            })
            .collect()
    }

    /// How each adapter variable splits over the tensor-parallel group.
    pub fn param_splits(&self) -> Vec<(String, TpSplit)> {
        self.layers
            .iter()
            .flat_map(|l| {
                l.parts
                    .iter()
                    .flat_map(|p| [(p.a_name.clone(), p.a_split), (p.b_name.clone(), p.b_split)])
            })
            .collect()
    }

    /// The number of adapter elements on this rank.
    pub fn num_parameters(&self) -> usize {
        self.parameters().iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Sets the training step that keys the dropout masks (call it before each step when
    /// [`LoraConfig::dropout`] is above zero).
    pub fn set_step(&self, step: u64) {
        self.control.step.store(step, Ordering::Relaxed);
    }

    /// Whether the adapters are merged into the base weights.
    pub fn is_merged(&self) -> bool {
        self.layers
            .first()
            .is_some_and(|l| l.merged.load(Ordering::Acquire))
    }

    /// Adds `(alpha / r) B A` to every adapted base weight (computed in f64) and stops running
    /// the adapters: the model then computes what it did with one matmul per layer, for
    /// inference or export. An error if already merged.
    pub fn merge(&self) -> Result<()> {
        if self.is_merged() {
            return Err(TuneError::config("lora", "the adapters are already merged"));
        }
        for l in &self.layers {
            l.fold(1.0)?;
            l.merged.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Subtracts the update [`Lora::merge`] added and runs the adapters again (PEFT's
    /// `unmerge_adapter`; the base weights come back up to one rounding of f32). An error if
    /// not merged.
    pub fn unmerge(&self) -> Result<()> {
        if !self.is_merged() {
            return Err(TuneError::config("lora", "the adapters are not merged"));
        }
        for l in &self.layers {
            l.fold(-1.0)?;
            l.merged.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// Every adapter as a whole (unsplit, `tp = 1` shaped) f32 tensor, gathered over the
    /// tensor-parallel group (collective over it), in [`Lora::parameters`] order.
    pub fn adapter_tensors(&self) -> Result<Vec<(String, TensorData)>> {
        let (tp, _) = self
            .tp
            .as_ref()
            .map_or((1, 0), |c| (c.world_size(), c.rank()));
        let mut out = Vec::new();
        for ((name, var), (_, split)) in self.parameters().into_iter().zip(self.param_splits()) {
            let local = var.as_tensor().to_dtype(DType::F32)?;
            let whole = match (&self.tp, split) {
                (Some(comm), s) if s != TpSplit::Replicated && tp > 1 => {
                    let mine: Vec<f32> = local.flatten_all()?.to_vec1()?;
                    let mut all = vec![0f32; mine.len() * tp];
                    comm.all_gather(&mine, &mut all)?;
                    let shards = all
                        .chunks(mine.len())
                        .map(|c| Tensor::from_slice(c, local.dims(), local.device()))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    s.unshard(&shards)?
                }
                _ => local,
            };
            let values: Vec<f32> = whole.flatten_all()?.to_vec1()?;
            out.push((name, TensorData::from_slice(whole.dims(), &values)?));
        }
        Ok(out)
    }

    /// Writes the adapters alone, whole: `adapter_model.safetensors` (f32, names as
    /// [`Lora::parameters`], metadata `{"format": "pt"}`, readable by Python's `safetensors`)
    /// and `adapter_config.json` (the [`LoraConfig`]) into `dir`. Collective over the
    /// tensor-parallel group; its rank 0 writes.
    pub fn save_adapter(&self, dir: &Path) -> Result<()> {
        let tensors = self.adapter_tensors()?;
        if self.tp.as_ref().is_some_and(|c| c.rank() != 0) {
            return Ok(());
        }
        std::fs::create_dir_all(dir).map_err(|e| TuneError::io(dir, e))?;
        kiln_model::hf::write_safetensors(&dir.join(ADAPTER_WEIGHTS_FILE), &tensors)?;
        let json = serde_json::to_string_pretty(&self.cfg)
            .map_err(|e| TuneError::config("lora", e.to_string()))?;
        let path = dir.join(ADAPTER_CONFIG_FILE);
        std::fs::write(&path, json).map_err(|e| TuneError::io(&path, e))?;
        Ok(())
    }

    /// Reads adapters [`Lora::save_adapter`] wrote (at any tensor-parallel degree) into this
    /// model's adapters, each rank keeping its shard. The saved configuration must equal this
    /// one; a missing, unknown or misshapen tensor is an error naming it.
    pub fn load_adapter(&self, dir: &Path) -> Result<()> {
        let cfg_path = dir.join(ADAPTER_CONFIG_FILE);
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| TuneError::io(&cfg_path, e))?;
        let saved: LoraConfig = serde_json::from_str(&text).map_err(|e| TuneError::Tensor {
            name: "config".into(),
            file: cfg_path.display().to_string(),
            reason: e.to_string(),
        })?;
        if saved != self.cfg {
            return Err(TuneError::input(
                format!("the adapter in {}", dir.display()),
                format!("{:?}", self.cfg),
                format!("{saved:?}"),
            ));
        }
        let path = dir.join(ADAPTER_WEIGHTS_FILE);
        let tensors = kiln_model::hf::read_safetensors(&path)?;
        let (tp, rank) = self
            .tp
            .as_ref()
            .map_or((1, 0), |c| (c.world_size(), c.rank()));
        let file = path.display().to_string();
        let params = self.parameters();
        if let Some((extra, _)) = tensors
            .iter()
            .find(|(n, _)| !params.iter().any(|(p, _)| p == n))
        {
            return Err(TuneError::Tensor {
                name: extra.clone(),
                file,
                reason: "not an adapter of this model".into(),
            });
        }
        for ((name, var), (_, split)) in params.into_iter().zip(self.param_splits()) {
            let bad = |reason: String| TuneError::Tensor {
                name: name.clone(),
                file: file.clone(),
                reason,
            };
            let t = tensors
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, t)| t)
                .ok_or_else(|| bad("missing".into()))?;
            let values: Vec<f32> = t.to_vec().map_err(|e| bad(e.to_string()))?;
            let whole = Tensor::from_vec(values, t.shape(), var.device())?;
            let local = split
                .shard(&whole, tp, rank)
                .map_err(|e| bad(e.to_string()))?;
            if local.dims() != var.dims() {
                return Err(bad(format!(
                    "shape {:?} gives this rank {:?}, the adapter holds {:?}",
                    t.shape(),
                    local.dims(),
                    var.dims()
                )));
            }
            var.set(&local.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }
}
