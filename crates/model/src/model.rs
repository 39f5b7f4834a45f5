//! [`Gpt`]: the GPT-3-style decoder, runnable whole or as a chain of [`Segment`]s.

use crate::block::{Block, Norm, RotaryTables};
use crate::config::{GptConfig, PositionKind};
use crate::error::{ModelError, Result};
use crate::init::{Init, Initializer};
use crate::linear::{DenseFactory, LayerFactory};
use crate::ops;
pub use crate::options::{GptOptions, Segment};
use crate::params::ParamSource;
use crate::tp::TensorParallelFactory;
use candle_core::{DType, Tensor, Var};
use kiln_kernels::{with_matmul_precision, MatmulPrecision};
use kiln_parallel::tp::{self as tpops, TpComm};
use std::collections::HashMap;

mod parameters;

/// The GPT-3-style decoder: token and learned position embeddings, `n_layers` pre-LayerNorm
/// blocks (LN, causal multi-head attention with a fused QKV projection, residual; LN, fc1 4x,
/// GELU, fc2, residual), a final LayerNorm and an LM head tied to the token embedding.
///
/// Parameters are candle `Var`s named as in GPT-2 (`wte`, `wpe`, `h.{i}.ln_1.weight`,
/// `h.{i}.attn.c_attn.weight`, `h.{i}.attn.c_proj.bias`, `h.{i}.mlp.c_fc.weight`, ...,
/// `ln_f.weight`), with linear weights stored `[out, in]` (PyTorch `nn.Linear`, not GPT-2's
/// `Conv1D` `[in, out]`).
///
/// Initialisation: Xavier-uniform weight matrices (the residual output projections
/// `attn.c_proj` and `mlp.c_proj` scaled by `1/sqrt(2 n_layers)` when
/// [`GptConfig::scaled_residual_init`] is set), zero biases, unit LayerNorm gains, and
/// `N(0, embedding_std)` embeddings (0.02, GPT-2's value); each parameter draws from its own
/// stream keyed by `(seed, name)` ([`crate::keyed_rng`]), so the weights do not depend on
/// construction order or on the layer factory.
///
/// Frozen parameters ([`Gpt::freeze`], PyTorch's `requires_grad_(False)`) stay in
/// [`Gpt::named_parameters`] but leave the lists a training engine takes
/// ([`Gpt::segment_param_lists`], [`Gpt::param_splits`], [`Gpt::param_kinds`]): the forward
/// reads them as constants, so no gradient is computed for them and no optimizer state exists.
///
/// Segments: [`Gpt::embed`], [`Gpt::block`] and [`Gpt::head_loss`] run the model piecewise;
/// [`Gpt::forward`] and [`Gpt::loss`] compose them. The tied `wte` is owned by
/// [`Segment::Embed`] (listed by [`Gpt::segment_parameters`]) and also read by
/// [`Segment::Head`] ([`Gpt::tied_parameters`]): an executor that runs the segments one by one
/// must add the head's `wte` gradient to the embedding's.
#[derive(Debug)]
pub struct Gpt {
    cfg: GptConfig,
    opts: GptOptions,
    wte: Var,
    /// Learned positions (none with rotary ones).
    wpe: Option<Var>,
    blocks: Vec<Block>,
    ln_f: Norm,
    /// The LM head when it is not the token embedding (`[vocab, d]`, vocab-parallel rows).
    lm_head: Option<Var>,
    /// The tensor-parallel group when the model is split (vocab-parallel `wte`, column- and
    /// row-parallel linear layers).
    tp: Option<TpComm>,
    /// Frozen parameters by name, as constants sharing the variables' storage.
    frozen: HashMap<String, Tensor>,
}

/// A parameter source that answers frozen names with the model's constants and every other
/// name from the source the call was given.
struct WithFrozen<'a> {
    inner: &'a dyn ParamSource,
    frozen: &'a HashMap<String, Tensor>,
}

impl ParamSource for WithFrozen<'_> {
    fn param(&self, name: &str) -> Result<Tensor> {
        match self.frozen.get(name) {
            Some(t) => Ok(t.clone()),
            None => self.inner.param(name),
        }
    }
}

