//! Int8 quantization-aware training (Jacob et al., 2018; PyTorch's `torch.ao.quantization`
//! QAT): the linear layers of the GPT blocks compute with fake-quantized weights (per output
//! channel, symmetric int8) and optionally fake-quantized inputs (per tensor, symmetric int8,
//! from an observed range), with the straight-through estimator in backward, so the model
//! learns weights that survive the rounding. [`crate::int8`] then exports real int8 weights
//! and runs them.
//!
//! Fake quantization of `x` with scale `s`: `q(x) = clamp(round(x / s), -127, 127) * s`;
//! backward passes the gradient where `|round(x / s)| <= 127` (inside the clip range) and zero
//! outside.
//! Weight scales are `max |w_row| / 127`, recomputed every forward (never outside the range);
//! under tensor parallelism a row-parallel shard takes the maximum over the group, so the
//! scales are the whole row's. Activation ranges come from an observer per layer: a step's
//! forward quantizes with the range known before the step and records the largest `|x|` it
//! saw; [`Qat::update_observers`] then takes the maximum over all ranks and moves the range
//! by an exponential moving average (PyTorch's `MovingAverageMinMaxObserver`). Because every
//! rank quantizes with the same range and the range is a maximum over the whole global batch,
//! a data- or tensor-parallel run quantizes as one rank would. Until the first update a layer's
//! input passes unquantized.

use crate::error::{Result, TuneError};
use crate::shared::Shared;
use candle_core::{DType, Tensor, Var};
use kiln_comm::{CommExt, Communicator, ReduceOp};
use kiln_model::{
    Gpt, GptConfig, GptOptions, Initializer, LayerFactory, LinearLayer, LinearSpec, ParallelStyle,
    ParamSource, TensorParallelFactory,
};
use kiln_optim::ParamKind;
use kiln_parallel::tp::{all_reduce_tensor, TpComm, TpSplit};
use kiln_state::{StateDict, Stateful};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// The largest int8 magnitude used (symmetric: -127..=127).
pub const QMAX: f64 = 127.0;

/// What quantization-aware training quantizes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QatConfig {
    /// Also fake-quantize each linear layer's input (per tensor, observed range): W8A8.
    /// Without it only the weights are (W8A32).
    pub activations: bool,
    /// The observer's moving-average constant `c`: `range += c (seen - range)` after each step
    /// (PyTorch's `averaging_constant`, 0.01).
    pub averaging_constant: f64,
}

impl Default for QatConfig {
    fn default() -> Self {
        Self {
            activations: true,
            averaging_constant: 0.01,
        }
    }
}

impl QatConfig {
    /// Checks the fields, naming the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        if !(self.averaging_constant > 0.0 && self.averaging_constant <= 1.0) {
            return Err(TuneError::config(
                "qat.averaging_constant",
                format!("must be in (0, 1], got {}", self.averaging_constant),
            ));
        }
        Ok(())
    }
}

/// Fake-quantizes `x` with `scale` (broadcast against `x`; every element positive):
/// `clamp(round(x / scale), -127, 127) * scale` forward, the gradient passed where
/// `|round(x / scale)| <= 127` and zero elsewhere (the straight-through estimator with
/// clipping, as PyTorch's `fake_quantize_per_channel_affine`).
pub fn fake_quantize(x: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let scale = scale.to_dtype(x.dtype())?.detach();
    let rounded = x.detach().broadcast_div(&scale)?.round()?;
    let q = rounded.clamp(-QMAX, QMAX)?.broadcast_mul(&scale)?;
    // inside the clip range: the rounded value is representable (PyTorch's mask)
    let inside = rounded.abs()?.le(QMAX)?.to_dtype(x.dtype())?;
    // value: exactly q; gradient: the mask
    let masked = (x * &inside)?;
    Ok((q + (&masked - masked.detach())?)?)
}

/// Per-row scales `[out, 1]` of a weight `[out, in]`: `max |w_row| / 127` (1 for an all-zero
/// row), the maximum taken over `tp` for a row-parallel shard.
pub fn weight_scales(w: &Tensor, row_parallel: Option<&TpComm>) -> Result<Tensor> {
    let mut amax = w.detach().abs()?.max_keepdim(1)?;
    if let Some(tp) = row_parallel {
        amax = all_reduce_tensor(&amax.contiguous()?, ReduceOp::Max, tp)?;
    }
    let zero = amax.eq(0.0)?.to_dtype(amax.dtype())?;
    Ok((amax.affine(1.0 / QMAX, 0.0)? + zero)?)
}

/// One layer's activation observer.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Observer {
    /// The range `max |x|` quantization uses (0: not yet observed).
    amax: f32,
    /// The largest `|x|` seen since the last update.
    seen: f32,
}

