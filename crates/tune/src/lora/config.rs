//! What a LoRA run adapts: [`LoraTarget`] (PEFT's `target_modules`) and [`LoraConfig`].

use crate::error::{Result, TuneError};
use kiln_model::LinearKind;
use serde::{Deserialize, Serialize};

/// A projection of a block that can carry an adapter (PEFT's `target_modules`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraTarget {
    /// The query projection (the query third of a fused QKV projection).
    Q,
    /// The key projection (or third).
    K,
    /// The value projection (or third).
    V,
    /// The attention output projection.
    O,
    /// The MLP's first layer: a GELU MLP's fc1, or both halves of a SwiGLU's fused gate and
    /// up.
    Fc1,
    /// The MLP's second layer (a SwiGLU's down projection).
    Fc2,
    /// The gate half of a SwiGLU's fused gate and up projection.
    Gate,
    /// The up half of a SwiGLU's fused gate and up projection.
    Up,
    /// A SwiGLU's down projection (the MLP's second layer, as [`LoraTarget::Fc2`]).
    Down,
}

impl LoraTarget {
    /// Every target of a GPT block.
    pub const ALL: [LoraTarget; 6] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Fc1,
        LoraTarget::Fc2,
    ];
}

/// The adapter's shape and where it goes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// The rank `r` of `B A`.
    pub rank: usize,
    /// The scale numerator: the update is `(alpha / r) B A`.
    pub alpha: f64,
    /// Dropout on the adapter's input during training (0 disables it).
    pub dropout: f64,
    /// The projections that get an adapter.
    pub targets: Vec<LoraTarget>,
}

impl Default for LoraConfig {
    /// Rank 8, alpha 16, no dropout, on the query and value projections (the LoRA paper's
    /// choice).
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            targets: vec![LoraTarget::Q, LoraTarget::V],
        }
    }
}

impl LoraConfig {
    /// Checks every field, naming the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(TuneError::config("lora.rank", "must be at least 1, got 0"));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(TuneError::config(
                "lora.alpha",
                format!("must be a positive number, got {}", self.alpha),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(TuneError::config(
                "lora.dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            ));
        }
        if self.targets.is_empty() {
            return Err(TuneError::config(
                "lora.targets",
                "must name at least one of q, k, v, o, fc1, fc2, gate, up, down",
            ));
        }
        let mut seen = self.targets.clone();
        seen.sort();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(TuneError::config(
                "lora.targets",
                format!("{:?} is listed twice", w[0]),
            ));
        }
        Ok(())
    }

    /// The update's scale `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    pub(super) fn targets_kind(&self, kind: LinearKind) -> Vec<(usize, &'static str)> {
        let has = |t| self.targets.contains(&t);
        let single = |t: LoraTarget| if has(t) { vec![(0, "")] } else { Vec::new() };
        match kind {
            LinearKind::MlpGateUp => [(LoraTarget::Gate, "gate"), (LoraTarget::Up, "up")]
                .into_iter()
                .enumerate()
                .filter(|(_, (t, _))| has(*t) || has(LoraTarget::Fc1))
                .map(|(i, (_, s))| (i, s))
                .collect(),
            LinearKind::AttnQ => single(LoraTarget::Q),
            LinearKind::AttnK => single(LoraTarget::K),
            LinearKind::AttnV => single(LoraTarget::V),
            LinearKind::MlpDown if has(LoraTarget::Down) => vec![(0, "")],
            LinearKind::AttnQkv => [
                (LoraTarget::Q, "q"),
                (LoraTarget::K, "k"),
                (LoraTarget::V, "v"),
            ]
            .into_iter()
            .enumerate()
            .filter(|(_, (t, _))| has(*t))
            .map(|(i, (_, s))| (i, s))
            .collect(),
            LinearKind::AttnOut if has(LoraTarget::O) => vec![(0, "")],
            LinearKind::MlpUp if has(LoraTarget::Fc1) => vec![(0, "")],
            LinearKind::MlpDown if has(LoraTarget::Fc2) => vec![(0, "")],
            _ => Vec::new(),
        }
    }
}

/// The parts a fused projection's output is laid out in, each with its own adapter: 3 for
/// the fused QKV, 2 for a SwiGLU's gate and up, 1 otherwise.
pub(super) fn fused_parts(kind: LinearKind) -> usize {
    match kind {
        LinearKind::AttnQkv => 3,
        LinearKind::MlpGateUp => 2,
        _ => 1,
    }
}
