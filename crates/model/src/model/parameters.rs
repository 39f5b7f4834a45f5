//! The parameters of a [`Gpt`]: the lists a training engine takes (per segment, with their
//! tensor-parallel splits and their kinds for weight-decay groups), freezing (PyTorch's
//! `requires_grad_(False)`), lookup by name, and loading full (unsplit) values into this rank's
//! slices.

use super::Gpt;
use crate::error::{ModelError, Result};
use crate::options::Segment;
use candle_core::{Tensor, Var};
use kiln_optim::ParamKind;
use kiln_parallel::tp::TpSplit;
use std::collections::HashMap;

impl Gpt {
    /// Freezes every parameter whose name `frozen` accepts and makes every other one trainable
    /// (PyTorch's `requires_grad_`): frozen parameters keep their values, are read as constants
    /// (no gradient is computed for them) and leave [`Gpt::segment_param_lists`],
    /// [`Gpt::param_splits`] and [`Gpt::param_kinds`], so an engine built afterwards holds no
    /// gradient buffer, master copy or optimizer state for them. Call it before building the
    /// engine. Returns the number of frozen parameters (tensors).
    pub fn freeze(&mut self, frozen: impl Fn(&str) -> bool) -> usize {
        self.frozen = self
            .named_parameters()
            .into_iter()
            .filter(|(n, _)| frozen(n))
            .map(|(n, v)| (n, v.as_tensor().detach()))
            .collect();
        self.frozen.len()
    }

    /// Makes every parameter trainable again.
    pub fn unfreeze_all(&mut self) {
        self.frozen.clear();
    }

    /// Whether the parameter called `name` is frozen.
    pub fn is_frozen(&self, name: &str) -> bool {
        self.frozen.contains_key(name)
    }

    /// The parameters that train (not frozen), in [`Gpt::named_parameters`] order.
    pub fn trainable_parameters(&self) -> Vec<(String, Var)> {
        self.named_parameters()
            .into_iter()
            .filter(|(n, _)| !self.is_frozen(n))
            .collect()
    }

    /// The number of trainable elements held by this rank.
    pub fn num_trainable_parameters(&self) -> usize {
        self.trainable_parameters()
            .iter()
            .map(|(_, v)| v.elem_count())
            .sum()
    }

    /// Per segment (in execution order), every trainable parameter the segment reads: its own
    /// and the tied ones (the head lists `wte` too); frozen ones are left out. The input of
    /// `kiln_parallel::DataParallel::new`.
    pub fn segment_param_lists(&self) -> Vec<Vec<(String, Var)>> {
        self.segments()
            .into_iter()
            .map(|s| {
                let mut v = self.segment_parameters(s);
                v.extend(self.tied_parameters(s));
                v.retain(|(n, _)| !self.is_frozen(n));
                v
            })
            .collect()
    }

    /// Every trainable parameter with how it is split over tensor-parallel ranks: the
    /// vocab-parallel `wte` by rows, each linear layer as its
    /// [`LinearSpec::param_splits`](crate::LinearSpec::param_splits) (or the layer itself,
    /// [`LinearLayer::param_splits`](crate::LinearLayer::param_splits)) says, the position
    /// embedding and the LayerNorms replicated. The same list at every degree (tp = 1 included), in
    /// [`Gpt::named_parameters`] order; data-parallel engines use it to count replicated
    /// gradients once in the global norm and to lay out checkpoints.
    pub fn param_splits(&self) -> Vec<(String, TpSplit)> {
        let mut all = self.all_param_splits();
        all.retain(|(n, _)| !self.is_frozen(n));
        all
    }

    /// [`Gpt::param_splits`] of every parameter, frozen ones included.
    pub fn all_param_splits(&self) -> Vec<(String, TpSplit)> {
        let linear: HashMap<&str, TpSplit> = self
            .blocks
            .iter()
            .flat_map(|b| b.splits.iter().map(|(n, s)| (n.as_str(), *s)))
            .collect();
        self.named_parameters()
            .into_iter()
            .map(|(n, _)| {
                let split = if n == "wte" || n == "lm_head" {
                    TpSplit::Rows
                } else {
                    linear
                        .get(n.as_str())
                        .copied()
                        .unwrap_or(TpSplit::Replicated)
                };
                (n, split)
            })
            .collect()
    }

    /// Every trainable parameter with what it is, for the optimizer's parameter groups
    /// ([`kiln_optim::WeightDecayGroups`]): `wte` and `wpe` embeddings, each linear layer's weight
    /// and bias as its [`LinearSpec::param_kinds`](crate::LinearSpec::param_kinds) (or the layer
    /// itself) says, the LayerNorms' gains and shifts norms. In [`Gpt::named_parameters`] order.
    pub fn param_kinds(&self) -> Vec<(String, ParamKind)> {
        let linear: HashMap<&str, ParamKind> = self
            .blocks
            .iter()
            .flat_map(|b| b.kinds.iter().map(|(n, k)| (n.as_str(), *k)))
            .collect();
        self.trainable_parameters()
            .into_iter()
            .map(|(n, _)| {
                let kind = match n.as_str() {
                    "wte" | "wpe" => ParamKind::Embedding,
                    "lm_head" => ParamKind::Weight,
                    other => linear.get(other).copied().unwrap_or(ParamKind::Norm),
                };
                (n, kind)
            })
            .collect()
    }

