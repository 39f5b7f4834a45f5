//! [`GptOptions`], how a [`crate::Gpt`] is built and run, and the [`Segment`]s it runs as.

use candle_core::{DType, Device};

/// How a [`Gpt`](crate::Gpt) is built and run, apart from its architecture.
#[derive(Debug, Clone)]
pub struct GptOptions {
    /// Seed of the initialisation: same seed, bitwise same parameters.
    pub seed: u64,
    /// Device of the parameters.
    pub device: Device,
    /// dtype of the master parameters: f32 (training) or f64 (gradient checks).
    pub param_dtype: DType,
    /// dtype of the forward and backward compute: the parameters are cast to it
    /// (differentiably) as they are used; f32, f16, bf16 or f64. The loss is f32 (f64 for f64).
    ///
    /// bf16 on the CPU computes as PyTorch's CPU autocast does where it pays: every matrix
    /// product of the linear layers and the LM head takes bf16 operands with f32 accumulation
    /// ([`kiln_kernels::MatmulPrecision::Bf16`], the `avx512_bf16` dot product), while
    /// the activations between them, their gradients and the normalisation, attention
    /// softmax, GELU and loss stay f32 (candle's element-wise bf16 CPU kernels are slower than
    /// its f32 ones). f16 on the CPU computes the same way with f16 operands
    /// ([`kiln_kernels::MatmulPrecision::F16`]): what an f16 matrix unit with f32
    /// accumulation computes, a scaled gradient beyond f16's range still overflowing in the
    /// product for the loss scaler to see. On CUDA every tensor of the forward is bf16 or f16.
    pub compute_dtype: DType,
    /// Targets equal to this id are left out of the loss (padding).
    pub ignore_index: Option<u32>,
    /// Megatron-LM's sequence parallelism for a tensor-parallel model
    /// ([`Gpt::tensor_parallel`](crate::Gpt::tensor_parallel) over more than one rank; no effect
    /// otherwise): the LayerNorms, residual adds and row-parallel biases, which every
    /// tensor-parallel rank otherwise computes whole, run on this rank's `1 / tp` of the token rows
    /// (see [`kiln_parallel::tp::sequence_parallel_rows`]), and the hidden states between segments
    /// are those rows, shaped `[b, t / tp, d]`. The column-parallel layers all-gather the rows
    /// before their products and the row-parallel ones reduce-scatter after theirs, in place of the
    /// all-reduces; the replicated parameters' gradients are summed over the group. The loss and
    /// gradients equal the unsplit model's up to the order of the sums over rows. The sequence
    /// length of a loss must be a multiple of the degree ([`Gpt::forward`](crate::Gpt::forward)
    /// pads the tokens it is given at the end), and so must `n_ctx`.
    pub sequence_parallel: bool,
}

impl Default for GptOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            device: Device::Cpu,
            param_dtype: DType::F32,
            compute_dtype: DType::F32,
            ignore_index: None,
            sequence_parallel: false,
        }
    }
}

impl GptOptions {
    /// f32 on the CPU with this seed.
    pub fn seeded(seed: u64) -> Self {
        Self {
            seed,
            ..Self::default()
        }
    }

    /// The same options computing in `dtype`.
    pub fn with_compute_dtype(mut self, dtype: DType) -> Self {
        self.compute_dtype = dtype;
        self
    }

    /// The same options with master parameters in `dtype`.
    pub fn with_param_dtype(mut self, dtype: DType) -> Self {
        self.param_dtype = dtype;
        self
    }

    /// The same options with the parameters on `device`.
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// The same options with sequence parallelism on or off (see
    /// [`GptOptions::sequence_parallel`]).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }
}

/// One piece of the model an executor can run on its own: `Embed`, then each `Block`, then
/// `Head`. The output of one is the input of the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Segment {
    /// Token ids `[b, t]` to hidden states `[b, t, d]`: token plus position embedding.
    Embed,
    /// Transformer block `i`: `[b, t, d] -> [b, t, d]`.
    Block(usize),
    /// Final LayerNorm and the tied LM head: hidden states to logits or loss.
    Head,
}