fn check_compute_dtype(dtype: DType) -> Result<()> {
    if matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        Ok(())
    } else {
        Err(ModelError::Dtype {
            op: "Gpt",
            what: "compute dtype",
            expected: "f32, f16, bf16 or f64",
            got: dtype,
        })
    }
}

impl Gpt {
    /// Builds the model with dense layers ([`DenseFactory`]).
    pub fn new(cfg: &GptConfig, opts: &GptOptions) -> Result<Self> {
        Self::with_factory(cfg, opts, &DenseFactory)
    }

    /// Builds this rank's shard of a tensor-parallel model over the group `tp` (Megatron-LM):
    /// column-parallel QKV (split by heads) and fc1, row-parallel output projections and fc2, a
    /// vocab-parallel token embedding and tied head, replicated positions and LayerNorms. Every
    /// parameter is initialised whole from its `(seed, name)` stream and then sharded, so the
    /// model equals the `tp = 1` one at any degree.
    pub fn tensor_parallel(cfg: &GptConfig, opts: &GptOptions, tp: TpComm) -> Result<Self> {
        let factory = TensorParallelFactory::for_config(tp.clone(), cfg)
            .with_sequence_parallel(opts.sequence_parallel);
        Self::tensor_parallel_with_factory(cfg, opts, tp, &factory)
    }

    /// [`Gpt::tensor_parallel`] with the linear layers from `factory`, which must build this
    /// rank's Megatron shards over `tp` (a [`TensorParallelFactory`], or a wrapper around one
    /// such as a LoRA factory); the embedding and head are vocab-parallel over `tp`. With
    /// [`GptOptions::sequence_parallel`] (and more than one rank) every layer must take split
    /// token rows
    /// ([`LinearLayer::sequence_parallel`](crate::LinearLayer::sequence_parallel)), and
    /// without it none may; otherwise, and where `n_ctx` is not a multiple of the degree,
    /// this is a [`ModelError::SequenceParallel`] naming the layer or the sizes.
    pub fn tensor_parallel_with_factory(
        cfg: &GptConfig,
        opts: &GptOptions,
        tp: TpComm,
        factory: &dyn LayerFactory,
    ) -> Result<Self> {
        let mut model = Self::build(cfg, opts, factory, Some(&tp))?;
        model.tp = Some(tp);
        Ok(model)
    }

    /// Builds the model with linear layers from `factory`.
    pub fn with_factory(
        cfg: &GptConfig,
        opts: &GptOptions,
        factory: &dyn LayerFactory,
    ) -> Result<Self> {
        Self::build(cfg, opts, factory, None)
    }

