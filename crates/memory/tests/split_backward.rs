//! The backward with the weights' gradients held back (`Tape::backward_deferring`,
//! `Executor::backward_deferring`, a zero-bubble pipeline schedule's input pass) against the
//! whole backward: bitwise the same gradients, the split ops' weight parts computed only in
//! the weight pass, and the input gradient there at once.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Shape, Tensor, Var};
use kiln_memory::tape::{self, SplitBackward};
use kiln_memory::{
    CollectGrads, Executor, MicroBatch, RecomputePolicy, SegmentParams, SegmentedModel,
    StaticParams,
};
use std::collections::HashSet;

thread_local! {
    static WEIGHT_PARTS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many times a [`Scale`] op computed its weight's gradient on this thread.
fn weight_parts() -> usize {
    WEIGHT_PARTS.with(|c| c.get())
}

fn f32s(s: &CpuStorage, l: &Layout) -> Vec<f32> {
    let CpuStorage::F32(v) = s else {
        panic!("f32 only")
    };
    let (a, b) = l.contiguous_offsets().expect("contiguous");
    v[a..b].to_vec()
}

/// `y = x * w` elementwise, with `x` `[rows, n]` and `w` `[n]`: `dx = g * w`, `dw` the column
/// sums of `g * x` (rows in order). With `split`, its backward can give either alone.
#[derive(Clone, Copy)]
struct Scale;

fn scale_fwd(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let (x, w) = (f32s(s1, l1), f32s(s2, l2));
    let n = w.len();
    let y = x.iter().enumerate().map(|(i, v)| v * w[i % n]).collect();
    Ok((CpuStorage::F32(y), l1.shape().clone()))
}

fn scale_dx(w: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    g.broadcast_mul(w)
}

fn scale_dw(x: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    WEIGHT_PARTS.with(|c| c.set(c.get() + 1));
    (g * x)?.sum(0)
}

impl CustomOp2 for Scale {
    fn name(&self) -> &'static str {
        "test-scale"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        scale_fwd(s1, l1, s2, l2)
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(scale_dx(w, g)?), Some(scale_dw(x, g)?)))
    }
}

impl SplitBackward for Scale {
    fn backward_part(
        &self,
        inputs: &[Tensor],
        grad: &Tensor,
        wanted: &[bool],
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let [x, w] = inputs else {
            candle_core::bail!("two inputs")
        };
        Ok(vec![
            wanted[0].then(|| scale_dx(w, grad)).transpose()?,
            wanted[1].then(|| scale_dw(x, grad)).transpose()?,
        ])
    }
}

/// [`Scale`] without a split backward: its whole backward runs in the input pass.
#[derive(Clone, Copy)]
struct WholeScale;

impl CustomOp2 for WholeScale {
    fn name(&self) -> &'static str {
        "test-whole-scale"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        scale_fwd(s1, l1, s2, l2)
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(g.broadcast_mul(w)?), Some((g * x)?.sum(0)?)))
    }
}

/// The sum of every element, as a recorded op (a candle `sum_all` would leave the segment to
/// candle's backward, which computes every gradient at once).
struct Total;

impl candle_core::CustomOp1 for Total {
    fn name(&self) -> &'static str {
        "test-total"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let total: f32 = f32s(s, l).iter().sum();
        Ok((CpuStorage::F32(vec![total]), Shape::from(())))
    }
    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(g.broadcast_as(x.shape())?.contiguous()?))
    }
}

fn var(shape: &[usize], seed: u64) -> Var {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|i| {
            let x = ((i as u64 + 1) * 2654435761 + seed * 40503) % 1000;
            (x as f32 / 1000.0 - 0.5) * 1.7
        })
        .collect();
    Var::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// `w0` read by two split ops and `w1` by a split and a whole one, so a weight's held
/// contributions mix both kinds; `x` is a variable whose gradient is not held.
fn chain(x: &Tensor, w0: &Tensor, w1: &Tensor) -> candle_core::Result<Tensor> {
    let a = tape::apply_op2_split(x, w0, Scale)?;
    let b = tape::apply_op2(&a, w1, WholeScale)?;
    let c = tape::apply_op2_split(&b, w1, Scale)?;
    tape::apply_op2_split(&c, w0, Scale)
}

