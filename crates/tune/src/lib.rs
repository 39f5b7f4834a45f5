//! Post-training for kiln's GPT: instruction fine-tuning, LoRA adapters, a reward model, DPO
//! and int8 quantization-aware training.
#![deny(missing_docs)]

mod error;
pub mod lora;

pub use error::{Result, TuneError};
pub use lora::{is_adapter_param, lora_gpt, Lora, LoraConfig, LoraFactory, LoraLinear, LoraTarget};