    fn build(
        cfg: &GptConfig,
        opts: &GptOptions,
        factory: &dyn LayerFactory,
        tp: Option<&TpComm>,
    ) -> Result<Self> {
        cfg.validate()?;
        check_compute_dtype(opts.compute_dtype)?;
        let init = Initializer::new(opts.seed, &opts.device, opts.param_dtype)?;
        let d = cfg.d_model;
        let emb = Init::Normal {
            std: cfg.embedding_std,
        };
        // the token embedding, and an untied head: vocab-parallel rows under tensor
        // parallelism, each drawn whole from its stream
        let vocab_rows = |name: &str| -> Result<Var> {
            match tp {
                None => init.var(name, &[cfg.vocab_size, d], emb),
                Some(c) => {
                    let full = init.tensor(name, &[cfg.vocab_size, d], emb)?;
                    let local = tpops::shard_vocab(&full, c.world_size(), c.rank())?;
                    Ok(Var::from_tensor(&local)?)
                }
            }
        };
        let wte = vocab_rows("wte")?;
        let wpe = match cfg.positions {
            PositionKind::Learned => Some(init.var("wpe", &[cfg.n_ctx, d], emb)?),
            PositionKind::Rotary => None,
        };
        let split_rows = tp.filter(|c| opts.sequence_parallel && c.world_size() > 1);
        if let Some(c) = split_rows {
            if cfg.n_ctx % c.world_size() != 0 {
                return Err(ModelError::SequenceParallel {
                    reason: format!(
                        "n_ctx {} is not a multiple of the tensor-parallel degree {}",
                        cfg.n_ctx,
                        c.world_size()
                    ),
                });
            }
        }
        let rotary = (cfg.positions == PositionKind::Rotary)
            .then(|| std::sync::Arc::new(RotaryTables::new(cfg)));
        let blocks = (0..cfg.n_layers)
            .map(|i| Block::new(cfg, i, &init, factory, split_rows, rotary.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let mut ln_f = Norm::new(&init, "ln_f", cfg)?;
        ln_f.split_rows = split_rows.cloned();
        let lm_head = (!cfg.tied_embeddings)
            .then(|| vocab_rows("lm_head"))
            .transpose()?;
        Ok(Self {
            cfg: cfg.clone(),
            opts: opts.clone(),
            wte,
            wpe,
            blocks,
            ln_f,
            lm_head,
            tp: None,
            frozen: HashMap::new(),
        })
    }

    /// `p` with the frozen parameters answered by the model's constants.
    fn source<'a>(&'a self, p: &'a dyn ParamSource) -> WithFrozen<'a> {
        WithFrozen {
            inner: p,
            frozen: &self.frozen,
        }
    }

    /// The tensor-parallel group, when the model is split.
    pub fn tp_group(&self) -> Option<&TpComm> {
        self.tp.as_ref()
    }

    /// The group the token rows are split over, when the model runs sequence-parallel
    /// ([`GptOptions::sequence_parallel`] with more than one tensor-parallel rank).
    pub fn sequence_parallel_group(&self) -> Option<&TpComm> {
        self.tp
            .as_ref()
            .filter(|c| self.opts.sequence_parallel && c.world_size() > 1)
    }

    /// The sequence length `t` must split over the sequence-parallel group `c`.
    fn check_split(&self, op: &'static str, t: usize, c: &TpComm) -> Result<()> {
        if t % c.world_size() == 0 {
            return Ok(());
        }
        Err(ModelError::SequenceParallel {
            reason: format!(
                "{op}: sequence length {t} is not a multiple of the tensor-parallel degree {}",
                c.world_size()
            ),
        })
    }

    /// The architecture.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// The build and run options.
    pub fn options(&self) -> &GptOptions {
        &self.opts
    }

    /// The dtype the forward computes in.
    pub fn compute_dtype(&self) -> DType {
        self.opts.compute_dtype
    }

    /// The dtype of the hidden states between segments: the compute dtype, except bf16 and f16
    /// on the CPU, which keep f32 activations and multiply in the half type (see
    /// [`GptOptions::compute_dtype`]).
    pub fn activation_dtype(&self) -> DType {
        if self.cpu_half().is_some() {
            DType::F32
        } else {
            self.opts.compute_dtype
        }
    }

    /// Half-precision compute on the CPU: f32 tensors, matrix products at this precision.
    fn cpu_half(&self) -> Option<MatmulPrecision> {
        if !self.opts.device.is_cpu() {
            return None;
        }
        match self.opts.compute_dtype {
            DType::BF16 => Some(MatmulPrecision::Bf16),
            DType::F16 => Some(MatmulPrecision::F16),
            _ => None,
        }
    }

    /// Runs `f` with bf16 or f16 matrix products when computing in that type on the CPU;
    /// otherwise under the thread's own [`kiln_kernels::matmul_precision`] (which a caller
    /// may set, as PyTorch's `set_float32_matmul_precision` does for an f32 model).
    fn in_precision<R>(&self, f: impl FnOnce() -> R) -> R {
        match self.cpu_half() {
            Some(p) => with_matmul_precision(p, f),
            None => f(),
        }
    }

    /// Switches the compute dtype (f32, f16, bf16, f64); the master parameters are unchanged.
    pub fn set_compute_dtype(&mut self, dtype: DType) -> Result<()> {
        check_compute_dtype(dtype)?;
        self.opts.compute_dtype = dtype;
        Ok(())
    }

    /// The number of transformer blocks.
    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The segments in execution order: `Embed`, `Block(0)`, ..., `Head`.
    pub fn segments(&self) -> Vec<Segment> {
        let mut s = vec![Segment::Embed];
        s.extend((0..self.blocks.len()).map(Segment::Block));
        s.push(Segment::Head);
        s
    }

    fn check_tokens(
        &self,
        op: &'static str,
        what: &'static str,
        t: &Tensor,
    ) -> Result<(usize, usize)> {
        let (b, n) = match t.dims() {
            &[b, n] if b > 0 && n > 0 => (b, n),
            dims => {
                return Err(ModelError::Shape {
                    op,
                    what,
                    expected: "[batch, seq] with both > 0".into(),
                    got: format!("{dims:?}"),
                })
            }
        };
        if t.dtype() != DType::U32 {
            return Err(ModelError::Dtype {
                op,
                what,
                expected: "u32",
                got: t.dtype(),
            });
        }
        if n > self.cfg.n_ctx {
            return Err(ModelError::SequenceTooLong {
                op,
                got: n,
                max: self.cfg.n_ctx,
            });
        }
        Ok((b, n))
    }

    /// `Embed`: token ids `[b, t]` (u32, `t <= n_ctx`) to hidden states `[b, t, d]` in the
    /// compute dtype.
    pub fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        self.embed_with(tokens, &self.named_parameters())
    }

    /// [`Gpt::embed`] with `wte` and `wpe` read from `p`.
    pub fn embed_with(&self, tokens: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let p = &self.source(p);
        let (b, t) = self.check_tokens("embed", "tokens", tokens)?;
        let ids = tokens.flatten_all()?;
        let vocab = self.cfg.vocab_size;
        if let Some((index, &value)) = ids
            .to_vec1::<u32>()?
            .iter()
            .enumerate()
            .find(|(_, &v)| v as usize >= vocab)
        {
            return Err(ModelError::TokenOutOfRange {
                op: "embed",
                what: "token",
                index,
                value,
                vocab,
            });
        }
        let d = self.cfg.d_model;
        let wte = p.param("wte")?;
        if let Some(c) = self.sequence_parallel_group() {
            // this rank's token rows: the partial lookups reduce-scattered, the positions of
            // the rows taken from the whole broadcast (whose gradient is all-gathered, so
            // `wpe`'s is whole and the same on every rank)
            self.check_split("embed", t, c)?;
            let tok = tpops::vocab_parallel_embedding_sp(tokens, &wte, c)?;
            if self.wpe.is_none() {
                return Ok(tok.to_dtype(self.activation_dtype())?);
            }
            let pos = p
                .param("wpe")?
                .narrow(0, 0, t)?
                .broadcast_as((b, t, d))?
                .contiguous()?;
            let pos = tpops::scatter_to_sequence_parallel_region(&pos, c)?;
            return Ok((tok + pos)?.to_dtype(self.activation_dtype())?);
        }
        let tok = match &self.tp {
            None => wte.index_select(&ids, 0)?,
            Some(c) => tpops::vocab_parallel_embedding(&ids, &wte, c)?,
        }
        .reshape((b, t, d))?;
        if self.wpe.is_none() {
            return Ok(tok.to_dtype(self.activation_dtype())?);
        }
        let pos = p.param("wpe")?.narrow(0, 0, t)?;
        Ok(tok.broadcast_add(&pos)?.to_dtype(self.activation_dtype())?)
    }

    /// `Block(i)`: hidden states `[b, t, d]` through transformer block `i`.
    pub fn block(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        let blk = self.blocks.get(i).ok_or(ModelError::BlockOutOfRange {
            index: i,
            n_blocks: self.blocks.len(),
        })?;
        self.in_precision(|| blk.forward_with(x, &self.source(&blk.own())))
    }

    /// [`Gpt::block`] with the block's parameters read from `p`.
    pub fn block_with(&self, i: usize, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let blk = self.blocks.get(i).ok_or(ModelError::BlockOutOfRange {
            index: i,
            n_blocks: self.blocks.len(),
        })?;
        self.in_precision(|| blk.forward_with(x, &self.source(p)))
    }

    /// `Head`: hidden states `[b, t, d]` to logits `[b, t, vocab]` in the activation dtype
    /// ([`Gpt::activation_dtype`]; gathered over the tensor-parallel group when the model is
    /// split).
    pub fn head_logits(&self, x: &Tensor) -> Result<Tensor> {
        let local = self.head_logits_local(x, &self.named_parameters())?;
        match &self.tp {
            None => Ok(local),
            Some(c) => Ok(tpops::gather_from_tp_region(&local, c)?),
        }
    }

    /// The final LayerNorm `ln_f` of hidden states `[b, t, d]`, with its weights read from `p`:
    /// what the LM head multiplies by `wte`, and what a scalar head (a reward model's) reads.
    /// Sequence-parallel, `x` is this rank's rows `[b, t / tp, d]` and the normalised rows of
    /// every rank are gathered into `[b, t, d]`.
    pub fn final_norm_with(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let h = self.ln_f.forward_with(x, &self.source(p))?;
        match self.sequence_parallel_group() {
            Some(c) => Ok(tpops::gather_from_sequence_parallel_region(&h, c)?),
            None => Ok(h),
        }
    }

    /// This rank's logits `[b, t, vocab / tp]` (all of them without tensor parallelism), with
    /// `ln_f` and `wte` read from `p`.
    pub fn head_logits_local(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let t = t * self.sequence_parallel_group().map_or(1, |c| c.world_size());
        let logits = self.head_rows_local(x, p)?;
        let v = logits.dim(1)?;
        Ok(logits.reshape((b, t, v))?)
    }

    /// [`Gpt::head_logits_local`] as rows `[b * t, vocab / tp]`, the shape the cross-entropy
    /// takes: the loss path reshapes nothing, since every reshape is a graph node whose
    /// backward fills and adds a logits-sized gradient.
    fn head_rows_local(&self, x: &Tensor, p: &dyn ParamSource) -> Result<Tensor> {
        let (h, w) = self.head_operands(x, p)?;
        if let Some(c) = self.sequence_parallel_group() {
            // every rank's rows, whose gradient the gather sums over the group (no `f`)
            let h = tpops::gather_from_sequence_parallel_region(&h, c)?;
            return Ok(self.in_precision(|| tpops::linear(&h, &w, None))?);
        }
        Ok(self.in_precision(|| match &self.tp {
            None => kiln_parallel::tp::linear(&h, &w, None),
            Some(c) => tpops::vocab_parallel_logits(&h, &w, c),
        })?)
    }

    /// What the LM head multiplies: `ln_f(x)` as rows `[b * t, d]`, and `wte` or the untied
    /// `lm_head` (this rank's rows) in their dtype.
    fn head_operands(&self, x: &Tensor, p: &dyn ParamSource) -> Result<(Tensor, Tensor)> {
        let p = &self.source(p);
        // as rows straight from the norm: a reshape would be a graph node of its own
        let h = self.ln_f.forward_rows_with(x, p)?;
        let w = p.param(self.head_name())?.to_dtype(h.dtype())?;
        Ok((h, w))
    }

    /// The name of the LM head's matrix: `wte` when tied, `lm_head` otherwise.
    pub fn head_name(&self) -> &'static str {
        match self.lm_head {
            Some(_) => "lm_head",
            None => "wte",
        }
    }