#[test]
fn tape_holds_back_the_weights_and_gives_the_same_bits() {
    let (rows, n) = (5, 7);
    let x = var(&[rows, n], 1);
    let (w0, w1) = (var(&[n], 2), var(&[n], 3));
    let seed = var(&[rows, n], 4).as_tensor().clone();
    let run = || tape::record(|| chain(x.as_tensor(), w0.as_tensor(), w1.as_tensor()));

    let (y, whole) = run();
    let whole = whole.backward(&y.unwrap(), seed.clone()).unwrap().unwrap();

    let (y, t) = run();
    let defer: HashSet<_> = [w0.as_tensor().id(), w1.as_tensor().id()].into();
    let before = weight_parts();
    let (now, held) = t
        .backward_deferring(&y.unwrap(), seed, &defer)
        .unwrap()
        .unwrap();
    assert_eq!(
        weight_parts(),
        before,
        "a split op's weight part ran in the input pass"
    );
    assert_eq!(
        bits(
            now.get(x.as_tensor())
                .expect("x's gradient in the input pass")
        ),
        bits(whole.get(x.as_tensor()).unwrap())
    );
    assert!(now.get(w0.as_tensor()).is_none() && now.get(w1.as_tensor()).is_none());
    let later = held.compute().unwrap();
    assert_eq!(
        weight_parts(),
        before + 3,
        "the three split ops' weight parts"
    );
    for (w, name) in [(&w0, "w0"), (&w1, "w1")] {
        assert_eq!(
            bits(later.get(w.as_tensor()).unwrap_or_else(|| panic!("{name}"))),
            bits(whole.get(w.as_tensor()).unwrap()),
            "{name}"
        );
    }
}

/// Two segments of [`chain`], the second reading the first's `w0` too (a tied weight).
struct Two {
    params: Vec<SegmentParams>,
}

impl SegmentedModel for Two {
    fn num_segments(&self) -> usize {
        2
    }
    fn forward_segment(
        &self,
        i: usize,
        x: &Tensor,
        _b: &MicroBatch,
        p: &SegmentParams,
    ) -> candle_core::Result<Tensor> {
        let y = chain(x, p.tensor("w0")?, p.tensor(&format!("w{}", i + 1))?)?;
        if i == 1 {
            tape::apply_op1(&y, Total)
        } else {
            Ok(y)
        }
    }
}

#[test]
fn executor_weight_pass_equals_the_whole_backward() {
    let (rows, n) = (4, 6);
    let w0 = var(&[n], 5);
    let params = vec![
        SegmentParams::new(vec![("w0".into(), w0.clone()), ("w1".into(), var(&[n], 6))]),
        SegmentParams::new(vec![("w0".into(), w0), ("w2".into(), var(&[n], 7))]),
    ];
    let model = Two {
        params: params.clone(),
    };
    let x = var(&[rows, n], 8).as_tensor().detach();
    let batch = MicroBatch::new(x.clone(), x.clone()).unwrap();
    for policy in [RecomputePolicy::None, RecomputePolicy::EveryBlock] {
        let exec = Executor::new(policy);
        let mut provider = StaticParams::new(model.params.clone());
        let mut whole = CollectGrads::default();
        let f = exec
            .forward(&model, 0..2, x.clone(), &batch, &mut provider)
            .unwrap();
        exec.backward(&model, f, None, &batch, &mut provider, &mut whole, 2.0)
            .unwrap();

        let f = exec
            .forward(&model, 0..2, x.clone(), &batch, &mut provider)
            .unwrap();
        let before = weight_parts();
        let (_, pass) = exec
            .backward_deferring(&model, f, None, &batch, &mut provider, 2.0)
            .unwrap();
        assert_eq!(
            weight_parts(),
            before,
            "{policy}: weight parts in the input pass"
        );
        assert_eq!(pass.to_compute(), 2, "{policy}: both segments hold work");
        let mut later = CollectGrads::default();
        pass.run(&mut later).unwrap();
        assert_eq!(weight_parts(), before + 6, "{policy}");
        for name in ["w0", "w1", "w2"] {
            assert_eq!(
                bits(later.get(name).unwrap()),
                bits(whole.get(name).unwrap()),
                "{policy}: {name}"
            );
        }
    }
}
