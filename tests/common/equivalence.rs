//! The parallel-equivalence suite, written once and run on any backend: each rank of a world
//! of 4 (thread ranks in `parallel_gpt.rs`, MPI processes in `mpi_equivalence.rs`) trains the
//! GPT under a strategy and checks its own shard against the reference it computes itself:
//!
//! - tensor parallel (tp = 2, 4, with and without sequence parallelism) against tp = 1:
//!   parameters after 5 AdamW steps within 1e-5 of each tensor's largest magnitude, every loss
//!   within 1e-5 of the reference loss;
//! - ZeRO stages 1, 2 and 3 at dp = 2 against plain data parallel at dp = 2: bitwise;
//! - dp = 2 x tp = 2 with ZeRO-1 and fp16 loss scaling, with and without sequence parallelism,
//!   against one rank: the loss after 30 steps within 1%;
//! - at that layout with sequence parallelism, selective and full activation recomputation
//!   against none: parameters after 3 steps and the losses bitwise;
//! - DPO of LoRA adapters (kiln-tune) at dp = 2 x tp = 2 with ZeRO-1 against one rank: the
//!   adapters after 4 steps and every loss within 1e-5, relative as above;
//! - int8 quantization-aware training at dp = 2 x tp = 2 against one rank: with fake-quantized
//!   weights the parameters after 3 steps within 1e-5, relative as above; with inputs too, the
//!   observers within 1e-4 and the losses within 1e-3, relative.
//!
//! Every pair of lists compared has its lengths checked first.
//!
//! A case needing fewer ranks than the world runs on the first ranks (a `split`); the others sit
//! it out. Every rank returns an error naming the case and what differed.

use candle_core::{DType, Device, Tensor};
use kiln_comm::{Communicator, ThreadComm, ThreadCommConfig};
use kiln_memory::{MicroBatch, RecomputePolicy as Policy};
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_parallel::{DataParallel, DataParallelConfig, ParallelDims, ZeroStage};
use kiln_precision::{DynamicLossScaler, NoScaler};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The result of one rank's run: its parameters (its tp shard, whole over dp) and the losses.
pub type RankRun = (Vec<(String, Vec<f32>)>, Vec<f32>);

/// A quantization-aware run and its observers' ranges.
pub type QatRun = (RankRun, Vec<f32>);

pub fn tokens(b: usize, t: usize, vocab: usize, salt: usize) -> (Tensor, Tensor) {
    let tok = |i: usize| ((i * 2654435761 + salt * 97) >> 5) % vocab;
    let x: Vec<u32> = (0..b * t).map(|i| tok(i) as u32).collect();
    let y: Vec<u32> = (0..b * t).map(|i| tok(i + 1) as u32).collect();
    (
        Tensor::from_vec(x, (b, t), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (b, t), &Device::Cpu).unwrap(),
    )
}

pub fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// One rank of a `dp x tp` run over `world` (exactly `dp * tp` ranks): `steps` steps on fixed
/// batches, sequence-parallel with `sp`.
#[allow(clippy::too_many_arguments)]
pub fn train_rank(
    world: Arc<dyn Communicator>,
    cfg: &GptConfig,
    dp: usize,
    tp: usize,
    dpc: DataParallelConfig,
    fp16: bool,
    sp: bool,
    steps: usize,
) -> anyhow::Result<RankRun> {
    let global_batch = 4;
    let dims = ParallelDims::new(dp, tp, dp * tp, &cfg.shape())?;
    let groups = dims.build_groups(&*world)?;
    let tp_comm: Arc<dyn Communicator> = Arc::from(groups.tp);
    let mut opts = GptOptions::seeded(3).with_sequence_parallel(sp);
    if fp16 {
        opts = opts.with_compute_dtype(DType::F16);
    }
    let model = Gpt::tensor_parallel(cfg, &opts, tp_comm.clone())?;
    let mut engine = DataParallel::new(&model.segment_param_lists(), &*groups.dp, dpc)?
        .with_world(world.clone())
        .with_param_splits(&model.param_splits())?
        .with_tensor_parallel(tp_comm);
    let mut scaler: Box<dyn kiln_precision::LossScaler> = if fp16 {
        Box::new(DynamicLossScaler::new(Default::default())?)
    } else {
        Box::new(NoScaler)
    };
    let per = global_batch / dp;
    let dp_rank = dims.dp_rank(world.rank());
    let mut losses = Vec::new();
    for s in 0..steps {
        let (x, y) = tokens(global_batch, 16, cfg.vocab_size, s % 2);
        let xb = x.narrow(0, dp_rank * per, per)?;
        let yb = y.narrow(0, dp_rank * per, per)?;
        let r = engine.step(&model, &[MicroBatch::new(xb, yb)?], 3e-3, &mut *scaler)?;
        losses.push(r.loss);
    }
    Ok((engine.full_params()?, losses))
}

