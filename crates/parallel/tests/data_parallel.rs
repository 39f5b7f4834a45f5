//! Data parallel against one rank on the whole batch, and ZeRO stages 1-3 against plain data
//! parallel, on a small segmented model (tied embedding, residual MLP blocks, LayerNorm-free
//! head) whose every segment takes its weights from the parameter provider.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var, D};
use kiln_comm::{Communicator, ThreadComm};

use kiln_memory::{MicroBatch, RecomputePolicy, SegmentParams, SegmentedModel};
use kiln_optim::{AdamW, AdamWConfig, Optimizer};
use kiln_parallel::{DataParallel, DataParallelConfig, ZeroStage};
use kiln_precision::{DynamicLossScaler, LossScaler, NoScaler, ScaleEvent};
use kiln_testkit::{max_rel_diff, run_ranks};

const VOCAB: usize = 16;
const D_MODEL: usize = 12;
const BLOCKS: usize = 3;
const SEQ: usize = 6;
const BATCH: usize = 8;
const STEPS: usize = 5;
const LR: f32 = 1e-2;

/// A toy language model: one-hot embedding, residual tanh-MLP blocks, tied head, cross-entropy.
struct Toy;

fn init(shape: &[usize], seed: u64) -> Var {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|i| {
            let mut x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 31;
            ((x % 2001) as f32 / 1000.0 - 1.0) * 0.5
        })
        .collect();
    Var::from_tensor(&Tensor::from_vec(data, shape, &Device::Cpu).unwrap()).unwrap()
}

/// Fresh parameters (same values on every call), per segment.
fn params() -> Vec<Vec<(String, Var)>> {
    let wte = init(&[VOCAB, D_MODEL], 1);
    let mut segs = vec![vec![
        ("wte".to_string(), wte.clone()),
        ("wpe".to_string(), init(&[SEQ, D_MODEL], 2)),
    ]];
    for b in 0..BLOCKS {
        segs.push(vec![
            (
                format!("h{b}.w1"),
                init(&[D_MODEL, 2 * D_MODEL], 10 + b as u64),
            ),
            (format!("h{b}.b1"), init(&[2 * D_MODEL], 20 + b as u64)),
            (
                format!("h{b}.w2"),
                init(&[2 * D_MODEL, D_MODEL], 30 + b as u64),
            ),
        ]);
    }
    segs.push(vec![("wte".to_string(), wte)]);
    segs
}

impl SegmentedModel for Toy {
    fn num_segments(&self) -> usize {
        BLOCKS + 2
    }

    fn forward_segment(
        &self,
        i: usize,
        x: &Tensor,
        batch: &MicroBatch,
        p: &SegmentParams,
    ) -> candle_core::Result<Tensor> {
        if i == 0 {
            let (b, t) = x.dims2()?;
            let onehot = x
                .flatten_all()?
                .unsqueeze(1)?
                .broadcast_eq(&Tensor::arange(0u32, VOCAB as u32, x.device())?.unsqueeze(0)?)?
                .to_dtype(DType::F32)?;
            let e = onehot.matmul(p.tensor("wte")?)?.reshape((b, t, D_MODEL))?;
            return e.broadcast_add(&p.tensor("wpe")?.narrow(0, 0, t)?);
        }
        if i == BLOCKS + 1 {
            let (b, t, d) = x.dims3()?;
            let logits = x.reshape((b * t, d))?.matmul(&p.tensor("wte")?.t()?)?;
            let max = logits.max_keepdim(D::Minus1)?.detach();
            let shifted = logits.broadcast_sub(&max)?;
            let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
            let logp = shifted.broadcast_sub(&lse)?;
            return logp
                .gather(&batch.targets().flatten_all()?.unsqueeze(1)?, 1)?
                .mean_all()?
                .neg();
        }
        let blk = i - 1;
        let (b, t, d) = x.dims3()?;
        let h = x.reshape((b * t, d))?;
        let a = h
            .matmul(p.tensor(&format!("h{blk}.w1"))?)?
            .broadcast_add(p.tensor(&format!("h{blk}.b1"))?)?
            .tanh()?;
        (h + a.matmul(p.tensor(&format!("h{blk}.w2"))?)?)?.reshape((b, t, d))
    }
}

