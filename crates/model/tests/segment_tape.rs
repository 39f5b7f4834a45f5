//! A block segment's backward from its tape (kiln's ops, no zero-filled buffer and addition per
//! graph input) against candle's backward of the same graph: the tape covers every block, and
//! the executor's gradients are bitwise those of the whole model's `backward()`, with and
//! without activation recomputation, at f32 and at bf16 matmul precision.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var};
use kiln_memory::{
    tape, CollectGrads, Executor, MicroBatch, RecomputePolicy, SegmentParams, SegmentedModel,
    StaticParams,
};
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_testkit::{assert_bitwise_eq, assert_close};

fn config() -> GptConfig {
    GptConfig::new(64, 16, 32, 3, 4)
}

fn batch(b: usize, t: usize, vocab: usize) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..b * (t + 1))
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 7) % vocab as u32)
        .collect();
    let rows: Vec<Vec<u32>> = ids.chunks(t + 1).map(|c| c.to_vec()).collect();
    let x: Vec<u32> = rows.iter().flat_map(|r| r[..t].to_vec()).collect();
    let y: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    let dev = Device::Cpu;
    (
        Tensor::from_vec(x, (b, t), &dev).unwrap(),
        Tensor::from_vec(y, (b, t), &dev).unwrap(),
    )
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn model(dtype: DType) -> Gpt {
    Gpt::new(&config(), &GptOptions::seeded(7).with_compute_dtype(dtype)).unwrap()
}

/// The model's parameters, segment by segment.
fn segment_params(m: &Gpt) -> Vec<SegmentParams> {
    m.segment_param_lists()
        .into_iter()
        .map(SegmentParams::new)
        .collect()
}

/// The model's segment parameters, the first block's input (a fresh leaf) and the targets of
/// a fixed batch.
fn first_block_input(m: &Gpt) -> (Vec<SegmentParams>, Var, MicroBatch) {
    let (x, y) = batch(2, 16, 64);
    let params = segment_params(m);
    let mb = MicroBatch::new(x.clone(), y).unwrap();
    let h = m.forward_segment(0, &x, &mb, &params[0]).unwrap().detach();
    (params, Var::from_tensor(&h).unwrap(), mb)
}

/// The tape of a block covers it, and its backward gives candle's gradients bit for bit: the
/// block input's and every parameter's.
#[test]
fn a_block_tape_gives_candles_gradients() {
    for dtype in [DType::F32, DType::BF16] {
        let m = model(dtype);
        let (params, input, mb) = first_block_input(&m);
        let (out, tape) = tape::record(|| m.forward_segment(1, input.as_tensor(), &mb, &params[1]));
        let out = out.unwrap();
        assert!(tape.covers(&out), "{dtype:?}: the block's tape covers it");
        assert!(tape.len() >= 8, "{dtype:?}: {} ops recorded", tape.len());
        let g = Tensor::randn(0f32, 1.0, out.shape(), &Device::Cpu).unwrap();
        let want = (&out * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let got = tape.backward(&out, g).unwrap().expect("covered");
        let dx = got.get(input.as_tensor()).expect("input gradient");
        assert_bitwise_eq(&flat(dx), &flat(want.get(input.as_tensor()).unwrap()));
        for (name, v) in params[1].vars() {
            let w = want.get(v.as_tensor()).expect(name);
            let t = got
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient"));
            assert_eq!(t.dims(), w.dims(), "{name}");
            assert_bitwise_eq(&flat(t), &flat(w));
        }
    }
}

/// The head's tape (final LayerNorm and the fused LM head with the cross-entropy) covers it too,
/// so the executor runs the whole backward but the embedding's from tapes; with a loss scale
/// of 1024 every gradient is exactly 1024 times the unscaled one.
#[test]
fn the_head_is_taped_and_a_loss_scale_scales_exactly() {
    let m = model(DType::F32);
    let (x, y) = batch(2, 16, 64);
    let mb = MicroBatch::new(x.clone(), y.clone()).unwrap();
    let params = segment_params(&m);
    let last = m.num_segments() - 1;
    let h =
        Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 16, 32), &Device::Cpu).unwrap()).unwrap();
    let (loss, tape) = tape::record(|| m.forward_segment(last, h.as_tensor(), &mb, &params[last]));
    assert!(tape.covers(&loss.unwrap()), "the head's tape covers it");
    let run = |scale: f64| {
        let lists = m.segment_param_lists();
        let mut provider = StaticParams::new(lists.into_iter().map(SegmentParams::new).collect());
        let mut hook = CollectGrads::default();
        Executor::new(RecomputePolicy::None)
            .run(&m, &mb, &mut provider, &mut hook, scale)
            .unwrap();
        hook
    };
    let (one, scaled) = (run(1.0), run(1024.0));
    for (name, _) in m.named_parameters() {
        let a = flat(one.get(&name).unwrap());
        let b = flat(scaled.get(&name).unwrap());
        let want: Vec<f32> = a.iter().map(|v| v * 1024.0).collect();
        assert_bitwise_eq(&b, &want);
    }
}