/// One rank of a `dp x tp` DPO run of LoRA adapters (rank 4 on every projection, the base
/// frozen, ZeRO-1) against the frozen base as the reference, 4 pairs per step: the adapters
/// (this rank's tp shard, whole over dp) and the losses.
pub fn train_lora_dpo_rank(
    world: Arc<dyn Communicator>,
    dp: usize,
    tp: usize,
    steps: usize,
) -> anyhow::Result<RankRun> {
    use kiln_tune::{
        last_word_pairs, lora_gpt, model_log_probs, preference_batch, DpoConfig, DpoObjective,
        LoraConfig, LoraTarget, PreferencePair, IGNORE_INDEX,
    };
    let cfg = GptConfig::tiny();
    let dims = ParallelDims::new(dp, tp, dp * tp, &cfg.shape())?;
    let groups = dims.build_groups(&*world)?;
    let tp_comm: Arc<dyn Communicator> = Arc::from(groups.tp);
    let opts = GptOptions {
        ignore_index: Some(IGNORE_INDEX),
        ..GptOptions::seeded(3)
    };
    let shard = (tp > 1).then(|| tp_comm.clone());
    let lc = LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: LoraTarget::ALL.to_vec(),
    };
    let (policy, lora) = lora_gpt(&cfg, &opts, &lc, shard.clone())?;
    let mut reference = match shard {
        Some(t) => Gpt::tensor_parallel(&cfg, &opts, t)?,
        None => Gpt::new(&cfg, &opts)?,
    };
    reference.freeze(|_| true);
    let dpc = DataParallelConfig {
        stage: ZeroStage::Zero1,
        max_grad_norm: Some(1.0),
        optimizer: kiln_optim::OptimizerConfig::AdamW(kiln_optim::AdamWConfig {
            eps: 1e-3,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut engine = DataParallel::new(&policy.segment_param_lists(), &*groups.dp, dpc)?
        .with_world(world.clone())
        .with_param_splits(&policy.param_splits())?
        .with_tensor_parallel(tp_comm);
    let dpo = DpoObjective::new(&policy, DpoConfig::default())?;
    let pairs = last_word_pairs(4 * steps, 16, 4, 5)?;
    let per = 4 / dp;
    let dp_rank = dims.dp_rank(world.rank());
    let mut losses = Vec::new();
    for s in 0..steps {
        let mine: Vec<&PreferencePair> = pairs[4 * s + dp_rank * per..4 * s + (dp_rank + 1) * per]
            .iter()
            .collect();
        let b = preference_batch(&mine, 8, &Device::Cpu)?;
        let r = model_log_probs(&reference, &b.inputs, &b.targets)?;
        let mb = DpoObjective::micro_batch(&b, &r)?;
        losses.push(engine.step(&dpo, &[mb], 1e-2, &mut NoScaler)?.loss);
    }
    let params = lora
        .parameters()
        .into_iter()
        .map(|(n, v)| (n, flat(v.as_tensor())))
        .collect();
    Ok((params, losses))
}

/// One rank of a `dp x tp` quantization-aware run (fake-quantized weights, and inputs when
/// `activations`), 3 steps on the fixed batches of [`train_rank`]: the parameters (this rank's
/// tp shard, whole over dp), the losses, and the observers' ranges.
pub fn train_qat_rank(
    world: Arc<dyn Communicator>,
    dp: usize,
    tp: usize,
    activations: bool,
) -> anyhow::Result<QatRun> {
    let cfg = GptConfig::tiny();
    let dims = ParallelDims::new(dp, tp, dp * tp, &cfg.shape())?;
    let groups = dims.build_groups(&*world)?;
    let tp_comm: Arc<dyn Communicator> = Arc::from(groups.tp);
    let qc = kiln_tune::QatConfig {
        activations,
        ..Default::default()
    };
    let shard = (tp > 1).then(|| tp_comm.clone());
    let (model, qat) = kiln_tune::qat_gpt(&cfg, &GptOptions::seeded(3), &qc, shard)?;
    let dpc = DataParallelConfig {
        max_grad_norm: Some(1.0),
        optimizer: kiln_optim::OptimizerConfig::AdamW(kiln_optim::AdamWConfig {
            eps: 1e-3,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut engine = DataParallel::new(&model.segment_param_lists(), &*groups.dp, dpc)?
        .with_world(world.clone())
        .with_param_splits(&model.param_splits())?
        .with_tensor_parallel(tp_comm);
    let per = 4 / dp;
    let dp_rank = dims.dp_rank(world.rank());
    let mut losses = Vec::new();
    for s in 0..3 {
        let (x, y) = tokens(4, 16, cfg.vocab_size, s % 2);
        let xb = x.narrow(0, dp_rank * per, per)?;
        let yb = y.narrow(0, dp_rank * per, per)?;
        losses.push(
            engine
                .step(&model, &[MicroBatch::new(xb, yb)?], 3e-3, &mut NoScaler)?
                .loss,
        );
        qat.update_observers(Some(&*world))?;
    }
    let ranges = qat.ranges().into_iter().map(|(_, r)| r).collect();
    Ok(((engine.full_params()?, losses), ranges))
}

/// The single-rank run of a case, computed once per process (thread ranks share it).
fn reference(
    key: &str,
    cfg: &GptConfig,
    dpc: DataParallelConfig,
    fp16: bool,
    steps: usize,
) -> anyhow::Result<RankRun> {
    static CACHE: OnceLock<Mutex<HashMap<String, RankRun>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // hold the lock while computing: the other thread ranks wait for the one result
    let mut map = cache.lock().unwrap();
    if let Some(r) = map.get(key) {
        return Ok(r.clone());
    }
    let one = ThreadComm::group(1, ThreadCommConfig::default())?
        .pop()
        .ok_or_else(|| anyhow::anyhow!("no thread rank"))?;
    let r = train_rank(Arc::new(one), cfg, 1, 1, dpc, fp16, false, steps)?;
    map.insert(key.to_string(), r.clone());
    Ok(r)
}

/// This tp rank's shard of each dense parameter of `dense` (flat, layout order of `names`).
fn shard_of(
    cfg: &GptConfig,
    dense: &[(String, Vec<f32>)],
    tp: usize,
    tp_rank: usize,
) -> anyhow::Result<Vec<(String, Vec<f32>)>> {
    let model = Gpt::new(cfg, &GptOptions::seeded(3))?;
    let dims: HashMap<String, Vec<usize>> = model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.dims().to_vec()))
        .collect();
    let splits: HashMap<_, _> = model.param_splits().into_iter().collect();
    // key/value projections over a degree above their heads are whole on every rank
    let kv_whole = kiln_model::kv_replicated(cfg.n_heads, cfg.kv_heads(), tp)?;
    let mut out = Vec::with_capacity(dense.len());
    for (name, values) in dense {
        let t = Tensor::from_vec(values.clone(), dims[name].as_slice(), &Device::Cpu)?;
        let kv = name.contains(".attn.k_proj.") || name.contains(".attn.v_proj.");
        let split = if kv && kv_whole {
            kiln_parallel::tp::TpSplit::Replicated
        } else {
            splits[name]
        };
        out.push((name.clone(), flat(&split.shard(&t, tp, tp_rank)?)));
    }
    Ok(out)
}

/// `a` and `b` side by side, once they are known to have the same length (`what` names the
/// lists in the error).
fn zip_eq<'a, A, B>(
    what: &str,
    a: &'a [A],
    b: &'a [B],
) -> anyhow::Result<std::iter::Zip<std::slice::Iter<'a, A>, std::slice::Iter<'a, B>>> {
    anyhow::ensure!(
        a.len() == b.len(),
        "{what}: {} entries against {} expected",
        a.len(),
        b.len()
    );
    Ok(a.iter().zip(b))
}

/// The largest difference between a tensor `got` and its reference `want`, relative to the
/// reference's largest magnitude: `max |got - want| / max |want|` (an element-wise relative
/// difference means nothing for weights that pass through zero). An error when the lengths
/// differ or the reference is all zeros.
fn rel_diff(what: &str, got: &[f32], want: &[f32]) -> anyhow::Result<f32> {
    let mut diff = 0.0f32;
    for (a, b) in zip_eq(what, got, want)? {
        // a NaN on either side is as far as it gets
        let d = (a - b).abs();
        diff = if d.is_nan() {
            f32::INFINITY
        } else {
            diff.max(d)
        };
    }
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    anyhow::ensure!(scale > 0.0, "{what}: the reference is all zeros");
    Ok(diff / scale)
}

/// Each loss of `got` within `rel` of the same step's loss in `want`, relative to it.
fn losses_within(what: &str, got: &[f32], want: &[f32], rel: f32) -> anyhow::Result<()> {
    for (s, (a, b)) in zip_eq(&format!("{what}: losses"), got, want)?.enumerate() {
        anyhow::ensure!(
            (a - b).abs() <= rel * b.abs(),
            "{what}: loss of step {s}: {a} vs {b} (relative bound {rel:e})"
        );
    }
    Ok(())
}

/// Bitwise-equal parameter lists (names, lengths and every value).
fn params_bitwise(
    what: &str,
    got: &[(String, Vec<f32>)],
    want: &[(String, Vec<f32>)],
) -> anyhow::Result<()> {
    for ((n, a), (wn, b)) in zip_eq(&format!("{what}: parameters"), got, want)? {
        anyhow::ensure!(n == wn, "{what}: parameter order {n} vs {wn}");
        anyhow::ensure!(
            a.len() == b.len(),
            "{what}: {n} has {} values against {}",
            a.len(),
            b.len()
        );
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            anyhow::bail!(
                "{what}: {n} is not bitwise equal: element {i} is {:e} against {:e}",
                a[i],
                b[i]
            );
        }
    }
    Ok(())
}

/// The bound on parameters after a few steps, relative to each tensor's largest magnitude.
const PARAM_REL: f32 = 1e-5;

/// Runs `f` on the first `need` ranks of `world` (a sub-group); the others return `None`.
/// Collective over `world`.
fn on_first(
    world: &dyn Communicator,
    need: usize,
    f: impl FnOnce(Arc<dyn Communicator>) -> anyhow::Result<String>,
) -> anyhow::Result<Option<String>> {
    let inside = world.rank() < need;
    let sub: Arc<dyn Communicator> =
        Arc::from(world.split(u32::from(!inside), world.rank() as u32)?);
    if inside {
        Ok(Some(f(sub)?))
    } else {
        Ok(None)
    }
}

/// The whole suite on this rank of `world` (at least 4 ranks); returns what it checked.
pub fn suite_on(world: Arc<dyn Communicator>) -> anyhow::Result<Vec<String>> {
    anyhow::ensure!(world.world_size() >= 4, "the suite needs a world of 4");
    let mut done = tensor_parallel_training(&world, "small_cpu", &GptConfig::small_cpu())?;
    let tiny = GptConfig::tiny();
    done.extend(zero_equals_plain(&world, &tiny)?);
    done.extend(grid_and_recompute(&world, &tiny)?);
    Ok(done)
}

/// Tensor parallelism at tp = 2 and 4, with and without sequence parallelism, against tp =
/// 1 after 5 steps of `cfg` (`key` names it in the cache of single-rank runs).
pub fn tensor_parallel_training(
    world: &Arc<dyn Communicator>,
    key: &str,
    small: &GptConfig,
) -> anyhow::Result<Vec<String>> {
    let mut done = Vec::new();
    // AdamW divides by sqrt(v): a gradient that is exactly zero in exact arithmetic (the key
    // bias: softmax ignores a per-row constant) is pure rounding noise, which a tiny eps turns
    // into a full +-lr step whose sign depends on the reduction order; a larger eps keeps the
    // comparison about tensor parallelism
    let tp_cfg = DataParallelConfig {
        max_grad_norm: Some(1.0),
        optimizer: kiln_optim::OptimizerConfig::AdamW(kiln_optim::AdamWConfig {
            eps: 1e-3,
            ..Default::default()
        }),
        ..Default::default()
    };
    let (ref_params, ref_losses) = reference(&format!("tp {key}"), small, tp_cfg, false, 5)?;
    for (tp, sp) in [(2usize, false), (4, false), (2, true), (4, true)] {
        let what = if sp { " sequence-parallel" } else { "" };
        if let Some(msg) = on_first(&**world, tp, |sub| {
            let tp_rank = sub.rank();
            let (params, losses) = train_rank(sub, small, 1, tp, tp_cfg, false, sp, 5)?;
            let want = shard_of(small, &ref_params, tp, tp_rank)?;
            let case = format!("{key} tp={tp}{what} rank {tp_rank}");
            let mut worst = 0.0f32;
            for ((n, got), (wn, w)) in zip_eq(&case, &params, &want)? {
                anyhow::ensure!(n == wn, "{case}: parameter order {n} vs {wn}");
                let d = rel_diff(&format!("{case}: {n}"), got, w)?;
                anyhow::ensure!(
                    d <= PARAM_REL,
                    "{case}: {n} differs by {d:e} of its largest magnitude (bound {PARAM_REL:e})"
                );
                worst = worst.max(d);
            }
            losses_within(&case, &losses, &ref_losses, 1e-5)?;
            Ok(format!(
                "{key} tp={tp}{what} equals tp=1 after 5 steps (worst parameter {worst:.1e} of \
                 its largest magnitude)"
            ))
        })? {
            done.push(msg);
        }
    }
    Ok(done)
}

/// ZeRO-1, 2 and 3 at dp = 2 against plain data parallelism on `tiny`, bitwise.
pub fn zero_equals_plain(
    world: &Arc<dyn Communicator>,
    tiny: &GptConfig,
) -> anyhow::Result<Vec<String>> {
    let mut done = Vec::new();
    let base = DataParallelConfig {
        bucket_bytes: 64 << 10,
        ..Default::default()
    };
    if let Some(msg) = on_first(&**world, 2, |sub| {
        let (plain, lp) = train_rank(sub.clone(), tiny, 2, 1, base, false, false, 3)?;
        for stage in [ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3] {
            let (z, lz) = train_rank(
                sub.clone(),
                tiny,
                2,
                1,
                DataParallelConfig { stage, ..base },
                false,
                false,
                3,
            )?;
            anyhow::ensure!(lz == lp, "{stage:?}: losses {lz:?} vs plain {lp:?}");
            params_bitwise(
                &format!("{stage:?} against plain data parallel"),
                &z,
                &plain,
            )?;
        }
        Ok("ZeRO-1/2/3 at dp=2 equal plain data parallel bitwise".to_string())
    })? {
        done.push(msg);
    }
    Ok(done)
}

/// dp x tp with ZeRO-1 and fp16 against one rank, and recomputation against none, on `tiny`.
fn grid_and_recompute(
    world: &Arc<dyn Communicator>,
    tiny: &GptConfig,
) -> anyhow::Result<Vec<String>> {
    let mut done = Vec::new();
    // dp x tp with ZeRO-1 and fp16 against one rank
    let dpc = DataParallelConfig {
        stage: ZeroStage::Zero1,
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    let steps = 30;
    let (_, single) = reference("fp16", tiny, dpc, true, steps)?;
    anyhow::ensure!(
        single[steps - 1] < single[0] * 0.8,
        "the single-rank run did not train: {single:?}"
    );
    for sp in [false, true] {
        let what = if sp { " sequence-parallel" } else { "" };
        if let Some(msg) = on_first(&**world, 4, |sub| {
            let (_, grid) = train_rank(sub, tiny, 2, 2, dpc, true, sp, steps)?;
            anyhow::ensure!(
                grid.len() == steps && single.len() == steps,
                "dp2 x tp2{what} fp16: {} and {} losses for {steps} steps",
                grid.len(),
                single.len()
            );
            let (a, b) = (grid[steps - 1], single[steps - 1]);
            anyhow::ensure!(
                (a - b).abs() <= 0.01 * b,
                "dp2 x tp2{what} fp16: final loss {a} vs one rank {b}"
            );
            Ok(format!(
                "dp=2 x tp=2{what} ZeRO-1 fp16: final loss {a} vs one rank {b}"
            ))
        })? {
            done.push(msg);
        }
    }
    // selective and full recomputation against none at the main job's layout, bitwise: the
    // sequence-parallel all-gathers a selective block dropped run again in the backward
    if let Some(msg) = on_first(&**world, 4, |sub| {
        let with = |recompute| DataParallelConfig { recompute, ..dpc };
        let (plain, lp) = train_rank(sub.clone(), tiny, 2, 2, with(Policy::None), true, true, 3)?;
        for policy in [Policy::Selective(1), Policy::EveryBlock] {
            let (p, l) = train_rank(sub.clone(), tiny, 2, 2, with(policy), true, true, 3)?;
            anyhow::ensure!(
                l == lp,
                "{policy}: losses {l:?} vs {lp:?} without checkpointing"
            );
            params_bitwise(&format!("{policy} against no recomputation"), &p, &plain)?;
        }
        Ok(
            "dp=2 x tp=2 sequence-parallel ZeRO-1 fp16: selective and full recomputation \
            equal none bitwise"
                .to_string(),
        )
    })? {
        done.push(msg);
    }
    // DPO of LoRA adapters at dp x tp against one rank
    let lora_ref = {
        static LORA: OnceLock<Mutex<Option<RankRun>>> = OnceLock::new();
        let cell = LORA.get_or_init(Default::default);
        let mut g = cell.lock().unwrap();
        if g.is_none() {
            let one = ThreadComm::group(1, ThreadCommConfig::default())?
                .pop()
                .ok_or_else(|| anyhow::anyhow!("no thread rank"))?;
            *g = Some(train_lora_dpo_rank(Arc::new(one), 1, 1, 4)?);
        }
        g.clone().unwrap()
    };
    if let Some(msg) = on_first(&**world, 4, |sub| {
        let tp_rank = sub.rank() % 2;
        let (params, losses) = train_lora_dpo_rank(sub, 2, 2, 4)?;
        let (ref_params, ref_losses) = &lora_ref;
        let (_, dense_lora) = kiln_tune::lora_gpt(
            &GptConfig::tiny(),
            &GptOptions::seeded(3),
            &kiln_tune::LoraConfig {
                rank: 4,
                alpha: 8.0,
                dropout: 0.0,
                targets: kiln_tune::LoraTarget::ALL.to_vec(),
            },
            None,
        )?;
        let case = format!("LoRA DPO dp2 x tp2 tp rank {tp_rank}");
        let (dense_params, dense_splits) = (dense_lora.parameters(), dense_lora.param_splits());
        let mut shapes: HashMap<String, (Vec<usize>, kiln_parallel::tp::TpSplit)> = HashMap::new();
        for ((n, v), (sn, s)) in zip_eq(&case, &dense_params, &dense_splits)? {
            anyhow::ensure!(n == sn, "{case}: the dense adapters' splits: {n} vs {sn}");
            shapes.insert(n.clone(), (v.dims().to_vec(), *s));
        }
        anyhow::ensure!(
            shapes.len() == ref_params.len(),
            "{case}: {} adapters in the dense model, {} in the run",
            shapes.len(),
            ref_params.len()
        );
        let mut worst = 0.0f32;
        for ((n, got), (wn, w)) in zip_eq(&case, &params, ref_params)? {
            anyhow::ensure!(n == wn, "{case}: parameter order {n} vs {wn}");
            let (dims, split) = &shapes[n];
            let whole = Tensor::from_vec(w.clone(), dims.as_slice(), &Device::Cpu)?;
            let want = flat(&split.shard(&whole, 2, tp_rank)?);
            let d = rel_diff(&format!("{case}: {n}"), got, &want)?;
            anyhow::ensure!(
                d <= PARAM_REL,
                "{case}: {n} differs by {d:e} of its largest magnitude (bound {PARAM_REL:e})"
            );
            worst = worst.max(d);
        }
        losses_within(&case, &losses, ref_losses, 1e-5)?;
        Ok(format!(
            "DPO of LoRA adapters at dp=2 x tp=2 ZeRO-1 equals one rank after 4 steps (worst \
             adapter {worst:.1e} of its largest magnitude, losses {losses:?})"
        ))
    })? {
        done.push(msg);
    }
    // quantization-aware training at dp x tp against one rank
    let qat_ref = {
        static QAT: OnceLock<Mutex<Vec<QatRun>>> = OnceLock::new();
        let cell = QAT.get_or_init(Default::default);
        let mut g = cell.lock().unwrap();
        if g.is_empty() {
            for activations in [false, true] {
                let one = ThreadComm::group(1, ThreadCommConfig::default())?
                    .pop()
                    .ok_or_else(|| anyhow::anyhow!("no thread rank"))?;
                g.push(train_qat_rank(Arc::new(one), 1, 1, activations)?);
            }
        }
        g.clone()
    };
    if let Some(msg) = on_first(&**world, 4, |sub| {
        let tp_rank = sub.rank() % 2;
        // weights only: the arithmetic of tp = 1 up to the reduction order
        let ((params, losses), _) = train_qat_rank(sub.clone(), 2, 2, false)?;
        let ((ref_params, ref_losses), _) = &qat_ref[0];
        let want = shard_of(&GptConfig::tiny(), ref_params, 2, tp_rank)?;
        let case = format!("QAT W8A32 dp2 x tp2 tp rank {tp_rank}");
        let mut worst = 0.0f32;
        for ((n, got), (wn, w)) in zip_eq(&case, &params, &want)? {
            anyhow::ensure!(n == wn, "{case}: parameter order {n} vs {wn}");
            let d = rel_diff(&format!("{case}: {n}"), got, w)?;
            anyhow::ensure!(
                d <= PARAM_REL,
                "{case}: {n} differs by {d:e} of its largest magnitude (bound {PARAM_REL:e})"
            );
            worst = worst.max(d);
        }
        losses_within(&case, &losses, ref_losses, 1e-5)?;
        // inputs too: every rank's observers take the global batch's range, as one rank's do
        let ((_, losses8), ranges) = train_qat_rank(sub, 2, 2, true)?;
        let ((_, ref8), ref_ranges) = &qat_ref[1];
        for (i, (a, b)) in zip_eq("QAT W8A8 observers", &ranges, ref_ranges)?.enumerate() {
            anyhow::ensure!(
                (a - b).abs() <= 1e-4 * b.abs(),
                "QAT W8A8 observer {i}: {a} vs {b} (relative bound 1e-4)"
            );
        }
        losses_within("QAT W8A8", &losses8, ref8, 1e-3)?;
        Ok(format!(
            "QAT at dp=2 x tp=2: W8A32 equals one rank after 3 steps (worst parameter {worst:.1e} \
             of its largest magnitude); W8A8 observers within 1e-4 and losses within 1e-3, relative"
        ))
    })? {
        done.push(msg);
    }
    Ok(done)
}

/// The unsplit model on `x`: its logits, loss and every parameter's gradient.
pub fn dense_run(
    cfg: &GptConfig,
    opts: &GptOptions,
    x: &Tensor,
    y: &Tensor,
) -> (Gpt, Vec<f32>, f32, Vec<(String, Tensor)>) {
    let dense = Gpt::new(cfg, opts).unwrap();
    let logits = flat(&dense.forward(x).unwrap());
    let loss = dense.loss(x, y).unwrap();
    let grads = loss.backward().unwrap();
    let named = dense
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, grads.get(v.as_tensor()).unwrap().clone()))
        .collect();
    (dense, logits, loss.to_scalar::<f32>().unwrap(), named)
}

/// Each parameter's name and gradient, flat.
pub type NamedGrads = Vec<(String, Vec<f32>)>;

/// This rank's loss and the gradient of each parameter it holds.
pub fn loss_and_grads(
    model: &Gpt,
    x: &Tensor,
    y: &Tensor,
) -> kiln_model::Result<(f32, NamedGrads)> {
    let loss = model.loss(x, y)?;
    let g = loss.backward()?;
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, flat(g.get(v.as_tensor()).unwrap())))
        .collect();
    Ok((loss.to_scalar::<f32>()?, grads))
}

/// How much of `assert_close`'s bound `1e-5 + 1e-5 |b|` the worst element of `a` against `b`
/// uses (at most 1 when the assertion holds).
pub fn bound_used(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from((x - y).abs()) / (1e-5 + 1e-5 * f64::from(y.abs())))
        .fold(0.0, f64::max)
}
