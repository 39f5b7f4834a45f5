//! The model under the executor on a [`MicroBatch`] with a loss mask: the masked positions are
//! left out of the loss exactly as targets equal to the model's `ignore_index` are (loss and
//! every gradient bitwise), the loss equals an f64 log-softmax over the unmasked positions of
//! the model's own logits, and an all-ones mask changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor};
use kiln_memory::{
    CollectGrads, Executor, MicroBatch, RecomputePolicy, SegmentParams, StaticParams,
};
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_testkit::assert_bitwise_eq;

const B: usize = 3;
const T: usize = 12;

fn tokens(vocab: usize, salt: usize) -> Vec<u32> {
    (0..B * T)
        .map(|i| ((((i + salt * 977) as u32).wrapping_mul(2_654_435_761)) >> 9) % vocab as u32)
        .collect()
}

/// 1 where the loss counts: the second half of each row, and position 1 of row 2.
fn mask() -> Vec<u8> {
    (0..B * T)
        .map(|i| {
            let (r, c) = (i / T, i % T);
            u8::from(c >= T / 2 || (r == 2 && c == 1))
        })
        .collect()
}

fn run(model: &Gpt, batch: &MicroBatch) -> (f32, Vec<(String, Vec<f32>)>) {
    let mut provider = StaticParams::new(
        model
            .segment_param_lists()
            .into_iter()
            .map(SegmentParams::new)
            .collect(),
    );
    let mut hook = CollectGrads::default();
    let out = Executor::new(RecomputePolicy::None)
        .run(model, batch, &mut provider, &mut hook, 1.0)
        .unwrap();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| {
            let g = hook.get(&n).unwrap_or_else(|| panic!("{n}: no gradient"));
            (n, g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect();
    (out.loss.to_scalar::<f32>().unwrap(), grads)
}

#[test]
fn a_loss_mask_leaves_out_exactly_the_masked_positions() {
    let cfg = GptConfig::tiny();
    let dev = Device::Cpu;
    let (x, y) = (tokens(cfg.vocab_size, 0), tokens(cfg.vocab_size, 1));
    let m = mask();
    let xt = Tensor::from_vec(x.clone(), (B, T), &dev).unwrap();
    let yt = Tensor::from_vec(y.clone(), (B, T), &dev).unwrap();
    let mt = Tensor::from_vec(m.clone(), (B, T), &dev).unwrap();

    // a model without an ignore id, trained on the masked micro-batch
    let plain = Gpt::new(&cfg, &GptOptions::seeded(3)).unwrap();
    let masked = MicroBatch::new(xt.clone(), yt.clone())
        .unwrap()
        .with_loss_mask(mt)
        .unwrap();
    let (loss, grads) = run(&plain, &masked);

    // the same weights with an ignore id, on targets that carry it where the mask is 0
    const IGNORE: u32 = 7_777_777;
    let ignoring = Gpt::new(
        &cfg,
        &GptOptions {
            ignore_index: Some(IGNORE),
            ..GptOptions::seeded(3)
        },
    )
    .unwrap();
    let y_ign: Vec<u32> = y
        .iter()
        .zip(&m)
        .map(|(&t, &k)| if k == 0 { IGNORE } else { t })
        .collect();
    let by_ignore =
        MicroBatch::new(xt.clone(), Tensor::from_vec(y_ign, (B, T), &dev).unwrap()).unwrap();
    let (loss_ign, grads_ign) = run(&ignoring, &by_ignore);
    assert_eq!(loss.to_bits(), loss_ign.to_bits(), "{loss} vs {loss_ign}");
    assert_eq!(grads.len(), grads_ign.len());
    for ((n, g), (n2, g2)) in grads.iter().zip(&grads_ign) {
        assert_eq!(n, n2);
        assert_eq!(g.len(), g2.len(), "{n}");
        assert_bitwise_eq(g, g2);
    }

    // the loss against an f64 log-softmax of the model's logits over the unmasked positions
    let logits: Vec<f32> = plain
        .forward(&xt)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let v = cfg.vocab_size;
    let (mut sum, mut n) = (0f64, 0usize);
    for i in (0..B * T).filter(|&i| m[i] != 0) {
        let row = &logits[i * v..(i + 1) * v];
        let mx = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let lse = mx + row.iter().map(|&z| (z as f64 - mx).exp()).sum::<f64>().ln();
        sum += lse - row[y[i] as usize] as f64;
        n += 1;
    }
    assert_eq!(n, B * T / 2 + 1);
    let want = sum / n as f64;
    assert!(
        (loss as f64 - want).abs() <= 1e-5 * want,
        "masked loss {loss} against the f64 reference {want}"
    );

    // an all-ones mask is no mask
    let ones = Tensor::ones((B, T), DType::U8, &dev).unwrap();
    let all = MicroBatch::new(xt.clone(), yt.clone())
        .unwrap()
        .with_loss_mask(ones)
        .unwrap();
    let (loss_all, _) = run(&plain, &all);
    let (loss_none, _) = run(&plain, &MicroBatch::new(xt, yt).unwrap());
    assert_eq!(loss_all.to_bits(), loss_none.to_bits());
    assert!((loss_all - loss).abs() > 1e-4, "the mask changed the loss");
}