    /// `Head`: hidden states `[b, t, d]` and targets `[b, t]` (u32) to the mean cross-entropy
    /// over the targets not equal to [`GptOptions::ignore_index`]; a scalar f32 (f64 when
    /// computing in f64).
    pub fn head_loss(&self, x: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.head_loss_with(x, targets, &self.named_parameters())
    }

    /// [`Gpt::head_loss`] with `ln_f` and `wte` read from `p` (vocab-parallel cross-entropy
    /// when the model is split).
    pub fn head_loss_with(
        &self,
        x: &Tensor,
        targets: &Tensor,
        p: &dyn ParamSource,
    ) -> Result<Tensor> {
        self.head_loss_ignoring(x, targets, self.opts.ignore_index, p)
    }

    /// [`Gpt::head_loss_with`], leaving out the targets equal to `ignore`.
    fn head_loss_ignoring(
        &self,
        x: &Tensor,
        targets: &Tensor,
        ignore: Option<u32>,
        p: &dyn ParamSource,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let split = self.sequence_parallel_group();
        let t = t * split.map_or(1, |c| c.world_size());
        let (tb, tt) = self.check_tokens("head_loss", "targets", targets)?;
        if (tb, tt) != (b, t) {
            return Err(ModelError::Shape {
                op: "head_loss",
                what: "targets",
                expected: format!("[{b}, {t}]"),
                got: format!("[{tb}, {tt}]"),
            });
        }
        let targets = targets.flatten_all()?;
        if let Some(c) = split {
            // this rank's normalised rows, gathered inside the fused head and loss
            let (h, w) = self.head_operands(x, p)?;
            return Ok(self.in_precision(|| {
                tpops::sequence_parallel_linear_cross_entropy(&h, &w, &targets, ignore, c)
            })?);
        }
        match &self.tp {
            // on the CPU the head and the loss as one graph node, as below with one rank
            None if x.device().is_cpu() => {
                let (h, w) = self.head_operands(x, p)?;
                Ok(self.in_precision(|| tpops::linear_cross_entropy(&h, &w, &targets, ignore))?)
            }
            None => ops::cross_entropy(&self.head_rows_local(x, p)?, &targets, ignore),
            // the head and the loss as one graph node (bitwise the two): the logits get no
            // zero-filled gradient buffer to be added into
            Some(c) => {
                let (h, w) = self.head_operands(x, p)?;
                Ok(self.in_precision(|| {
                    tpops::vocab_parallel_linear_cross_entropy(&h, &w, &targets, ignore, c)
                })?)
            }
        }
    }