/// Batch for `step`: rows `lo..hi` of a fixed pseudo-random global batch.
fn batch(step: usize, lo: usize, hi: usize) -> MicroBatch {
    let tok = |r: usize, c: usize, k: usize| {
        (((step * 131 + r * 17 + c * 7 + k * 3) * 2654435761usize) >> 7) % VOCAB
    };
    let x: Vec<u32> = (lo..hi)
        .flat_map(|r| (0..SEQ).map(move |c| tok(r, c, 0) as u32))
        .collect();
    let y: Vec<u32> = (lo..hi)
        .flat_map(|r| (0..SEQ).map(move |c| tok(r, c, 1) as u32))
        .collect();
    MicroBatch::new(
        Tensor::from_vec(x, (hi - lo, SEQ), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (hi - lo, SEQ), &Device::Cpu).unwrap(),
    )
    .unwrap()
}

struct RunOut {
    params: Vec<(String, Vec<f32>)>,
    losses: Vec<f32>,
    bytes: (u64, u64, u64),
}

fn train(dp: usize, cfg: DataParallelConfig, accum: usize) -> RunOut {
    train_with(dp, cfg, accum, Ok)
}

/// [`train`] with `setup` applied to each rank's engine before the first step.
fn train_with(
    dp: usize,
    cfg: DataParallelConfig,
    accum: usize,
    setup: impl Fn(DataParallel) -> kiln_parallel::Result<DataParallel> + Sync,
) -> RunOut {
    train_all(dp, cfg, accum, setup).into_iter().next().unwrap()
}

/// [`train_with`], every rank's result in rank order.
fn train_all(
    dp: usize,
    cfg: DataParallelConfig,
    accum: usize,
    setup: impl Fn(DataParallel) -> kiln_parallel::Result<DataParallel> + Sync,
) -> Vec<RunOut> {
    run_ranks(dp, |comm: ThreadComm| {
        let segs = params();
        let mut engine = setup(DataParallel::new(&segs, &comm, cfg)?)?;
        drop(segs);
        let per = BATCH / dp;
        let mut scaler = NoScaler;
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let lo = comm.rank() * per;
            let mb = per / accum;
            let micro: Vec<MicroBatch> = (0..accum)
                .map(|k| batch(s, lo + k * mb, lo + (k + 1) * mb))
                .collect();
            let r = engine.step(&Toy, &micro, LR, &mut scaler)?;
            losses.push(r.loss);
        }
        Ok(RunOut {
            params: engine.full_params()?,
            losses,
            bytes: engine.model_state_bytes(),
        })
    })
}

fn flat(p: &[(String, Vec<f32>)]) -> Vec<f32> {
    p.iter().flat_map(|(_, v)| v.iter().copied()).collect()
}

fn cfg(stage: ZeroStage) -> DataParallelConfig {
    DataParallelConfig {
        stage,
        bucket_bytes: 600, // several units per segment
        ..Default::default()
    }
}

/// The reference of the reference: a plain loop with one whole-model `backward()` and kiln's
/// AdamW on each parameter, no engine.
fn plain_single_rank() -> Vec<f32> {
    plain_single_rank_with(|_, n| Box::new(AdamW::new(n, AdamWConfig::default()).unwrap()))
}

