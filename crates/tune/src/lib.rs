//! Post-training for kiln's GPT: instruction fine-tuning, LoRA adapters, a reward model, DPO
//! and int8 quantization-aware training.
#![deny(missing_docs)]

pub mod batch;
pub mod dpo;
mod error;
pub mod int8;
pub mod logprob;
pub mod lora;
pub mod qat;
pub mod reward;
pub mod synthetic;

pub use batch::{
    encode_row, preference_batch, sft_batch, Example, ExampleLoader, PreferencePair, RowBatch,
    IGNORE_INDEX, PAD_ID,
};
pub use dpo::{dpo_loss, DpoConfig, DpoObjective, DpoStats};
pub use error::{Result, TuneError};
pub use int8::{export_int8, load_int8, quantize_weight, ExportReport, Int8Linear};
pub use logprob::{log_sigmoid, model_log_probs, sequence_log_probs};
pub use lora::{is_adapter_param, lora_gpt, Lora, LoraConfig, LoraFactory, LoraLinear, LoraTarget};
pub use qat::{fake_quantize, qat_gpt, weight_scales, Qat, QatConfig, QatFactory, QatLinear};
pub use reward::{RewardModel, RewardStats, SCORE_WEIGHT};
pub use synthetic::{answer_quality, last_word_pairs, reverse_examples, AnswerQuality};
