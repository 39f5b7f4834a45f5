//! The segmented executor against a plain whole-model `backward()`, with and without activation
//! checkpointing, on a small transformer-like chain (embedding, residual MLP blocks, head).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor, Var, D};
use kiln_memory::{
    CollectGrads, Executor, GradHook, MicroBatch, ParamProvider, Phase, RecomputePolicy,
    SegmentParams, SegmentedModel, StaticParams,
};

const VOCAB: usize = 11;
const D_MODEL: usize = 8;
const BLOCKS: usize = 4;

struct Toy {
    params: Vec<SegmentParams>,
}

fn var(shape: &[usize], seed: u64) -> Var {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|i| {
            let x = ((i as u64 + 1) * 2654435761 + seed * 40503) % 1000;
            (x as f32 / 1000.0 - 0.5) * 0.8
        })
        .collect();
    Var::from_tensor(&Tensor::from_vec(data, shape, &Device::Cpu).unwrap()).unwrap()
}

impl Toy {
    fn new() -> Self {
        let wte = var(&[VOCAB, D_MODEL], 1);
        let mut params = vec![SegmentParams::new(vec![("wte".into(), wte.clone())])];
        for b in 0..BLOCKS {
            params.push(SegmentParams::new(vec![
                (
                    format!("h{b}.w1"),
                    var(&[D_MODEL, 2 * D_MODEL], 10 + b as u64),
                ),
                (format!("h{b}.b1"), var(&[2 * D_MODEL], 20 + b as u64)),
                (
                    format!("h{b}.w2"),
                    var(&[2 * D_MODEL, D_MODEL], 30 + b as u64),
                ),
            ]));
        }
        // the head is tied to the embedding, as in GPT
        params.push(SegmentParams::new(vec![("wte".into(), wte)]));
        Self { params }
    }

    fn all_vars(&self) -> Vec<(String, Var)> {
        let mut out: Vec<(String, Var)> = Vec::new();
        for p in &self.params {
            for (n, v) in p.vars() {
                if !out.iter().any(|(m, _)| m == n) {
                    out.push((n.clone(), v.clone()));
                }
            }
        }
        out
    }
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
            // A one-hot matmul rather than `index_select`: candle's `index_select` backward
            // index-adds straight into the accumulated gradient of a tied weight, which changes
            // the summation order against a segmented backward; a matmul's gradient is added
            // as one tensor, as the head's is.
            let onehot = x
                .flatten_all()?
                .unsqueeze(1)?
                .broadcast_eq(&Tensor::arange(0u32, VOCAB as u32, x.device())?.unsqueeze(0)?)?
                .to_dtype(DType::F32)?;
            let e = onehot.matmul(p.tensor("wte")?)?;
            return e.reshape((b, t, D_MODEL));
        }
        if i == BLOCKS + 1 {
            let (b, t, d) = x.dims3()?;
            let logits = x.reshape((b * t, d))?.matmul(&p.tensor("wte")?.t()?)?;
            // composite cross-entropy (these candle ops all have a backward)
            let max = logits.max_keepdim(D::Minus1)?.detach();
            let shifted = logits.broadcast_sub(&max)?;
            let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
            let logp = shifted.broadcast_sub(&lse)?;
            let picked = logp.gather(&batch.targets().flatten_all()?.unsqueeze(1)?, 1)?;
            return picked.mean_all()?.neg();
        }
        let blk = i - 1;
        let (b, t, d) = x.dims3()?;
        let h = x.reshape((b * t, d))?;
        let a = h
            .matmul(p.tensor(&format!("h{blk}.w1"))?)?
            .broadcast_add(p.tensor(&format!("h{blk}.b1"))?)?
            .tanh()?;
        let y = a.matmul(p.tensor(&format!("h{blk}.w2"))?)?;
        (h + y)?.reshape((b, t, d))
    }
}

fn batch() -> (Tensor, Tensor) {
    let toks: Vec<u32> = (0..24).map(|i| (i * 7 % VOCAB) as u32).collect();
    let tgts: Vec<u32> = (0..24).map(|i| ((i * 5 + 3) % VOCAB) as u32).collect();
    (
        Tensor::from_vec(toks, (3, 8), &Device::Cpu).unwrap(),
        Tensor::from_vec(tgts, (3, 8), &Device::Cpu).unwrap(),
    )
}