/// [`plain_single_rank`] with the optimizer `build` gives each parameter (by name and size).
fn plain_single_rank_with(build: impl Fn(&str, usize) -> Box<dyn Optimizer>) -> Vec<f32> {
    let segs = params();
    let mut names: Vec<(String, Var)> = Vec::new();
    for s in &segs {
        for (n, v) in s {
            if !names.iter().any(|(m, _)| m == n) {
                names.push((n.clone(), v.clone()));
            }
        }
    }
    let mut opts: Vec<Box<dyn Optimizer>> = names
        .iter()
        .map(|(n, v)| build(n, v.elem_count()))
        .collect();
    for s in 0..STEPS {
        let b = batch(s, 0, BATCH);
        let mut h = b.inputs().clone();
        for (i, sp) in segs.iter().enumerate() {
            h = Toy
                .forward_segment(i, &h, &b, &SegmentParams::new(sp.clone()))
                .unwrap();
        }
        let grads = h.backward().unwrap();
        for ((_, v), o) in names.iter().zip(&mut opts) {
            let g = grads
                .get(v.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let mut p = v
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            o.step(&mut p, &g, LR).unwrap();
            v.set(&Tensor::from_vec(p, v.dims(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    // the engine's layout order: by unit, backward order; compare by name instead
    let mut by_name: Vec<(String, Vec<f32>)> = names
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            )
        })
        .collect();
    by_name.sort_by(|a, b| a.0.cmp(&b.0));
    flat(&by_name)
}

fn sorted(mut p: Vec<(String, Vec<f32>)>) -> Vec<f32> {
    p.sort_by(|a, b| a.0.cmp(&b.0));
    flat(&p)
}

#[test]
fn one_rank_engine_matches_a_plain_training_loop() {
    let engine = sorted(train(1, cfg(ZeroStage::Replicated), 1).params);
    let plain = plain_single_rank();
    let rel = max_rel_diff(&engine, &plain);
    println!("engine (1 rank) vs plain loop: max relative difference {rel:e}");
    assert!(rel < 1e-6, "{rel}");
}

#[test]
fn data_parallel_equals_one_rank_on_the_whole_batch() {
    let single = train(1, cfg(ZeroStage::Replicated), 1);
    for dp in [2, 4] {
        let multi = train(dp, cfg(ZeroStage::Replicated), 1);
        let (a, b) = (flat(&multi.params), flat(&single.params));
        let w = kiln_testkit::worst_diff(
            &a.iter().map(|&x| x as f64).collect::<Vec<_>>(),
            &b.iter().map(|&x| x as f64).collect::<Vec<_>>(),
            0.0,
            1.0,
        )
        .unwrap();
        println!("dp={dp} vs 1 rank after {STEPS} steps: max relative difference {:e} (at {} : {} vs {})", max_rel_diff(&a, &b), w.index, w.actual, w.expected);
        kiln_testkit::assert_close(&a, &b, 1e-6, 1e-5);
        assert_eq!(multi.losses.len(), single.losses.len());
        for (a, b) in multi.losses.iter().zip(&single.losses) {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "loss {a} vs {b}");
        }
    }
}

#[test]
fn zero_stages_equal_plain_data_parallel_bitwise() {
    for dp in [2, 4] {
        let plain = train(dp, cfg(ZeroStage::Replicated), 1);
        for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
            let z = train(dp, cfg(stage), 1);
            kiln_testkit::assert_bitwise_eq(&flat(&z.params), &flat(&plain.params));
            assert_eq!(z.losses, plain.losses, "{stage:?} dp={dp}");
        }
    }
}

#[test]
fn overlap_bucket_size_and_recomputation_do_not_change_the_result() {
    let base = train(2, cfg(ZeroStage::Replicated), 1);
    for c in [
        DataParallelConfig {
            overlap: false,
            ..cfg(ZeroStage::Replicated)
        },
        DataParallelConfig {
            bucket_bytes: 1 << 20,
            ..cfg(ZeroStage::Zero2)
        },
        DataParallelConfig {
            recompute: RecomputePolicy::EveryBlock,
            ..cfg(ZeroStage::Zero3)
        },
        DataParallelConfig {
            recompute: RecomputePolicy::EveryKth(2),
            ..cfg(ZeroStage::Zero1)
        },
        // the toy's segments run candle's ops, which no tape covers: selective blocks are
        // recomputed whole
        DataParallelConfig {
            recompute: RecomputePolicy::Selective(1),
            ..cfg(ZeroStage::Zero3)
        },
        DataParallelConfig {
            recompute: RecomputePolicy::Selective(2),
            ..cfg(ZeroStage::Zero1)
        },
    ] {
        let r = train(2, c, 1);
        kiln_testkit::assert_bitwise_eq(&flat(&r.params), &flat(&base.params));
    }
}

#[test]
fn gradient_accumulation_matches_the_full_batch() {
    let full = train(2, cfg(ZeroStage::Replicated), 1);
    for stage in [
        ZeroStage::Replicated,
        ZeroStage::Zero1,
        ZeroStage::Zero2,
        ZeroStage::Zero3,
    ] {
        let acc = train(2, cfg(stage), 2);
        let rel = max_rel_diff(&flat(&acc.params), &flat(&full.params));
        println!("accumulation x2 ({stage:?}) vs one micro-batch: max relative difference {rel:e}");
        assert!(rel < 1e-5, "{stage:?}: {rel}");
    }
}

#[test]
fn clipping_is_global_and_equal_across_stages() {
    let clip = |stage| DataParallelConfig {
        max_grad_norm: Some(0.05),
        ..cfg(stage)
    };
    let plain = train(2, clip(ZeroStage::Replicated), 1);
    let unclipped = train(2, cfg(ZeroStage::Replicated), 1);
    assert!(
        max_rel_diff(&flat(&plain.params), &flat(&unclipped.params)) > 1e-4,
        "clipping had no effect"
    );
    for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
        let z = train(2, clip(stage), 1);
        kiln_testkit::assert_bitwise_eq(&flat(&z.params), &flat(&plain.params));
    }
}

