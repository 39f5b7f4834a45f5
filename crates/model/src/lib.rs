//! The GPT-3-style decoder of kiln, trainable on candle with kiln's own fused ops.
//!
//! - [`GptConfig`]: the architecture, with the GPT-3 presets (`gpt3_175b()` down to
//!   `gpt3_small()`) and CPU presets (`tiny()`, `small_cpu()`), [`GptConfig::param_count`] and
//!   PaLM's [`GptConfig::flops_per_token`].
//! - [`Gpt`]: token and learned position embeddings, pre-LayerNorm blocks (causal multi-head
//!   attention with a fused QKV projection, 4x GELU MLP), final LayerNorm, tied LM head. Runs
//!   whole ([`Gpt::forward`], [`Gpt::loss`]) or as a chain of [`Segment`]s for a segmented
//!   executor; parameters are named `Var`s initialised from `(seed, name)` streams.
//! - [`LayerFactory`] / [`LinearLayer`]: the seam where tensor-parallel, LoRA or fake-quantised
//!   linear layers replace [`DenseFactory`]'s dense ones.
//! - [`ops`]: layer norm, causal softmax, fused causal attention, GELU and cross-entropy with
//!   a backward (candle's own fused softmax and layer norm have none): the inputs checked, then
//!   kiln-kernels' fused CPU and CUDA kernels;
//!   [`reference`](mod@reference) holds composite equivalents.
//! - [`generate`]: greedy and top-k sampling.
//! - [`hf`]: Hugging Face's GPT-2 layout (`model.safetensors` + `config.json`) to and from
//!   kiln's parameters; [`Gpt::load_full_parameters`] puts whole tensors into any
//!   tensor-parallel shard of the model.
//!
//! ```
//! # fn main() -> anyhow::Result<()> {
//! use candle_core::{Device, Tensor};
//! use kiln_model::{Gpt, GptConfig, GptOptions};
//!
//! let cfg = GptConfig::tiny();
//! let model = Gpt::new(&cfg, &GptOptions::seeded(42))?;
//! assert_eq!(model.num_parameters() as u64, cfg.param_count());
//! assert_eq!(cfg.param_count(), 470_528);
//! let tokens = Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu)?;
//! let targets = Tensor::new(&[[2u32, 3, 4, 5]], &Device::Cpu)?;
//! // small initial weights: the loss starts just above ln(vocab) = 6.238
//! let loss = model.loss(&tokens, &targets)?.to_scalar::<f32>()?;
//! assert!(loss > 512f32.ln() && loss < 512f32.ln() + 0.25, "{loss}");
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod block;
mod config;
mod device;
mod error;
mod generate;
pub mod hf;
mod init;
mod linear;
mod model;
pub mod ops;
mod options;
mod params;
pub mod reference;
mod tp;

pub use config::{GptConfig, MlpKind, NormKind, PositionKind, PRESET_NAMES};
pub use device::DeviceSpec;
pub use error::{ModelError, Result};
pub use generate::{generate, Sampling};
pub use init::{keyed_rng, splitmix64, Init, Initializer};
pub use linear::{
    init_linear, linear_forward, DenseFactory, DenseLinear, LayerFactory, LinearKind, LinearLayer,
    LinearSpec, ParallelStyle,
};
pub use model::{Gpt, GptOptions, Segment};
pub use params::ParamSource;
pub use tp::{kv_replicated, TensorParallelFactory, TpLinear};