/// The reference: one forward through all segments and one `backward()`.
fn whole_model(m: &Toy) -> (f32, Vec<(String, Vec<f32>)>) {
    let (x, y) = batch();
    let b = MicroBatch::new(x.clone(), y).unwrap();
    let mut h = x;
    for i in 0..m.num_segments() {
        h = m.forward_segment(i, &h, &b, &m.params[i]).unwrap();
    }
    let grads = h.backward().unwrap();
    let g = m
        .all_vars()
        .into_iter()
        .map(|(n, v)| (n, flat(grads.get(v.as_tensor()).unwrap())))
        .collect();
    (h.to_scalar::<f32>().unwrap(), g)
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn segmented(m: &Toy, policy: RecomputePolicy) -> (f32, Vec<(String, Vec<f32>)>, usize) {
    let (x, y) = batch();
    let mut provider = StaticParams::new(m.params.clone());
    let mut hook = CollectGrads::default();
    let out = Executor::new(policy)
        .run(
            m,
            &MicroBatch::new(x, y).unwrap(),
            &mut provider,
            &mut hook,
            1.0,
        )
        .unwrap();
    let g = m
        .all_vars()
        .into_iter()
        .map(|(n, _)| {
            let t = hook.get(&n).unwrap();
            (n, flat(t))
        })
        .collect();
    (out.loss.to_scalar::<f32>().unwrap(), g, out.recomputed)
}

/// Equal as floats element by element (so +0 and -0 count as equal: the seeded backward adds a
/// zero that can turn a -0 gradient into +0), and bitwise equal everywhere else.
fn assert_same(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) {
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (i, (x, y)) in va.iter().zip(vb).enumerate() {
            assert!(
                x == y,
                "{na}[{i}]: {x:e} vs {y:e} ({:#x} vs {:#x})",
                x.to_bits(),
                y.to_bits()
            );
        }
    }
}

#[test]
fn segmented_gradients_equal_whole_model_backward() {
    let m = Toy::new();
    let (loss_ref, g_ref) = whole_model(&m);
    let (loss, g, recomputed) = segmented(&m, RecomputePolicy::None);
    assert_eq!(loss.to_bits(), loss_ref.to_bits());
    assert_eq!(recomputed, 0);
    assert_same(&g, &g_ref);
    // the gradients are not trivially zero
    assert!(g.iter().all(|(_, v)| v.iter().any(|x| *x != 0.0)));
}

#[test]
fn recomputed_gradients_equal_stored() {
    let m = Toy::new();
    let (loss_ref, g_ref, _) = segmented(&m, RecomputePolicy::None);
    for (policy, want) in [
        (RecomputePolicy::EveryBlock, BLOCKS),
        (RecomputePolicy::EveryKth(2), 2),
        (RecomputePolicy::EveryKth(3), 2),
    ] {
        let (loss, g, recomputed) = segmented(&m, policy);
        assert_eq!(recomputed, want, "{policy:?}");
        assert_eq!(loss.to_bits(), loss_ref.to_bits());
        assert_same(&g, &g_ref);
    }
}

#[test]
fn loss_scale_scales_gradients_exactly() {
    let m = Toy::new();
    let (_, g_ref, _) = segmented(&m, RecomputePolicy::None);
    let (x, y) = batch();
    let mut provider = StaticParams::new(m.params.clone());
    let mut hook = CollectGrads::default();
    Executor::new(RecomputePolicy::EveryBlock)
        .run(
            &m,
            &MicroBatch::new(x, y).unwrap(),
            &mut provider,
            &mut hook,
            1024.0,
        )
        .unwrap();
    for (n, v) in g_ref {
        let scaled = flat(hook.get(&n).unwrap());
        for (a, b) in scaled.iter().zip(&v) {
            // a power of two scales exactly
            assert_eq!(*a, b * 1024.0, "{n}");
        }
    }
}

/// Records the order of provider and hook calls, as ZeRO-3 and overlapped DP rely on it.
#[derive(Default)]
struct Trace {
    inner: Option<StaticParams>,
    log: Vec<String>,
}

impl ParamProvider for Trace {
    fn acquire(
        &mut self,
        segment: usize,
        phase: Phase,
    ) -> Result<SegmentParams, kiln_memory::BoxError> {
        self.log.push(format!("acquire {segment} {phase:?}"));
        self.inner.as_mut().unwrap().acquire(segment, phase)
    }
    fn release(&mut self, segment: usize, _p: SegmentParams) -> Result<(), kiln_memory::BoxError> {
        self.log.push(format!("release {segment}"));
        Ok(())
    }
}

struct HookTrace<'a>(&'a mut Vec<String>);

impl GradHook for HookTrace<'_> {
    fn segment_grads(
        &mut self,
        segment: usize,
        grads: Vec<(String, Tensor)>,
    ) -> Result<(), kiln_memory::BoxError> {
        self.0.push(format!("grads {segment} x{}", grads.len()));
        Ok(())
    }
}