/// A linear layer computing with fake-quantized weights (and inputs).
#[derive(Debug)]
pub struct QatLinear {
    name: String,
    base: Box<dyn LinearLayer>,
    spec: LinearSpec,
    weight_name: String,
    row_tp: Option<TpComm>,
    activations: bool,
    observer: Mutex<Observer>,
}

/// A parameter source that answers one name with a given tensor and the rest from another.
struct Overlay<'a> {
    inner: &'a dyn ParamSource,
    name: &'a str,
    value: Tensor,
}

impl ParamSource for Overlay<'_> {
    fn param(&self, name: &str) -> kiln_model::Result<Tensor> {
        if name == self.name {
            Ok(self.value.clone())
        } else {
            self.inner.param(name)
        }
    }
}

impl QatLinear {
    /// The layer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn observer(&self) -> Observer {
        match self.observer.lock() {
            Ok(o) => *o,
            Err(p) => *p.into_inner(),
        }
    }

    fn with_observer(&self, f: impl FnOnce(&mut Observer)) {
        match self.observer.lock() {
            Ok(mut o) => f(&mut o),
            Err(p) => f(&mut p.into_inner()),
        }
    }

    /// The input scale `range / 127`, once the observer has a range.
    pub fn input_scale(&self) -> Option<f32> {
        let o = self.observer();
        (self.activations && o.amax > 0.0).then(|| o.amax / QMAX as f32)
    }

    fn quantized_inputs(&self, x: &Tensor) -> Result<Tensor> {
        if !self.activations {
            return Ok(x.clone());
        }
        let seen = x
            .detach()
            .abs()?
            .max_all()?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?;
        self.with_observer(|o| o.seen = o.seen.max(seen));
        match self.input_scale() {
            Some(s) => fake_quantize(x, &Tensor::new(s, x.device())?),
            None => Ok(x.clone()),
        }
    }

    fn prepared<'a>(&'a self, x: &Tensor, p: &'a dyn ParamSource) -> Result<(Tensor, Overlay<'a>)> {
        let x = self.quantized_inputs(x)?;
        let w = p.param(&self.weight_name)?;
        let s = weight_scales(&w, self.row_tp.as_ref())?;
        let wq = fake_quantize(&w, &s)?;
        Ok((
            x,
            Overlay {
                inner: p,
                name: &self.weight_name,
                value: wq,
            },
        ))
    }
}

fn wrap(e: TuneError) -> kiln_model::ModelError {
    kiln_model::ModelError::Candle(candle_core::Error::wrap(e))
}

impl LinearLayer for QatLinear {
    fn forward_with(&self, x: &Tensor, params: &dyn ParamSource) -> kiln_model::Result<Tensor> {
        let (x, p) = self.prepared(x, params).map_err(wrap)?;
        self.base.forward_with(&x, &p)
    }

    fn forward_gelu_with(
        &self,
        x: &Tensor,
        params: &dyn ParamSource,
    ) -> kiln_model::Result<Tensor> {
        let (x, p) = self.prepared(x, params).map_err(wrap)?;
        self.base.forward_gelu_with(&x, &p)
    }

    fn parameters(&self) -> Vec<(String, Var)> {
        self.base.parameters()
    }

    fn local_out_features(&self) -> usize {
        self.base.local_out_features()
    }

    fn param_splits(&self) -> Option<Vec<(String, TpSplit)>> {
        Some(
            self.base
                .param_splits()
                .unwrap_or_else(|| self.spec.param_splits()),
        )
    }

    fn param_kinds(&self) -> Option<Vec<(String, ParamKind)>> {
        Some(
            self.base
                .param_kinds()
                .unwrap_or_else(|| self.spec.param_kinds()),
        )
    }
}

/// Wraps another [`LayerFactory`] (dense, or Megatron's over `tp`) so that every linear layer
/// of the blocks trains with fake quantization; [`QatFactory::qat`] gives the handle to the
/// observers. The embedding and the tied head stay in floating point.
pub struct QatFactory<F: LayerFactory> {
    inner: F,
    cfg: QatConfig,
    tp: Option<TpComm>,
    built: Mutex<Vec<Arc<QatLinear>>>,
}

impl<F: LayerFactory> std::fmt::Debug for QatFactory<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QatFactory")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl<F: LayerFactory> QatFactory<F> {
    /// Fake quantization from `cfg` around the layers `inner` builds over `tp`.
    pub fn new(inner: F, cfg: QatConfig, tp: Option<TpComm>) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            inner,
            cfg,
            tp: tp.filter(|c| c.world_size() > 1),
            built: Mutex::new(Vec::new()),
        })
    }

    /// The handle to every layer built so far.
    pub fn qat(&self) -> Qat {
        let layers = match self.built.lock() {
            Ok(b) => b.clone(),
            Err(p) => p.into_inner().clone(),
        };
        Qat {
            layers,
            cfg: self.cfg,
        }
    }
}

