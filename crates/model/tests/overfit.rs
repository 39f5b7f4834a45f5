//! Acceptance: the 2-layer `tiny` model memorises a fixed batch of 64 tokens (loss < 0.05 in at
//! most 300 AdamW steps), and greedy generation then replays the memorised sequence.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use kiln_model::{generate, keyed_rng, Gpt, GptConfig, GptOptions, Sampling};
use rand::Rng;

#[test]
fn tiny_overfits_a_64_token_batch() {
    let cfg = GptConfig::tiny();
    assert_eq!(cfg.n_layers, 2);
    let model = Gpt::new(&cfg, &GptOptions::seeded(3)).unwrap();
    let mut rng = keyed_rng(11, "overfit-data");
    let seq: Vec<u32> = (0..65)
        .map(|_| rng.gen_range(0..cfg.vocab_size as u32))
        .collect();
    let tokens = Tensor::new(&seq[..64], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let targets = Tensor::new(&seq[1..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();

    let vars = model
        .named_parameters()
        .into_iter()
        .map(|(_, v)| v)
        .collect();
    let mut opt = AdamW::new(
        vars,
        ParamsAdamW {
            lr: 3e-3,
            weight_decay: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    let mut losses = Vec::new();
    for _ in 0..300 {
        let loss = model.loss(&tokens, &targets).unwrap();
        let l = loss.to_scalar::<f32>().unwrap();
        losses.push(l);
        if l < 0.05 {
            break;
        }
        opt.backward_step(&loss).unwrap();
    }
    let last = *losses.last().unwrap();
    println!(
        "steps {} first loss {} last loss {last}",
        losses.len() - 1,
        losses[0]
    );
    assert!(
        (losses[0] - (512f32).ln()).abs() < 0.3,
        "initial loss {}",
        losses[0]
    );
    assert!(last < 0.05, "loss {last} after {} steps", losses.len() - 1);

    // the memorised continuation: every next token of the 64-token window
    let out = generate(&model, &seq[..1], 63, Sampling::Greedy, 0).unwrap();
    assert_eq!(out, seq[..64].to_vec());
}
