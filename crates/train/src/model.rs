//! [`TrainModel`]: what the trainer needs from a model, implemented for kiln-model's [`Gpt`].

use crate::config::RunConfig;
use crate::error::Result;
use candle_core::Var;
use kiln_comm::Communicator;
use kiln_memory::SegmentedModel;
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_optim::ParamKind;
use kiln_parallel::tp::TpSplit;
use kiln_tune::{lora_gpt, Lora};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// A model the [`crate::Trainer`] can train: a [`SegmentedModel`] (run segment by segment by
/// the data-parallel engine) that lists its parameters per segment and says how each one is
/// split over the tensor-parallel group.
///
/// Only [`TrainModel::segment_param_lists`] and [`TrainModel::config_hash`] are required; a
/// model without tensor parallelism keeps the defaults.
pub trait TrainModel: SegmentedModel {
    /// Per segment (in execution order), every parameter the segment reads, by name; a name in
    /// two segments is a tied parameter. The input of [`kiln_parallel::DataParallel::new`].
    fn segment_param_lists(&self) -> Vec<Vec<(String, Var)>>;

    /// How each parameter is split over the tensor-parallel group (unnamed ones are
    /// replicated), for [`kiln_parallel::DataParallel::with_param_splits`]: replicated
    /// gradients count once in the global norm, and checkpoints store each parameter with the
    /// whole tensor's shape and each rank's slice, so they load at another tp degree. The
    /// answer must not depend on the degree, and holds at `tp = 1` too.
    fn param_splits(&self) -> Vec<(String, TpSplit)> {
        Vec::new()
    }

    /// What each parameter is (weight, bias, norm, embedding), for the optimizer's parameter
    /// groups ([`kiln_parallel::DataParallel::with_decay_groups`]; by default biases, norms
    /// and embeddings do not decay). Unnamed parameters decay; the default names none.
    fn param_kinds(&self) -> Vec<(String, ParamKind)> {
        Vec::new()
    }

    /// A hash of the architecture: checkpoints of another architecture are refused. It must
    /// not depend on the parallel layout, so that checkpoints reshard.
    fn config_hash(&self) -> String;

    /// The GPT architecture, when the model is kiln-model's GPT: checkpoints record it, so
    /// that [`crate::Pretrained`] can read them back without the run's configuration.
    fn gpt_config(&self) -> Option<GptConfig> {
        None
    }

    /// Training FLOPs per token at sequence length `seq_len`, for MFU (None: not reported).
    fn flops_per_token(&self, seq_len: usize) -> Option<f64> {
        let _ = seq_len;
        None
    }
}

/// The architecture hash of a [`GptConfig`]: the first 16 hex digits of the sha256 of its JSON.
pub fn gpt_config_hash(cfg: &GptConfig) -> String {
    let json = serde_json::to_string(cfg).unwrap_or_default();
    let digest = Sha256::digest(json.as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("gpt-{hex}")
}

impl TrainModel for Gpt {
    fn segment_param_lists(&self) -> Vec<Vec<(String, Var)>> {
        Gpt::segment_param_lists(self)
    }

    fn param_splits(&self) -> Vec<(String, TpSplit)> {
        Gpt::param_splits(self)
    }

    fn param_kinds(&self) -> Vec<(String, ParamKind)> {
        Gpt::param_kinds(self)
    }

    fn config_hash(&self) -> String {
        gpt_config_hash(self.config())
    }

    fn gpt_config(&self) -> Option<GptConfig> {
        Some(self.config().clone())
    }

    /// kiln-model's [`GptConfig::flops_per_token`] (PaLM's `6 N + 12 L H Q T`) at the trained
    /// sequence length `T = seq_len`, plus [`GptConfig::lm_head_flops_per_token`]: the tied
    /// head's matmul is executed like any other, and on small vocabulary-heavy models it is a
    /// large share of the work.
    fn flops_per_token(&self, seq_len: usize) -> Option<f64> {
        let mut c = self.config().clone();
        c.n_ctx = seq_len;
        Some(c.flops_per_token() + c.lm_head_flops_per_token())
    }
}

/// What a model factory gets to build this rank's model.
#[derive(Clone)]
pub struct ModelContext<'a> {
    /// The run configuration.
    pub config: &'a RunConfig,
    /// This rank's tensor-parallel group (one rank when `tp == 1`).
    pub tp: Arc<dyn Communicator>,
    /// The global rank.
    pub rank: usize,
}

