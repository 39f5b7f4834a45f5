//! Parameter groups: which parameters get weight decay. PyTorch expresses this with parameter
//! groups (`[{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]`);
//! kiln's optimizers run over one flat buffer, so a group is a set of ranges of it
//! ([`DecayOverride`]), and [`WeightDecayGroups`] decides, from what each parameter is
//! ([`ParamKind`], which the model reports), which ranges those are.

use crate::error::{OptimError, Result};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// A range of the buffer with its own weight decay (PyTorch's parameter groups, for the one
/// option that differs between groups in LLM training: no decay on biases, norms and
/// embeddings).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecayOverride {
    /// Indices into the optimizer's buffer.
    pub range: Range<usize>,
    /// The weight decay of these elements, at least 0.
    pub weight_decay: f64,
}

impl DecayOverride {
    /// The overrides of a whole buffer (sorted, disjoint) as seen by the shard holding
    /// `shard` of it: clipped to the shard and shifted to start at 0. An optimizer over that
    /// shard with these overrides computes bitwise what the whole buffer's optimizer computes.
    pub fn for_shard(whole: &[DecayOverride], shard: Range<usize>) -> Vec<DecayOverride> {
        whole
            .iter()
            .filter_map(|o| {
                let start = o.range.start.max(shard.start);
                let end = o.range.end.min(shard.end);
                (start < end).then(|| DecayOverride {
                    range: start - shard.start..end - shard.start,
                    weight_decay: o.weight_decay,
                })
            })
            .collect()
    }
}

/// Checks overrides for a buffer of `len` elements: sorted, disjoint, inside it, each decay
/// finite and at least 0.
pub(crate) fn check_overrides(overrides: &[DecayOverride], len: usize) -> Result<()> {
    let mut end = 0;
    for o in overrides {
        if o.range.start < end || o.range.end < o.range.start || o.range.end > len {
            return Err(OptimError::BadRange {
                what: "weight decay override",
                start: o.range.start,
                end: o.range.end,
                len,
            });
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return Err(OptimError::InvalidHyperparameter {
                name: "weight_decay",
                value: o.weight_decay,
                reason: "must be finite and at least 0",
            });
        }
        end = o.range.end;
    }
    Ok(())
}

/// What a parameter is, as far as the optimizer's options are concerned. The model reports it
/// for each of its parameters (`kiln_model::Gpt::param_kinds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamKind {
    /// The weight matrix of a linear layer.
    Weight,
    /// A bias vector.
    Bias,
    /// The gain or shift of a normalisation layer (LayerNorm, RMSNorm).
    Norm,
    /// An embedding table (tokens, positions); with tied embeddings also the output head.
    Embedding,
}

/// Which parameters get weight decay. The default is the GPT-3 convention (also Megatron's for
/// biases and norms, and nanoGPT's for every vector): only the weight matrices of linear layers
/// decay; biases, normalisation gains and embeddings do not. [`WeightDecayGroups::all`] decays
/// every parameter, as one PyTorch parameter group does.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WeightDecayGroups {
    /// Decay biases.
    pub bias: bool,
    /// Decay normalisation gains and shifts.
    pub norm: bool,
    /// Decay embedding tables.
    pub embedding: bool,
    /// Parameters (full names) that never decay, whatever their kind.
    pub exclude: Vec<String>,
}

impl WeightDecayGroups {
    /// Every parameter decays (PyTorch's single parameter group).
    pub fn all() -> Self {
        WeightDecayGroups {
            bias: true,
            norm: true,
            embedding: true,
            exclude: Vec::new(),
        }
    }

    /// Whether the parameter `name` of kind `kind` decays.
    pub fn decays(&self, name: &str, kind: ParamKind) -> bool {
        let by_kind = match kind {
            ParamKind::Weight => true,
            ParamKind::Bias => self.bias,
            ParamKind::Norm => self.norm,
            ParamKind::Embedding => self.embedding,
        };
        by_kind && !self.exclude.iter().any(|e| e == name)
    }

    /// The names among `params` that do not decay. A name in [`WeightDecayGroups::exclude`]
    /// that is not among `params` is an error (a typo would otherwise silently decay the
    /// parameter it meant).
    pub fn no_decay(&self, params: &[(String, ParamKind)]) -> Result<Vec<String>> {
        if let Some(e) = self
            .exclude
            .iter()
            .find(|e| !params.iter().any(|(n, _)| n == *e))
        {
            return Err(OptimError::UnknownParameter {
                what: "WeightDecayGroups.exclude",
                name: e.clone(),
            });
        }
        Ok(params
            .iter()
            .filter(|(n, k)| !self.decays(n, *k))
            .map(|(n, _)| n.clone())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Vec<(String, ParamKind)> {
        [
            ("wte", ParamKind::Embedding),
            ("h.0.ln_1.weight", ParamKind::Norm),
            ("h.0.attn.c_attn.weight", ParamKind::Weight),
            ("h.0.attn.c_attn.bias", ParamKind::Bias),
        ]
        .into_iter()
        .map(|(n, k)| (n.to_string(), k))
        .collect()
    }

    #[test]
    fn default_decays_only_weights() {
        let off = WeightDecayGroups::default().no_decay(&params()).unwrap();
        assert_eq!(off, ["wte", "h.0.ln_1.weight", "h.0.attn.c_attn.bias"]);
        assert!(WeightDecayGroups::all()
            .no_decay(&params())
            .unwrap()
            .is_empty());
    }

    #[test]
    fn exclude_names_a_parameter_or_fails() {
        let g = WeightDecayGroups {
            exclude: vec!["h.0.attn.c_attn.weight".into()],
            ..WeightDecayGroups::all()
        };
        assert_eq!(g.no_decay(&params()).unwrap(), ["h.0.attn.c_attn.weight"]);
        let typo = WeightDecayGroups {
            exclude: vec!["h.0.attn.c_atn.weight".into()],
            ..Default::default()
        };
        let e = typo.no_decay(&params()).unwrap_err().to_string();
        assert!(e.contains("h.0.attn.c_atn.weight"), "{e}");
    }
}