impl<F: LayerFactory> LayerFactory for QatFactory<F> {
    fn linear(
        &self,
        init: &Initializer,
        spec: &LinearSpec,
    ) -> kiln_model::Result<Box<dyn LinearLayer>> {
        let base = self.inner.linear(init, spec)?;
        let row_tp = match spec.kind.parallel_style() {
            ParallelStyle::Row => self.tp.clone(),
            ParallelStyle::Column => None,
        };
        let layer = Arc::new(QatLinear {
            name: spec.name.clone(),
            base,
            spec: spec.clone(),
            weight_name: format!("{}.weight", spec.name),
            row_tp,
            activations: self.cfg.activations,
            observer: Mutex::new(Observer::default()),
        });
        match self.built.lock() {
            Ok(mut b) => b.push(layer.clone()),
            Err(p) => p.into_inner().push(layer.clone()),
        }
        Ok(Box::new(Shared(layer)))
    }
}

/// Builds a GPT whose block linear layers train with fake quantization (dense, or this rank's
/// Megatron shard over `tp` when it has more than one rank).
pub fn qat_gpt(
    cfg: &GptConfig,
    opts: &GptOptions,
    qat: &QatConfig,
    tp: Option<TpComm>,
) -> Result<(Gpt, Qat)> {
    match tp.filter(|c| c.world_size() > 1) {
        Some(tp) => {
            let inner = TensorParallelFactory::for_config(tp.clone(), cfg);
            let f = QatFactory::new(inner, *qat, Some(tp.clone()))?;
            let m = Gpt::tensor_parallel_with_factory(cfg, opts, tp, &f)?;
            Ok((m, f.qat()))
        }
        None => {
            let f = QatFactory::new(kiln_model::DenseFactory, *qat, None)?;
            let m = Gpt::with_factory(cfg, opts, &f)?;
            Ok((m, f.qat()))
        }
    }
}

/// The handle to a model's fake-quantized layers: their activation observers (updated after
/// each step, saved and restored as a [`Stateful`] component) and the scales an int8 export
/// writes.
#[derive(Debug, Clone)]
pub struct Qat {
    layers: Vec<Arc<QatLinear>>,
    cfg: QatConfig,
}

impl Qat {
    /// The configuration.
    pub fn config(&self) -> &QatConfig {
        &self.cfg
    }

    /// The fake-quantized layers.
    pub fn layers(&self) -> &[Arc<QatLinear>] {
        &self.layers
    }

    /// After a step: takes the largest input magnitude each layer saw over every rank of
    /// `world` (collective over it: every data- and tensor-parallel rank; `None` for one
    /// rank) and moves each layer's range towards it. The first update sets the range.
    pub fn update_observers(&self, world: Option<&dyn Communicator>) -> Result<()> {
        if !self.cfg.activations {
            return Ok(());
        }
        let mut seen: Vec<f32> = self.layers.iter().map(|l| l.observer().seen).collect();
        if let Some(w) = world {
            w.all_reduce(&mut seen, ReduceOp::Max)?;
        }
        let c = self.cfg.averaging_constant as f32;
        for (l, s) in self.layers.iter().zip(seen) {
            l.with_observer(|o| {
                o.amax = if o.amax > 0.0 {
                    o.amax + c * (s - o.amax)
                } else {
                    s
                };
                o.seen = 0.0;
            });
        }
        Ok(())
    }

    /// Each layer's input range `max |x|` (0 before the first update), by layer name.
    pub fn ranges(&self) -> Vec<(String, f32)> {
        self.layers
            .iter()
            .map(|l| (l.name.clone(), l.observer().amax))
            .collect()
    }
}

impl Stateful for Qat {
    /// The observed ranges (`ranges`, one per layer in build order, with the layer names in
    /// the metadata); the same on every rank.
    fn state(&self) -> kiln_state::Result<StateDict> {
        let mut sd = StateDict::new();
        let r: Vec<f32> = self.layers.iter().map(|l| l.observer().amax).collect();
        sd.put("ranges", &[r.len()], &r)?;
        let names: Vec<String> = self.layers.iter().map(|l| l.name.clone()).collect();
        sd.set_meta("layers", names)?;
        Ok(sd)
    }

    fn load_state(&mut self, state: StateDict) -> kiln_state::Result<()> {
        let names: Vec<String> = state.meta("layers")?;
        let mine: Vec<String> = self.layers.iter().map(|l| l.name.clone()).collect();
        if names != mine {
            return Err(kiln_state::StateError::component(
                "qat observers",
                format!(
                    "saved for {} layers ({}...), this model has {}",
                    names.len(),
                    names.first().map_or("", String::as_str),
                    mine.len()
                ),
            ));
        }
        let r: Vec<f32> = state.get_shaped("ranges", &[mine.len()])?;
        for (l, a) in self.layers.iter().zip(r) {
            l.with_observer(|o| {
                o.amax = a;
                o.seen = 0.0;
            });
        }
        Ok(())
    }
}