/// A segment with a candle op that tracks gradients in it is not covered: the executor then
/// runs candle's backward, and a tape's backward declines.
#[test]
fn a_tape_with_a_candle_op_in_the_way_declines() {
    let w = Var::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap();
    let (out, tape) = tape::record(|| {
        let sq = w.as_tensor().sqr().unwrap(); // candle's op, not recorded
        kiln_model::ops::residual_add(&sq, w.as_tensor()).unwrap()
    });
    assert_eq!(tape.len(), 1);
    assert!(!tape.covers(&out));
    let g = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
    assert!(tape.backward(&out, g).unwrap().is_none());
}

/// The executor, whose block segments now run their tapes, against the whole model's
/// `backward()`: the same gradients bit for bit, with no checkpointing, with every block
/// recomputed, with one in two, and with selective recomputation in every block and in one
/// in two.
#[test]
fn executor_gradients_with_tapes_equal_whole_model_backward() {
    for dtype in [DType::F32, DType::BF16] {
        let m = model(dtype);
        let (x, y) = batch(2, 16, 64);
        let mb = MicroBatch::new(x.clone(), y.clone()).unwrap();
        let loss = m.loss(&x, &y).unwrap();
        let want = loss.backward().unwrap();
        for policy in [
            RecomputePolicy::None,
            RecomputePolicy::EveryBlock,
            RecomputePolicy::EveryKth(2),
            RecomputePolicy::Selective(1),
            RecomputePolicy::Selective(2),
        ] {
            let lists = m.segment_param_lists();
            let mut provider =
                StaticParams::new(lists.into_iter().map(SegmentParams::new).collect());
            let mut hook = CollectGrads::default();
            let out = Executor::new(policy)
                .run(&m, &mb, &mut provider, &mut hook, 1.0)
                .unwrap();
            assert_eq!(
                flat(&out.loss)[0].to_bits(),
                flat(&loss)[0].to_bits(),
                "{dtype:?} {policy:?}"
            );
            for (name, v) in m.named_parameters() {
                let w = want.get(v.as_tensor()).expect(&name);
                let g = hook
                    .get(&name)
                    .unwrap_or_else(|| panic!("{name}: no gradient"));
                if name == "wte" {
                    // the tied embedding's two contributions: the whole graph adds the
                    // embedding's rows into the head's gradient one by one (candle's
                    // index_add), the executor adds the embedding segment's sum to the head's,
                    // so a token seen twice rounds differently (with or without tapes)
                    assert_close(&flat(g), &flat(w), 1e-6, 1e-6);
                } else {
                    assert_bitwise_eq(&flat(g), &flat(w));
                }
            }
        }
    }
}

/// A block's tape thinned for selective checkpointing drops the outputs of its two LayerNorms
/// and its GELU, holds the rest without candle's graph, and its backward (which computes the
/// dropped values again) gives the full tape's gradients bit for bit.
#[test]
fn a_thinned_block_tape_drops_its_cheap_outputs_and_gives_the_same_gradients() {
    for dtype in [DType::F32, DType::BF16] {
        let m = model(dtype);
        let (params, input, mb) = first_block_input(&m);
        let run = || {
            let (out, tape) =
                tape::record(|| m.forward_segment(1, input.as_tensor(), &mb, &params[1]));
            (out.unwrap(), tape)
        };
        let (out, tape) = run();
        let seed = out.ones_like().unwrap().affine(0.5, 0.25).unwrap();
        let want = tape.backward(&out, seed.clone()).unwrap().unwrap();
        let (out, tape) = run();
        let ops = tape.len();
        let thinned = tape.thin(&out).unwrap();
        assert_eq!(thinned.dropped(), 3, "{dtype:?}: ln_1, ln_2 and the GELU");
        assert!(thinned.held() > ops / 2, "{dtype:?}: {thinned:?}");
        assert_bitwise_eq(&flat(thinned.output().unwrap()), &flat(&out));
        drop(out);
        let got = thinned.backward(seed).unwrap();
        let names = params[1]
            .vars()
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()));
        for (name, t) in names.chain([("input".to_string(), input.as_tensor().clone())]) {
            let (g, w) = (got.get(&t), want.get(&t));
            let (g, w) = (g.expect(&name), w.expect(&name));
            assert_bitwise_eq(&flat(g), &flat(w));
        }
    }
}

/// The policy's names: `selective` and `selective_<k>`, read and written back.
#[test]
fn selective_policies_read_and_write_their_names() {
    for (text, want) in [
        ("selective", RecomputePolicy::Selective(1)),
        ("Selective_1", RecomputePolicy::Selective(1)),
        (" selective_4", RecomputePolicy::Selective(4)),
    ] {
        let got: RecomputePolicy = text.parse().unwrap();
        assert_eq!(got, want, "{text}");
        assert_eq!(got.to_string().parse::<RecomputePolicy>().unwrap(), got);
    }
    let e = "selective_0"
        .parse::<RecomputePolicy>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("selective_0"), "{e}");
    // blocks 0 and 2 of 4 (segments 1 and 3 of 6), never the embedding or the head
    let p = RecomputePolicy::Selective(2);
    let picked: Vec<usize> = (0..6).filter(|&i| p.selects(i, 6)).collect();
    assert_eq!(picked, vec![1, 3]);
    assert_eq!(p.selective_blocks(4), 2);
    assert_eq!(p.recomputed_blocks(4), 0);
}
