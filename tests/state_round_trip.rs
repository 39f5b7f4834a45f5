//! Every stateful component owns its state: `state()` then `load_state()` into a fresh
//! component (through the bytes of a kiln-ckpt rank file, as a checkpoint does) gives bitwise
//! the same next step as the original. Components: AdamW, the LR schedules, the dynamic loss
//! scaler (and a boxed `dyn LossScaler`), the data loader and the circuit breaker.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_ckpt::{decode_rank_file, encode_rank_file, RankState, Stateful};
use kiln_comm::Communicator;
use kiln_data::{write_shard, DataLoader, LoaderConfig, TokenDtype, TokenSource, Verify};
use kiln_monitor::{BatchInfo, BreakerPolicy, CircuitBreaker, Metric, Verdict};
use kiln_optim::{AdamW, AdamWConfig, Decay, LrSchedule, Optimizer, Warmup, WarmupDecay};
use kiln_precision::{DynamicLossScaler, DynamicScalerConfig, LossScaler};

/// `component`'s state written into a rank file and read back, then loaded into `fresh`.
fn round_trip(component: &dyn Stateful, fresh: &mut dyn Stateful) {
    let mut rs = RankState::new();
    rs.capture("part", component).unwrap();
    let bytes = encode_rank_file(&rs).unwrap();
    let mut back = decode_rank_file(&bytes).unwrap();
    fresh.load_state(back.take_part("part").unwrap()).unwrap();
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn adamw_continues_bitwise() {
    let n = 1000;
    let cfg = AdamWConfig {
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let mut a = AdamW::new(n, cfg).unwrap();
    let mut p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let grad =
        |s: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7 + s) as f32).cos() * 1e-2).collect() };
    for s in 0..5 {
        a.step(&mut p, &grad(s), 1e-3).unwrap();
    }
    let mut b = AdamW::new(n, cfg).unwrap();
    round_trip(&a, &mut b);
    let mut q = p.clone();
    for s in 5..8 {
        a.step(&mut p, &grad(s), 1e-3).unwrap();
        b.step(&mut q, &grad(s), 1e-3).unwrap();
        assert_eq!(bits(&p), bits(&q), "step {s}");
    }
    assert_eq!(a.step_count(), b.step_count());
    // a buffer of another length is refused, naming the tensor
    let e = AdamW::new(n + 1, cfg)
        .unwrap()
        .load_state(Stateful::state(&a).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("exp_avg"), "{e}");
}

#[test]
fn schedules_restore_their_definition() {
    let a = WarmupDecay::new(
        Decay::Cosine,
        6e-4,
        6e-5,
        Warmup {
            steps: 10,
            start_factor: 0.0,
        },
        100,
    )
    .unwrap();
    let mut b = WarmupDecay::new(Decay::Linear, 1.0, 0.0, Warmup::NONE, 1).unwrap();
    round_trip(&a, &mut b);
    for step in [0, 5, 10, 55, 100, 150] {
        assert_eq!(a.lr(step).to_bits(), b.lr(step).to_bits(), "step {step}");
    }
}

#[test]
fn loss_scalers_continue_bitwise() {
    let cfg = DynamicScalerConfig {
        growth_interval: 2,
        hysteresis: 2,
        ..DynamicScalerConfig::default()
    };
    let mut a = DynamicLossScaler::new(cfg).unwrap();
    for inf in [false, true, false, false, false, true, true] {
        a.update(inf).unwrap();
    }
    let mut b: Box<dyn LossScaler> = Box::new(DynamicLossScaler::default());
    round_trip(&a, &mut b);
    for inf in [false, false, true, false, false, false] {
        assert_eq!(a.update(inf).unwrap(), b.update(inf).unwrap());
        assert_eq!(a.scale().to_bits(), b.scale().to_bits());
    }
}

