//! The `--bare-candle` baseline: kiln-model's GPT written with candle's composite ops and
//! trained by a plain loop with `candle_nn::AdamW`.

use super::Parts;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use kiln_model::GptConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

/// A LayerNorm's gain and shift.
struct Norm {
    weight: Var,
    bias: Var,
}

/// `x W^T + b` with `W` `[out, in]`.
struct Linear {
    weight: Var,
    bias: Var,
}

/// One pre-LayerNorm block.
struct Block {
    ln_1: Norm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: Norm,
    c_fc: Linear,
    mlp_proj: Linear,
}

/// kiln-model's `Gpt` (dense, one rank) with its parameter names, in plain candle.
pub struct BareGpt {
    cfg: GptConfig,
    wte: Var,
    wpe: Var,
    blocks: Vec<Block>,
    ln_f: Norm,
    /// `[n_ctx, n_ctx]`: 0 on and below the diagonal, -inf above.
    causal_mask: Tensor,
    /// Every parameter with kiln-model's name, in kiln-model's order.
    params: Vec<(String, Var)>,
}

/// `n` draws of N(0, std) (Box-Muller).
fn normal(rng: &mut ChaCha8Rng, n: usize, std: f64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1 = 1.0 - rng.gen::<f64>();
            let u2 = rng.gen::<f64>();
            (std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

enum Fill {
    Normal,
    Zeros,
    Ones,
}

/// Creates the parameters, recording each with its name.
struct Builder {
    rng: ChaCha8Rng,
    params: Vec<(String, Var)>,
}

impl Builder {
    fn var(&mut self, name: String, shape: &[usize], fill: Fill) -> candle_core::Result<Var> {
        let dev = Device::Cpu;
        let t = match fill {
            Fill::Normal => {
                let n = shape.iter().product();
                Tensor::from_vec(normal(&mut self.rng, n, 0.02), shape, &dev)?
            }
            Fill::Zeros => Tensor::zeros(shape, DType::F32, &dev)?,
            Fill::Ones => Tensor::ones(shape, DType::F32, &dev)?,
        };
        let v = Var::from_tensor(&t)?;
        self.params.push((name, v.clone()));
        Ok(v)
    }

    fn norm(&mut self, name: &str, d: usize) -> candle_core::Result<Norm> {
        Ok(Norm {
            weight: self.var(format!("{name}.weight"), &[d], Fill::Ones)?,
            bias: self.var(format!("{name}.bias"), &[d], Fill::Zeros)?,
        })
    }

    fn linear(&mut self, name: &str, in_f: usize, out_f: usize) -> candle_core::Result<Linear> {
        Ok(Linear {
            weight: self.var(format!("{name}.weight"), &[out_f, in_f], Fill::Normal)?,
            bias: self.var(format!("{name}.bias"), &[out_f], Fill::Zeros)?,
        })
    }
}

impl BareGpt {
    /// The model for `cfg` on the CPU in f32, initialised from `seed`.
    pub fn new(cfg: &GptConfig, seed: u64) -> candle_core::Result<Self> {
        let dev = Device::Cpu;
        let mut pb = Builder {
            rng: ChaCha8Rng::seed_from_u64(seed),
            params: Vec::new(),
        };
        let (d, f) = (cfg.d_model, cfg.d_ff());
        let wte = pb.var("wte".into(), &[cfg.vocab_size, d], Fill::Normal)?;
        let wpe = pb.var("wpe".into(), &[cfg.n_ctx, d], Fill::Normal)?;
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            blocks.push(Block {
                ln_1: pb.norm(&format!("h.{i}.ln_1"), d)?,
                c_attn: pb.linear(&format!("h.{i}.attn.c_attn"), d, 3 * d)?,
                attn_proj: pb.linear(&format!("h.{i}.attn.c_proj"), d, d)?,
                ln_2: pb.norm(&format!("h.{i}.ln_2"), d)?,
                c_fc: pb.linear(&format!("h.{i}.mlp.c_fc"), d, f)?,
                mlp_proj: pb.linear(&format!("h.{i}.mlp.c_proj"), f, d)?,
            });
        }
        let ln_f = pb.norm("ln_f", d)?;
        let t = cfg.n_ctx;
        let mask: Vec<f32> = (0..t * t)
            .map(|k| {
                if k % t > k / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        Ok(Self {
            cfg: cfg.clone(),
            wte,
            wpe,
            blocks,
            ln_f,
            causal_mask: Tensor::from_vec(mask, (t, t), &dev)?,
            params: pb.params,
        })
    }

    /// Every parameter with kiln-model's name.
    pub fn named_parameters(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The number of trainable elements.
    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(|(_, v)| v.elem_count()).sum()
    }

    fn layer_norm(&self, x: &Tensor, n: &Norm) -> candle_core::Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        xc.broadcast_div(&(var + self.cfg.layer_norm_eps)?.sqrt()?)?
            .broadcast_mul(n.weight.as_tensor())?
            .broadcast_add(n.bias.as_tensor())
    }

    /// `x` `[rows, in]` to `[rows, out]`.
    fn linear(x: &Tensor, l: &Linear) -> candle_core::Result<Tensor> {
        x.matmul(&l.weight.t()?)?.broadcast_add(l.bias.as_tensor())
    }

    /// Causal multi-head self-attention of `x` `[b * t, d]`.
    fn attention(
        &self,
        x: &Tensor,
        blk: &Block,
        b: usize,
        t: usize,
    ) -> candle_core::Result<Tensor> {
        let (d, h) = (self.cfg.d_model, self.cfg.n_heads);
        let dh = d / h;
        // [b, t, 3, h, dh] -> [3, b, h, t, dh]
        let qkv = Self::linear(x, &blk.c_attn)?
            .reshape((b, t, 3, h, dh))?
            .permute((2, 0, 3, 1, 4))?
            .contiguous()?;
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let mask = self.causal_mask.narrow(0, 0, t)?.narrow(1, 0, t)?;
        let scores = (q.matmul(&k.t()?)? * (1.0 / (dh as f64).sqrt()))?.broadcast_add(&mask)?;
        let y = candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(&v)?;
        let y = y.transpose(1, 2)?.contiguous()?.reshape((b * t, d))?;
        Self::linear(&y, &blk.attn_proj)
    }

    /// Mean next-token cross-entropy of `tokens` against `targets` (both `[b, t]`, u32).
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let d = self.cfg.d_model;
        let tok = self.wte.index_select(&tokens.flatten_all()?, 0)?;
        let pos = self.wpe.narrow(0, 0, t)?;
        let mut x = tok
            .reshape((b, t, d))?
            .broadcast_add(&pos)?
            .reshape((b * t, d))?;
        for blk in &self.blocks {
            x = (&x + self.attention(&self.layer_norm(&x, &blk.ln_1)?, blk, b, t)?)?;
            let hid = Self::linear(&self.layer_norm(&x, &blk.ln_2)?, &blk.c_fc)?.gelu()?;
            x = (&x + Self::linear(&hid, &blk.mlp_proj)?)?;
        }
        let logits = self.layer_norm(&x, &self.ln_f)?.matmul(&self.wte.t()?)?;
        candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
    }
}

/// Trains `model` for `steps` steps of `batch` random sequences of `n_ctx` tokens (drawn
/// before the first step); the medians of steps 5 to `steps`.
pub fn train(model: &BareGpt, batch: usize, steps: usize, lr: f64) -> candle_core::Result<Parts> {
    let (vocab, t) = (model.cfg.vocab_size as u32, model.cfg.n_ctx);
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let batches = (0..steps)
        .map(|_| {
            let ids: Vec<u32> = (0..batch * (t + 1))
                .map(|_| rng.gen_range(0..vocab))
                .collect();
            let ids = Tensor::from_vec(ids, (batch, t + 1), &Device::Cpu)?;
            Ok((
                ids.narrow(1, 0, t)?.contiguous()?,
                ids.narrow(1, 1, t)?.contiguous()?,
            ))
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let vars: Vec<Var> = model
        .named_parameters()
        .iter()
        .map(|(_, v)| v.clone())
        .collect();
    let mut opt = AdamW::new(
        vars.clone(),
        ParamsAdamW {
            lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
    )?;
    let max_norm = 1.0f64;
    let mut rows = Vec::new();
    for (step, (tokens, targets)) in (1..=steps).zip(&batches) {
        let t0 = Instant::now();
        let loss = model.loss(tokens, targets)?;
        let t_fwd = t0.elapsed().as_secs_f64();
        let mut grads = loss.backward()?;
        let t_bwd = t0.elapsed().as_secs_f64();
        // the global norm, and clipping to max_norm as torch.nn.utils.clip_grad_norm_
        let sq = vars
            .iter()
            .filter_map(|v| grads.get(v).map(|g| g.sqr()?.sum_all()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = f64::from(Tensor::stack(&sq, 0)?.sum_all()?.to_scalar::<f32>()?).sqrt();
        if norm > max_norm {
            let coef = max_norm / (norm + 1e-6);
            for v in &vars {
                if let Some(g) = grads.get(v) {
                    let g = (g * coef)?;
                    grads.insert(v, g);
                }
            }
        }
        opt.step(&grads)?;
        let step_s = t0.elapsed().as_secs_f64();
        if step >= 5 {
            rows.push(Parts {
                step: step_s,
                data: 0.0,
                forward: t_fwd,
                backward: t_bwd - t_fwd,
                grad_sync: 0.0,
                optimizer: step_s - t_bwd,
            });
        }
    }
    Ok(Parts::medians(&rows))
}

#[cfg(test)]
mod tests {
    use super::BareGpt;
    use candle_core::{Device, Tensor};
    use kiln_model::{Gpt, GptConfig, GptOptions};

    /// The largest `|x|` of `t`.
    fn max_abs(t: &Tensor) -> f32 {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// The bare model is kiln-model's function: with kiln's parameters copied in, the same
    /// loss and the same gradient for every parameter (measured: within ~2e-6 of the
    /// largest gradient; exact GELU instead of the tanh one differs by ~5e-4).
    #[test]
    fn bare_gpt_matches_kiln_loss_and_gradients() {
        let cfg = GptConfig::tiny();
        let kiln = Gpt::new(&cfg, &GptOptions::seeded(7)).unwrap();
        let bare = BareGpt::new(&cfg, 3).unwrap();
        let kiln_params = kiln.named_parameters();
        assert_eq!(kiln_params.len(), bare.named_parameters().len());
        assert_eq!(bare.num_parameters() as u64, cfg.param_count());
        for ((kn, kv), (bn, bv)) in kiln_params.iter().zip(bare.named_parameters()) {
            assert_eq!(kn, bn);
            bv.set(kv.as_tensor()).unwrap();
        }
        let (b, t) = (3, cfg.n_ctx);
        let ids: Vec<u32> = (0..b * (t + 1)).map(|i| (i * 37 % 509) as u32).collect();
        let ids = Tensor::from_vec(ids, (b, t + 1), &Device::Cpu).unwrap();
        let tokens = ids.narrow(1, 0, t).unwrap().contiguous().unwrap();
        let targets = ids.narrow(1, 1, t).unwrap().contiguous().unwrap();
        let lk = kiln.loss(&tokens, &targets).unwrap();
        let lb = bare.loss(&tokens, &targets).unwrap();
        let (fk, fb) = (
            lk.to_scalar::<f32>().unwrap(),
            lb.to_scalar::<f32>().unwrap(),
        );
        assert!((fk - fb).abs() < 1e-5, "loss kiln {fk} bare {fb}");
        let (gk, gb) = (lk.backward().unwrap(), lb.backward().unwrap());
        for ((name, kv), (_, bv)) in kiln_params.iter().zip(bare.named_parameters()) {
            let a = gk.get(kv).unwrap();
            let g = gb.get(bv).unwrap();
            let diff = max_abs(&(a - g).unwrap());
            let scale = max_abs(a);
            assert!(
                diff <= 2e-5 * scale.max(1e-6),
                "{name}: max |kiln - bare| {diff}, max |kiln| {scale}"
            );
        }
    }
}