/// The engine's weight, gradient and optimizer bytes on every rank of dp=4 equal the ZeRO
/// paper's formulas (kiln-memory's `MemoryPlan::model_state_split`) exactly, at every stage.
#[test]
fn model_state_bytes_follow_the_zero_formulas() {
    use kiln_memory::{MemPrecision, MemoryPlan, ZeroStage};
    // every parameter once (the tied wte is listed by two segments)
    let psi: u64 = params()
        .iter()
        .flatten()
        .map(|(_, v)| v.elem_count() as u64)
        .sum::<u64>()
        - (VOCAB * D_MODEL) as u64;
    // every bucket of the toy model divides by 4, so each rank's share is exactly 1/4
    for (stage, sharding) in [
        (ZeroStage::Replicated, ZeroStage::Replicated),
        (ZeroStage::Zero1, ZeroStage::Zero1),
        (ZeroStage::Zero2, ZeroStage::Zero2),
        (ZeroStage::Zero3, ZeroStage::Zero3),
    ] {
        let want = MemoryPlan::model_state_split(psi, MemPrecision::F32, sharding, 4);
        let ranks = train_all(4, cfg(stage), 1, Ok);
        assert_eq!(ranks.len(), 4);
        for (rank, r) in ranks.iter().enumerate() {
            assert_eq!(
                r.bytes, want,
                "{stage:?} dp=4 rank {rank}: (weights, gradients, optimizer) bytes measured \
                 against the formulas"
            );
        }
        let total = want.0 + want.1 + want.2;
        assert_eq!(
            total,
            MemoryPlan::model_state_bytes_for(psi, MemPrecision::F32, sharding, 4)
        );
        println!(
            "{stage:?} dp=4: every rank holds {:?} bytes (weights, gradients, optimizer), the \
             formulas' {total} exactly",
            want
        );
    }
}

/// The toy model, but on one rank the gradient of one element of `h0.b1` becomes infinite
/// (the forward is unchanged: the poison term is exactly zero going forward).
struct Poisoned {
    poison: bool,
}

impl SegmentedModel for Poisoned {
    fn num_segments(&self) -> usize {
        Toy.num_segments()
    }

    fn forward_segment(
        &self,
        i: usize,
        x: &Tensor,
        batch: &MicroBatch,
        p: &SegmentParams,
    ) -> candle_core::Result<Tensor> {
        if i != 1 || !self.poison {
            return Toy.forward_segment(i, x, batch, p);
        }
        let b1 = p.tensor("h0.b1")?;
        let mut m = vec![0.0f32; 2 * D_MODEL];
        m[0] = 1e30;
        let mask = Tensor::from_vec(m, 2 * D_MODEL, x.device())?;
        let poisoned = (b1 + ((b1 - b1.detach())? * &mask)?.affine(1e30, 0.0)?)?;
        let mut vars: Vec<(String, Var)> = p.vars().to_vec();
        for (n, v) in vars.iter_mut() {
            if n == "h0.b1" {
                *v = Var::from_tensor(&poisoned.detach())?;
            }
        }
        // run block 0 with the poisoned bias but keep the gradient path to the real one
        let (b, t, d) = x.dims3()?;
        let h = x.reshape((b * t, d))?;
        let a = h
            .matmul(p.tensor("h0.w1")?)?
            .broadcast_add(&poisoned)?
            .tanh()?;
        (h + a.matmul(p.tensor("h0.w2")?)?)?.reshape((b, t, d))
    }
}