    /// Hidden states after the embedding and every block.
    fn trunk(&self, tokens: &Tensor) -> Result<Tensor> {
        let mut x = self.embed(tokens)?;
        for i in 0..self.blocks.len() {
            x = self.block(i, &x)?;
        }
        Ok(x)
    }

    /// Logits `[b, t, vocab]` for token ids `[b, t]`. Sequence-parallel, a length that does
    /// not split over the ranks is padded at the end up to the next multiple of the degree
    /// (causal attention: no position reads a later one) and the padding's logits dropped.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        if let Some(c) = self.sequence_parallel_group() {
            let (b, t) = self.check_tokens("forward", "tokens", tokens)?;
            let pad = t.next_multiple_of(c.world_size()) - t;
            if pad > 0 {
                let zeros = Tensor::zeros((b, pad), DType::U32, tokens.device())?;
                let padded = Tensor::cat(&[tokens, &zeros], 1)?;
                let logits = self.head_logits(&self.trunk(&padded)?)?;
                return Ok(logits.narrow(1, 0, t)?);
            }
        }
        self.head_logits(&self.trunk(tokens)?)
    }

    /// Mean next-token cross-entropy of `tokens` against `targets` (both `[b, t]`, u32).
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.head_loss(&self.trunk(tokens)?, targets)
    }
}

impl kiln_memory::SegmentedModel for Gpt {
    fn num_segments(&self) -> usize {
        self.blocks.len() + 2
    }

    /// The last segment's loss is over the micro-batch's targets, leaving out those equal to
    /// [`GptOptions::ignore_index`] and, with a loss mask, the masked positions.
    fn forward_segment(
        &self,
        i: usize,
        input: &Tensor,
        batch: &kiln_memory::MicroBatch,
        params: &kiln_memory::SegmentParams,
    ) -> candle_core::Result<Tensor> {
        let n = self.blocks.len();
        let out = if i == 0 {
            self.embed_with(input, params)
        } else if i <= n {
            self.block_with(i - 1, input, params)
        } else if batch.loss_mask().is_some() {
            // masked positions become ignored targets: the model's own ignore id, or one no
            // token id reaches
            let ignore = self.opts.ignore_index.unwrap_or(u32::MAX);
            let targets = batch
                .masked_targets(ignore)
                .map_err(candle_core::Error::wrap)?;
            self.head_loss_ignoring(input, &targets, Some(ignore), params)
        } else {
            self.head_loss_with(input, batch.targets(), params)
        };
        out.map_err(candle_core::Error::wrap)
    }
}