#[test]
fn the_data_loader_continues_with_the_same_batches() {
    let dir = std::env::temp_dir().join(format!("kiln-state-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("toks.bin");
    write_shard(&path, &(0..20_000u32).collect::<Vec<_>>(), TokenDtype::U32).unwrap();
    let open = || TokenSource::open("toks", &[&path], Verify::Full).unwrap();
    let cfg = LoaderConfig {
        seed: 7,
        ..LoaderConfig::new(16, 4)
    };
    let mut a = DataLoader::new(vec![open()], None, cfg.clone()).unwrap();
    for _ in 0..3 {
        a.next_batch().unwrap();
    }
    let mut b = DataLoader::new(vec![open()], None, cfg).unwrap();
    round_trip(&a, &mut b);
    for _ in 0..4 {
        let (x, y) = (a.next_batch().unwrap(), b.next_batch().unwrap());
        assert_eq!(
            (x.step, &x.inputs, &x.sample_ids),
            (y.step, &y.inputs, &y.sample_ids)
        );
    }
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_breaker_keeps_its_skips_and_decides_alike() {
    let policy = BreakerPolicy::default();
    let mut a = CircuitBreaker::new(policy).unwrap();
    let nan = [Verdict::NonFinite {
        metric: Metric::Loss,
        value: f64::NAN,
    }];
    let ids = [11u64, 12, 13];
    let info = BatchInfo {
        sample_ids: &ids,
        last_checkpoint_step: Some(0),
    };
    a.decide(5, &nan, &info);
    assert!(!a.breaker_state().skipped_sample_ids().is_empty());
    let mut b = CircuitBreaker::new(policy).unwrap();
    round_trip(&a, &mut b);
    assert_eq!(a.breaker_state(), b.breaker_state());
    for step in 6..9 {
        let v: &[Verdict] = if step == 7 { &nan } else { &[] };
        let (mut x, mut y) = (a.decide(step, v, &info), b.decide(step, v, &info));
        // events carry wall-clock times; everything else must agree
        for e in x.events.iter_mut().chain(y.events.iter_mut()) {
            e.time = None;
        }
        assert_eq!(format!("{x:?}"), format!("{y:?}"), "step {step}");
    }
    assert_eq!(a.breaker_state(), b.breaker_state());
}

/// The data-parallel engine (master weights, AdamW moments and step count, per parameter)
/// through a real checkpoint: saved by 2 ranks, loaded into fresh engines with the slices its
/// `state_wants` asks for, then 2 more steps equal the uninterrupted run bitwise. Plain data
/// parallelism (each rank saves only its part of the replicated values) and ZeRO-3.
#[test]
fn the_data_parallel_engine_continues_bitwise_through_a_checkpoint() {
    use candle_core::{Device, Tensor};
    use kiln_ckpt::{CheckpointConfig, Checkpointer, Layout, LocalFs, ReshardRequest};
    use kiln_model::{Gpt, GptConfig, GptOptions};
    use kiln_parallel::{DataParallel, DataParallelConfig, ZeroStage};
    use kiln_precision::NoScaler;
    use std::sync::Arc;

    let batch = |step: usize, rank: usize| {
        let tok = |i: usize| (((step * 7919 + rank * 131 + i) * 2654435761usize) >> 9) % 512;
        let x: Vec<u32> = (0..2 * 16).map(|i| tok(i) as u32).collect();
        let y: Vec<u32> = (0..2 * 16).map(|i| tok(i + 1) as u32).collect();
        kiln_memory::MicroBatch::new(
            Tensor::from_vec(x, (2, 16), &Device::Cpu).unwrap(),
            Tensor::from_vec(y, (2, 16), &Device::Cpu).unwrap(),
        )
        .unwrap()
    };
    for (stage, zero) in [(ZeroStage::Replicated, 0u8), (ZeroStage::Zero3, 3)] {
        let dir =
            std::env::temp_dir().join(format!("kiln-engine-rt-{}-{zero}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let outs = kiln_testkit::run_ranks(2, |comm| {
            let cfg = DataParallelConfig {
                stage,
                ..DataParallelConfig::default()
            };
            let engine = |seed| -> anyhow::Result<(Gpt, DataParallel)> {
                let m = Gpt::new(&GptConfig::tiny(), &GptOptions::seeded(seed))?;
                let e = DataParallel::new(&m.segment_param_lists(), &comm, cfg)?
                    .with_param_splits(&m.param_splits())?;
                Ok((m, e))
            };
            let mut scaler = NoScaler;
            let (ma, mut a) = engine(1)?;
            for s in 0..2 {
                a.step(&ma, &[batch(s, comm.rank())], 1e-3, &mut scaler)?;
            }
            let layout = Layout::new(2, 1, stage)?;
            let mut ck = Checkpointer::new(
                Arc::new(LocalFs::new(&dir)?),
                CheckpointConfig::new(layout, "tiny"),
            )?;
            let mut st = RankState::new();
            st.capture("engine", &a)?;
            ck.save(&comm, 2, &st)?;
            // a fresh engine over a model with other initial values
            let (mb, mut b) = engine(99)?;
            let req = ReshardRequest::new(layout).component("engine", &b);
            let mut loaded = ck.load_resharded(&comm, 2, &req)?.state;
            b.load_state(loaded.take_part("engine")?)?;
            for s in 2..4 {
                a.step(&ma, &[batch(s, comm.rank())], 1e-3, &mut scaler)?;
                b.step(&mb, &[batch(s, comm.rank())], 1e-3, &mut scaler)?;
            }
            Ok((a.full_params()?, b.full_params()?, a.steps(), b.steps()))
        });
        for (a, b, sa, sb) in outs {
            assert_eq!(a.len(), b.len());
            for ((na, va), (nb, vb)) in a.iter().zip(&b) {
                assert_eq!(na, nb);
                assert_eq!(bits(va), bits(vb), "{stage:?}: parameter {na}");
            }
            assert_eq!((sa, sb), (4, 4), "{stage:?}: one optimizer step counter");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