#[test]
fn an_overflow_on_one_rank_makes_every_rank_skip() {
    for stage in [ZeroStage::Replicated, ZeroStage::Zero2, ZeroStage::Zero3] {
        let outs = run_ranks(2, |comm| {
            let segs = params();
            let mut engine = DataParallel::new(&segs, &comm, cfg(stage))?;
            let before = engine.full_params()?;
            let mut scaler = DynamicLossScaler::new(Default::default())?;
            let mb = batch(0, comm.rank() * 4, comm.rank() * 4 + 4);
            let model = Poisoned {
                poison: comm.rank() == 1,
            };
            let r = engine.step(&model, std::slice::from_ref(&mb), LR, &mut scaler)?;
            let after = engine.full_params()?;
            let r2 = engine.step(&Toy, &[mb], LR, &mut scaler)?;
            Ok((
                r.scale_event,
                before == after,
                r2.scale_event,
                scaler.scale(),
                engine.steps(),
            ))
        });
        for (ev, unchanged, ev2, scale, steps) in outs {
            assert_eq!(ev, ScaleEvent::BackedOff, "{stage:?}");
            assert!(ev.skipped_step());
            assert!(unchanged, "a skipped step must not touch the parameters");
            assert_eq!(ev2, ScaleEvent::Stepped);
            assert_eq!(scale, 32768.0);
            assert_eq!(steps, 1);
        }
    }
}

/// Without loss scaling (nothing to unscale) the inf or NaN is found by the exact norm's pass
/// alone: an infinite gradient on one rank still makes every rank skip, with no norm,
/// parameters untouched.
#[test]
fn an_overflow_without_loss_scaling_makes_every_rank_skip() {
    for stage in [ZeroStage::Replicated, ZeroStage::Zero1, ZeroStage::Zero3] {
        let outs = run_ranks(2, |comm| {
            let mut engine = DataParallel::new(&params(), &comm, cfg(stage))?;
            let before = engine.full_params()?;
            let mut scaler = NoScaler;
            let mb = batch(0, comm.rank() * 4, comm.rank() * 4 + 4);
            let model = Poisoned {
                poison: comm.rank() == 1,
            };
            let p = engine.backward(&model, std::slice::from_ref(&mb), &mut scaler)?;
            engine.discard()?;
            let after = engine.full_params()?;
            // and a clean step afterwards has its norm
            let q = engine.backward(&Toy, &[mb], &mut scaler)?;
            engine.apply(LR)?;
            Ok((
                p.found_inf,
                p.grad_norm,
                before == after,
                q.found_inf,
                q.grad_norm,
            ))
        });
        for (found, norm, unchanged, found2, norm2) in outs {
            assert!(found, "{stage:?}: the overflow of rank 1 was not found");
            assert_eq!(norm, None, "{stage:?}");
            assert!(
                unchanged,
                "{stage:?}: a skipped step must not touch the parameters"
            );
            assert!(!found2, "{stage:?}");
            assert!(
                norm2.is_some_and(|n| n.is_finite() && n > 0.0),
                "{stage:?}: {norm2:?}"
            );
        }
    }
}