#[test]
fn hooks_run_between_segments_in_order() {
    let m = Toy::new();
    let (x, y) = batch();
    let mut trace = Trace {
        inner: Some(StaticParams::new(m.params.clone())),
        log: Vec::new(),
    };
    let mut hook_log = Vec::new();
    Executor::new(RecomputePolicy::EveryKth(2))
        .run(
            &m,
            &MicroBatch::new(x, y).unwrap(),
            &mut trace,
            &mut HookTrace(&mut hook_log),
            1.0,
        )
        .unwrap();
    let log = trace.log.join(", ");
    // blocks 0 and 2 (segments 1 and 3) are checkpointed: released after forward, re-acquired
    assert!(log.starts_with("acquire 0 Forward, acquire 1 Forward, release 1, acquire 2 Forward, acquire 3 Forward, release 3,"), "{log}");
    assert!(
        log.contains(
            "acquire 3 Recompute, release 3, release 2, acquire 1 Recompute, release 1, release 0"
        ),
        "{log}"
    );
    assert_eq!(
        hook_log,
        vec![
            "grads 5 x1",
            "grads 4 x3",
            "grads 3 x3",
            "grads 2 x3",
            "grads 1 x3",
            "grads 0 x1"
        ]
    );
}

#[test]
fn a_non_scalar_loss_is_an_error() {
    struct Bad;
    impl SegmentedModel for Bad {
        fn num_segments(&self) -> usize {
            1
        }
        fn forward_segment(
            &self,
            _: usize,
            x: &Tensor,
            _: &MicroBatch,
            _: &SegmentParams,
        ) -> candle_core::Result<Tensor> {
            x.to_dtype(DType::F32)
        }
    }
    let x = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
    let err = Executor::default()
        .run(
            &Bad,
            &MicroBatch::new(x.clone(), x).unwrap(),
            &mut StaticParams::new(vec![SegmentParams::default()]),
            &mut CollectGrads::default(),
            1.0,
        )
        .unwrap_err();
    assert!(err.to_string().contains("scalar loss"), "{err}");
}

/// The model cut into pipeline stages, [`Executor::forward`] and [`Executor::backward`] over
/// each range with the activations and their gradients handed between them: the loss and every
/// gradient bitwise those of [`Executor::run`] over the whole model, for every cut and policy.
#[test]
fn stage_ranges_equal_the_whole_run() {
    let m = Toy::new();
    let n = m.num_segments();
    for policy in [
        RecomputePolicy::None,
        RecomputePolicy::EveryBlock,
        RecomputePolicy::Selective(1),
    ] {
        let (loss, grads, _) = segmented(&m, policy);
        for cuts in [
            vec![0, 1, n],
            vec![0, 3, n],
            vec![0, 2, 4, n],
            vec![0, n - 1, n],
        ] {
            let (x, y) = batch();
            let b = MicroBatch::new(x.clone(), y).unwrap();
            let mut provider = StaticParams::new(m.params.clone());
            let mut hook = CollectGrads::default();
            let ex = Executor::new(policy);
            let mut kept = Vec::new();
            let mut act = x;
            for w in cuts.windows(2) {
                let f = ex.forward(&m, w[0]..w[1], act, &b, &mut provider).unwrap();
                act = f.output.clone();
                kept.push(f);
            }
            let stage_loss = act.to_scalar::<f32>().unwrap();
            let mut grad = None;
            while let Some(f) = kept.pop() {
                let first = kept.is_empty();
                let out = ex
                    .backward(&m, f, grad.take(), &b, &mut provider, &mut hook, 1.0)
                    .unwrap();
                assert_eq!(out.grad_input.is_none(), first, "{cuts:?}");
                grad = out.grad_input;
            }
            assert_eq!(stage_loss.to_bits(), loss.to_bits(), "{policy:?} {cuts:?}");
            let staged: Vec<(String, Vec<f32>)> = m
                .all_vars()
                .into_iter()
                .map(|(name, _)| {
                    let t = hook.get(&name).unwrap();
                    (name, flat(t))
                })
                .collect();
            assert_same(&staged, &grads);
        }
    }
    // a range that is empty or past the model is an error naming it
    let (x, y) = batch();
    let b = MicroBatch::new(x.clone(), y).unwrap();
    let mut provider = StaticParams::new(m.params.clone());
    let e = Executor::new(RecomputePolicy::None)
        .forward(&m, 2..n + 1, x, &b, &mut provider)
        .unwrap_err()
        .to_string();
    assert!(e.contains("segments 2..7"), "{e}");
}