impl std::fmt::Debug for ModelContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelContext")
            .field("rank", &self.rank)
            .field("tp", &(self.tp.rank(), self.tp.world_size()))
            .finish_non_exhaustive()
    }
}

impl ModelContext<'_> {
    /// The default model: the configured GPT preset, seeded with the run's seed, on the
    /// configured device, computing in the configured dtype, split over the tensor-parallel group when it has more than one
    /// rank; with [`crate::ModelSection::init_from`], its weights are then read from that
    /// checkpoint or Hugging Face folder.
    pub fn build_gpt(&self) -> Result<Gpt> {
        Ok(self.build_gpt_lora()?.0)
    }

    /// [`ModelContext::build_gpt`], with the handle to the LoRA adapters when
    /// [`crate::ModelSection::lora`] is set (the base weights, seeded or from `init_from`,
    /// frozen; only the adapters train): keep it to merge the adapters or save them alone.
    pub fn build_gpt_lora(&self) -> Result<(Gpt, Option<Lora>)> {
        let cfg = self.config.gpt_config()?;
        let opts = GptOptions::seeded(self.config.seed)
            .with_compute_dtype(self.config.precision.dtype())
            .with_device(self.config.device.device()?)
            .with_sequence_parallel(self.config.parallel.sequence_parallel);
        let tp = (self.tp.world_size() > 1).then(|| self.tp.clone());
        let (model, lora) = match (&self.config.model.lora, tp) {
            (Some(lc), tp) => {
                let (m, l) = lora_gpt(&cfg, &opts, lc, tp)?;
                (m, Some(l))
            }
            (None, Some(tp)) => (Gpt::tensor_parallel(&cfg, &opts, tp)?, None),
            (None, None) => (Gpt::new(&cfg, &opts)?, None),
        };
        if let Some(path) = &self.config.model.init_from {
            crate::Pretrained::load(path)?.load_into(&model)?;
        }
        Ok((model, lora))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_include_the_head_and_the_attention_at_seq_len() {
        let cfg = GptConfig::tiny();
        let m = Gpt::new(&cfg, &GptOptions::seeded(1)).unwrap();
        // 2 blocks of 12 d^2 + 13 d with d = 128, plus ln_f
        let n = (2 * (12 * 128 * 128 + 13 * 128) + 2 * 128) as f64;
        let want = 6.0 * n + 12.0 * 2.0 * 128.0 * 32.0 + 6.0 * 512.0 * 128.0;
        assert_eq!(m.flops_per_token(32), Some(want));
        // Megatron's splits, from the layer specs: QKV by heads, fc1 by rows, the output
        // projections' weights by columns with replicated biases, the vocab-parallel wte
        let splits: std::collections::HashMap<String, TpSplit> =
            TrainModel::param_splits(&m).into_iter().collect();
        assert_eq!(splits.len(), m.named_parameters().len());
        assert_eq!(splits["h.0.attn.c_attn.weight"], TpSplit::Qkv);
        assert_eq!(splits["h.0.attn.c_attn.bias"], TpSplit::Qkv);
        assert_eq!(splits["h.1.mlp.c_fc.bias"], TpSplit::Rows);
        assert_eq!(splits["h.1.mlp.c_proj.weight"], TpSplit::Cols);
        assert_eq!(splits["h.1.mlp.c_proj.bias"], TpSplit::Replicated);
        assert_eq!(splits["h.1.ln_2.weight"], TpSplit::Replicated);
        assert_eq!(splits["wpe"], TpSplit::Replicated);
        assert_eq!(splits["wte"], TpSplit::Rows);
        let h = TrainModel::config_hash(&m);
        assert_eq!(h, gpt_config_hash(&GptConfig::tiny()));
        assert_ne!(h, gpt_config_hash(&GptConfig::small_cpu()));
    }
}