#[test]
fn mismatched_parameter_lists_are_errors() {
    let r = kiln_testkit::try_run_ranks(1, kiln_testkit::TEST_TIMEOUT, |comm| {
        let mut segs = params();
        segs[2].push(("wte".into(), init(&[D_MODEL, VOCAB], 3)));
        Ok(DataParallel::new(&segs, &comm, cfg(ZeroStage::Zero1))
            .map(|_| ())
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    assert!(
        r[0].contains("wte") && r[0].contains("[16, 12]") && r[0].contains("[12, 16]"),
        "{}",
        r[0]
    );
}

#[test]
fn engine_state_round_trips_bitwise_under_zero() {
    // under ZeRO each rank's state holds exactly its shard; plain data parallelism saves each
    // element once, so its state round-trips through a checkpoint (tests/state_round_trip.rs)
    use kiln_state::Stateful;
    for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
        let outs = run_ranks(2, |comm: ThreadComm| {
            let per = BATCH / 2;
            let lo = comm.rank() * per;
            let mut scaler = NoScaler;
            let mut a = DataParallel::new(&params(), &comm, cfg(stage))?;
            for s in 0..3 {
                a.step(&Toy, &[batch(s, lo, lo + per)], LR, &mut scaler)?;
            }
            let saved = a.state()?;
            // every parameter is stored under its own name, as a slice of the whole tensor
            assert!(saved
                .names()
                .any(|n| n == "param/h1.w2" || n == "exp_avg/wte"));
            // a fresh engine (other initial values) takes the state and continues alike
            let mut b = DataParallel::new(&params(), &comm, cfg(stage))?;
            b.step(&Toy, &[batch(9, lo, lo + per)], LR, &mut scaler)?;
            b.load_state(saved)?;
            for s in 3..5 {
                a.step(&Toy, &[batch(s, lo, lo + per)], LR, &mut scaler)?;
                b.step(&Toy, &[batch(s, lo, lo + per)], LR, &mut scaler)?;
            }
            Ok((
                flat(&a.full_params()?),
                flat(&b.full_params()?),
                a.steps(),
                b.steps(),
            ))
        });
        // plain data parallelism: a rank's own state is not enough, and says so
        let e = kiln_testkit::try_run_ranks(2, kiln_testkit::TEST_TIMEOUT, |comm| {
            let mut a = DataParallel::new(&params(), &comm, cfg(ZeroStage::Replicated))?;
            let saved = a.state()?;
            Ok(a.load_state(saved)?)
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("load through a checkpoint"), "{e}");
        for (a, b, sa, sb) in outs {
            kiln_testkit::assert_bitwise_eq(&a, &b);
            assert_eq!(sa, sb, "{stage:?}: optimizer steps");
        }
    }
}

#[test]
fn backward_then_apply_equals_step_and_discard_changes_nothing() {
    let outs = run_ranks(2, |comm: ThreadComm| {
        let per = BATCH / 2;
        let lo = comm.rank() * per;
        let mut scaler = NoScaler;
        let mut a = DataParallel::new(&params(), &comm, cfg(ZeroStage::Zero2))?;
        let mut b = DataParallel::new(&params(), &comm, cfg(ZeroStage::Zero2))?;
        for s in 0..3 {
            let mb = [batch(s, lo, lo + per)];
            let r = a.step(&Toy, &mb, LR, &mut scaler)?;
            // a user loop: look at the preview, then apply
            let p = b.backward(&Toy, &mb, &mut scaler)?;
            assert_eq!((p.loss, p.grad_norm), (r.loss, r.grad_norm));
            assert!(!p.found_inf);
            b.apply(LR)?;
        }
        let before = flat(&b.full_params()?);
        b.backward(&Toy, &[batch(7, lo, lo + per)], &mut scaler)?;
        // a second backward before apply or discard is refused, and so is a lone apply later
        let twice = b
            .backward(&Toy, &[batch(7, lo, lo + per)], &mut scaler)
            .unwrap_err()
            .to_string();
        b.discard()?;
        let lone = b.apply(LR).unwrap_err().to_string();
        Ok((
            flat(&a.full_params()?),
            flat(&b.full_params()?),
            before,
            twice,
            lone,
            b.steps(),
        ))
    });
    for (a, b, before, twice, lone, steps) in outs {
        kiln_testkit::assert_bitwise_eq(&a, &b);
        kiln_testkit::assert_bitwise_eq(&b, &before);
        assert!(twice.contains("backward called again"), "{twice}");
        assert!(lone.contains("apply called without a backward"), "{lone}");
        assert_eq!(steps, 3, "a discarded step does not count");
    }
}

/// The optimizer is pluggable (SGD with Nesterov momentum here) and parameter groups give
/// chosen parameters their own weight decay: on one rank each equals a plain loop with that
/// optimizer per parameter, and every ZeRO stage equals plain data parallelism bitwise.
#[test]
fn pluggable_optimizer_and_decay_groups_match_the_plain_loop_and_every_stage() {
    use kiln_optim::{OptimizerConfig, ParamKind, SgdConfig, WeightDecayGroups};
    use std::sync::Arc;
    let sgd = SgdConfig {
        momentum: 0.9,
        nesterov: true,
        weight_decay: 0.05,
        ..Default::default()
    };
    let adamw = AdamWConfig {
        weight_decay: 0.3,
        ..Default::default()
    };
    // the model's kinds: the embedding and the biases do not decay by default
    let kinds: Vec<(String, ParamKind)> = params()
        .concat()
        .into_iter()
        .map(|(n, _)| {
            let k = match n.as_str() {
                "wte" => ParamKind::Embedding,
                b if b.ends_with(".b1") => ParamKind::Bias,
                _ => ParamKind::Weight,
            };
            (n, k)
        })
        .collect();
    let decays = |n: &str| !(n == "wte" || n.ends_with(".b1"));
    let with_sgd = |e: DataParallel| e.with_optimizer(Arc::new(sgd));
    let with_groups = |e: DataParallel| e.with_decay_groups(&kinds, &WeightDecayGroups::default());
    let adamw_cfg = |stage| DataParallelConfig {
        optimizer: OptimizerConfig::AdamW(adamw),
        ..cfg(stage)
    };
    // one rank against the plain loop
    let got = sorted(train_with(1, cfg(ZeroStage::Replicated), 1, with_sgd).params);
    let want = plain_single_rank_with(|_, n| Box::new(kiln_optim::Sgd::new(n, sgd).unwrap()));
    let rel = max_rel_diff(&got, &want);
    println!("SGD engine (1 rank) vs plain loop: max relative difference {rel:e}");
    assert!(rel < 1e-6, "{rel}");
    let got = sorted(train_with(1, adamw_cfg(ZeroStage::Replicated), 1, with_groups).params);
    let want = plain_single_rank_with(|name, n| {
        let wd = if decays(name) { 0.3 } else { 0.0 };
        let c = AdamWConfig {
            weight_decay: wd,
            ..adamw
        };
        Box::new(AdamW::new(n, c).unwrap())
    });
    let rel = max_rel_diff(&got, &want);
    println!("AdamW with decay groups (1 rank) vs plain loop: max relative difference {rel:e}");
    assert!(rel < 1e-6, "{rel}");
    // the groups change the result: without them every parameter decays
    let all = sorted(train(1, adamw_cfg(ZeroStage::Replicated), 1).params);
    assert!(max_rel_diff(&all, &got) > 1e-4);
    // every stage equals plain data parallelism, bitwise
    for dp in [2, 3] {
        let plain_sgd = train_with(dp, cfg(ZeroStage::Replicated), 1, with_sgd);
        let plain_groups = train_with(dp, adamw_cfg(ZeroStage::Replicated), 1, with_groups);
        for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
            let z = train_with(dp, cfg(stage), 1, with_sgd);
            kiln_testkit::assert_bitwise_eq(&flat(&z.params), &flat(&plain_sgd.params));
            let z = train_with(dp, adamw_cfg(stage), 1, with_groups);
            kiln_testkit::assert_bitwise_eq(&flat(&z.params), &flat(&plain_groups.params));
        }
    }
}

/// SGD's state is `momentum_buffer/<name>` per parameter, round-trips bitwise under ZeRO, and
/// loading it into an engine running another optimizer is an error naming both.
#[test]
fn another_optimizers_state_round_trips_and_a_mismatch_is_an_error() {
    use kiln_optim::SgdConfig;
    use kiln_state::Stateful;
    use std::sync::Arc;
    let sgd = SgdConfig {
        momentum: 0.9,
        ..Default::default()
    };
    let outs = run_ranks(2, |comm: ThreadComm| {
        let (per, mut scaler) = (BATCH / 2, NoScaler);
        let lo = comm.rank() * per;
        let new = || -> kiln_parallel::Result<DataParallel> {
            DataParallel::new(&params(), &comm, cfg(ZeroStage::Zero2))?
                .with_optimizer(Arc::new(sgd))
        };
        let mut a = new()?;
        for s in 0..3 {
            a.step(&Toy, &[batch(s, lo, lo + per)], LR, &mut scaler)?;
        }
        let saved = a.state()?;
        assert!(saved.names().any(|n| n == "momentum_buffer/wte"));
        assert!(!saved.names().any(|n| n.starts_with("exp_avg")));
        // replacing the optimizer after a step is refused
        let e = new()?;
        let mut e2 = e;
        e2.step(&Toy, &[batch(0, lo, lo + per)], LR, &mut scaler)?;
        let refused = e2.with_optimizer(Arc::new(sgd)).unwrap_err().to_string();
        assert!(refused.contains("before the first step"), "{refused}");
        // AdamW's engine refuses SGD's state
        let mut adam = DataParallel::new(&params(), &comm, cfg(ZeroStage::Zero2))?;
        let err = adam.load_state(saved.clone()).unwrap_err().to_string();
        assert!(
            err.contains("\"sgd\"") && err.contains("\"adamw\""),
            "{err}"
        );
        let mut b = new()?;
        b.load_state(saved)?;
        for s in 3..5 {
            a.step(&Toy, &[batch(s, lo, lo + per)], LR, &mut scaler)?;
            b.step(&Toy, &[batch(s, lo, lo + per)], LR, &mut scaler)?;
        }
        Ok((flat(&a.full_params()?), flat(&b.full_params()?)))
    });
    for (a, b) in outs {
        kiln_testkit::assert_bitwise_eq(&a, &b);
    }
}

/// A staged copy turns into exactly the state the engine had when it was copied, after the
/// engine has stepped on: at dp=2 ZeRO-1 (nothing communicated when built) and at dp=2 x tp=2
/// (the chunks gathered over the data-parallel group split from the world communicator).
/// Building before anything was staged, or with a communicator that is not the world, is an
/// error naming the sizes.
#[test]
fn staged_state_is_the_live_state_at_the_copy() {
    use kiln_parallel::{ParallelDims, StagedState};
    use kiln_state::Stateful;
    use std::sync::Arc;
    for tp in [1usize, 2] {
        let outs = run_ranks(2 * tp, |world: ThreadComm| {
            let dims = ParallelDims { dp: 2, tp, pp: 1 };
            let groups = dims.build_groups(&world)?;
            let dp_comm: Arc<dyn Communicator> = Arc::from(groups.dp);
            let per = BATCH / 2;
            let lo = dims.dp_rank(world.rank()) * per;
            let mut scaler = NoScaler;
            let mut a = DataParallel::new(&params(), &*dp_comm, cfg(ZeroStage::Zero1))?;
            if tp > 1 {
                a = a.with_tensor_parallel(Arc::from(groups.tp));
            }
            let mut staged = StagedState::new();
            let empty = staged.state(&world).unwrap_err().to_string();
            assert!(empty.contains("nothing staged"), "{empty}");
            for s in 0..3 {
                a.step(&Toy, &[batch(s, lo, lo + per)], LR, &mut scaler)?;
            }
            let live = a.state()?;
            a.stage_state(&mut staged)?;
            a.step(&Toy, &[batch(3, lo, lo + per)], LR, &mut scaler)?;
            let built = staged.state(&world)?;
            assert_eq!(built, live, "tp {tp} rank {}", world.rank());
            assert_ne!(a.state()?, live, "the engine moved on");
            // staged again into the same buffers: the new values
            a.stage_state(&mut staged)?;
            assert_eq!(staged.state(&world)?, a.state()?);
            if tp > 1 {
                let e = staged.state(&*dp_comm).unwrap_err().to_string();
                assert!(e.contains("dp 2 x tp 2 = 4") && e.contains("of 2"), "{e}");
            }
            Ok(())
        });
        assert_eq!(outs.len(), 2 * tp);
    }
}