    /// Sets every parameter from its whole (unsplit) tensor: `params` names each one as
    /// [`Gpt::named_parameters`] does, with the shape of the `tp = 1` model (a checkpoint's
    /// fused QKV `[3, d, in]` is accepted for `[3d, in]`: the same bytes); this rank keeps its
    /// tensor-parallel shard ([`Gpt::param_splits`]), converted to the parameters' dtype. What
    /// [`crate::hf::load_hf_dir`] and a consolidated checkpoint give. Every parameter of the
    /// architecture must be given once (frozen or not); parameters a layer adds of its own (a
    /// LoRA adapter's) are not part of it and keep their values. A missing, unknown or
    /// misshapen tensor is an error naming it.
    pub fn load_full_parameters(&self, params: &[(String, kiln_state::TensorData)]) -> Result<()> {
        let (tp, rank) = self
            .tp
            .as_ref()
            .map_or((1, 0), |c| (c.world_size(), c.rank()));
        let whole: HashMap<String, Vec<usize>> =
            crate::hf::gpt_param_shapes(&self.cfg).into_iter().collect();
        let mut given: HashMap<&str, &kiln_state::TensorData> = HashMap::new();
        for (n, t) in params {
            if !whole.contains_key(n) {
                return Err(ModelError::HfTensor {
                    tensor: n.clone(),
                    reason: "not a parameter of this model".into(),
                });
            }
            if given.insert(n.as_str(), t).is_some() {
                return Err(ModelError::HfTensor {
                    tensor: n.clone(),
                    reason: "given twice".into(),
                });
            }
        }
        let vars: HashMap<String, Var> = self.named_parameters().into_iter().collect();
        for (name, split) in self.all_param_splits() {
            if !whole.contains_key(&name) {
                // a layer's own parameter (an adapter), not the architecture's
                continue;
            }
            let bad = |reason: String| ModelError::HfTensor {
                tensor: name.clone(),
                reason,
            };
            let t = given
                .get(name.as_str())
                .ok_or_else(|| bad("missing".into()))?;
            let shape = whole
                .get(&name)
                .ok_or_else(|| bad("not a parameter of this model".into()))?;
            let numel: usize = shape.iter().product();
            // a checkpoint's fused QKV `[3, d, in]` or gate and up `[2, f, in]`
            let fused = split.parts() > 1
                && t.shape().first() == Some(&split.parts())
                && t.numel() == numel;
            if t.shape() != shape.as_slice() && !fused {
                return Err(bad(format!("shape {:?}, expected {shape:?}", t.shape())));
            }
            let values: Vec<f32> = t
                .to_vec()
                .map_err(|e| bad(format!("{e} (expected f32 values)")))?;
            let var = vars
                .get(&name)
                .ok_or_else(|| bad("the model has no such variable".into()))?;
            let full = Tensor::from_vec(values, shape.as_slice(), var.device())?;
            let local = split.shard(&full, tp, rank)?.to_dtype(var.dtype())?;
            if local.dims() != var.dims() {
                return Err(bad(format!(
                    "this rank's shard is {:?} but the model holds {:?}",
                    local.dims(),
                    var.dims()
                )));
            }
            var.set(&local)?;
        }
        Ok(())
    }

    /// Every trainable parameter with its name, in a fixed order: `wte`, `wpe` (learned
    /// positions), the blocks in order (`ln_1`, `attn.c_attn` or `attn.q_proj`,
    /// `attn.k_proj`, `attn.v_proj`, `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`; weight
    /// before bias), `ln_f`, `lm_head` (untied). The concatenation of the segments' own
    /// parameters.
    pub fn named_parameters(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        for seg in self.segments() {
            out.extend(self.segment_parameters(seg));
        }
        out
    }

    /// The parameter called `name` ([`Gpt::named_parameters`] spelling), if any.
    pub fn parameter(&self, name: &str) -> Option<Var> {
        self.named_parameters()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }

    /// The parameters a segment owns (its gradient comes from its own backward). `wte` is
    /// owned by `Embed`; see [`Gpt::tied_parameters`]. A block index out of range gives an
    /// empty list.
    pub fn segment_parameters(&self, seg: Segment) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        match seg {
            Segment::Embed => {
                out.push(("wte".to_string(), self.wte.clone()));
                if let Some(wpe) = &self.wpe {
                    out.push(("wpe".to_string(), wpe.clone()));
                }
            }
            Segment::Block(i) => {
                if let Some(b) = self.blocks.get(i) {
                    b.parameters(&mut out);
                }
            }
            Segment::Head => {
                self.ln_f.parameters(&mut out);
                if let Some(w) = &self.lm_head {
                    out.push(("lm_head".to_string(), w.clone()));
                }
            }
        }
        out
    }

    /// Parameters a segment reads but another segment owns: `[wte]` for `Head` when the LM
    /// head is tied, nothing otherwise.
    pub fn tied_parameters(&self, seg: Segment) -> Vec<(String, Var)> {
        match seg {
            Segment::Head if self.lm_head.is_none() => {
                vec![("wte".to_string(), self.wte.clone())]
            }
            _ => Vec::new(),
        }
    }

    /// The number of trainable elements actually held (equals [`GptConfig::param_count`](crate::GptConfig::param_count)
    /// for dense layers).
    pub fn num_parameters(&self) -> usize {
        self.named_parameters()
            .iter()
            .map(|(_, v)| v.elem_count())
            .sum()
    }
}
