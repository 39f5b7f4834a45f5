//! Post-training for kiln's GPT: instruction fine-tuning, LoRA adapters, a reward model, DPO
//! and int8 quantization-aware training, each a piece that runs under kiln's data-parallel
//! engine (ZeRO, tensor parallelism, activation recomputation) and checkpoints like
//! pretraining.
//!
//! - [`batch`]: instruction [`Example`]s and [`PreferencePair`]s as padded rows with the loss
//!   masked to the responses ([`sft_batch`], [`preference_batch`]), and [`ExampleLoader`], the
//!   resumable, reshardable order data-parallel ranks read them in.
//! - [`lora`]: [`LoraFactory`] puts adapters on chosen projections through kiln-model's layer
//!   factory (dense or Megatron-sharded), [`lora_gpt`] builds a model with the base frozen, and
//!   [`Lora`] merges, unmerges, saves and loads the adapters alone.
//! - [`reward`]: [`RewardModel`], a scalar head trained with the Bradley-Terry loss.
//! - [`dpo`]: [`DpoObjective`], the DPO loss against a frozen reference as a segmented model
//!   for the engine, with [`DpoStats`] for the metrics; PPO's extension point is documented
//!   there.
//! - [`qat`] and [`int8`]: fake-quantized training (per-channel int8 weights, observed
//!   per-tensor int8 inputs, the straight-through estimator), the int8 export and an integer
//!   inference path.
//! - [`synthetic`]: small instruction and preference sets generated in code, and
//!   [`answer_quality`].
//!
//! ```
//! # fn main() -> anyhow::Result<()> {
//! use candle_core::{Device, Tensor};
//! use kiln_model::{GptConfig, GptOptions};
//! use kiln_tune::{dpo_loss, lora_gpt, DpoConfig, LoraConfig};
//!
//! // LoRA on q and v: the base is frozen, 2 blocks x 2 x (A [8, 128] + B [128, 8]) train
//! let (model, lora) = lora_gpt(&GptConfig::tiny(), &GptOptions::seeded(1), &LoraConfig::default(), None)?;
//! assert_eq!(model.num_trainable_parameters(), 8192);
//! assert!(model.is_frozen("h.0.attn.c_attn.weight") && !lora.is_merged());
//! // DPO: a policy that equals its reference scores every pair at ln 2
//! let lp = Tensor::new(&[-3.0f32, -2.0], &Device::Cpu)?;
//! let loss = dpo_loss(&lp, &lp, &lp, &lp, &DpoConfig::default())?.to_scalar::<f32>()?;
//! assert!((loss - 2f32.ln()).abs() < 1e-6);
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod batch;
pub mod dpo;
mod error;
pub mod int8;
pub mod logprob;
pub mod lora;
pub mod qat;
pub mod reward;
mod shared;
pub mod synthetic;

pub use batch::{
    encode_row, preference_batch, sft_batch, Example, ExampleLoader, PreferencePair, RowBatch,
    IGNORE_INDEX, PAD_ID,
};
pub use dpo::{dpo_loss, DpoConfig, DpoObjective, DpoStats, REFERENCE_LOG_PROBS};
pub use error::{Result, TuneError};
pub use int8::{export_int8, load_int8, quantize_weight, ExportReport, Int8Linear};
pub use logprob::{log_sigmoid, model_log_probs, sequence_log_probs};
pub use lora::{is_adapter_param, lora_gpt, Lora, LoraConfig, LoraFactory, LoraLinear, LoraTarget};
pub use qat::{fake_quantize, qat_gpt, weight_scales, Qat, QatConfig, QatFactory, QatLinear};
pub use reward::{RewardModel, RewardStats, LAST_POSITIONS, SCORE_WEIGHT};
pub use synthetic::{answer_quality, last_word_pairs, reverse_examples, AnswerQuality};
