//! A segment's backward without candle's per-node bookkeeping.
//!
//! candle's `backward()` gives every input of every graph node a zero-filled gradient buffer
//! and adds the node's gradient into it (`GradStore::or_insert`, then `add`): a fill, two
//! reads and a write of every activation and weight gradient, most of which have a single
//! contribution to sum. PyTorch's autograd keeps the first contribution as it is and adds only
//! the later ones. In a transformer block that bookkeeping moved about 190 MB a step per block
//! of a d_model 512 GPT, the largest part of what separated kiln's CPU backward from
//! PyTorch's.
//!
//! A [`Tape`] records the custom ops a segment's forward runs through [`apply_op1`],
//! [`apply_op2`] and [`apply_op3`] (kiln's own ops call these; each still builds candle's
//! graph as usual). [`Tape::backward`] then walks the records in reverse, calling each op's
//! own `bwd`, keeping a gradient's first contribution as it is and adding later ones (in the
//! order candle's backward adds them, so the results are bitwise candle's). Where something
//! else took part in the segment (a candle op that tracks gradients, such as a matmul or a
//! reshape of a tracked tensor), the tape does not cover it and says so: [`Tape::backward`]
//! returns `None` and the caller runs candle's backward on the graph, which is always built.
//!
//! Recording is per thread and only inside [`record`]; outside it the `apply_op` functions
//! are candle's.
//!
//! ```
//! use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, Var, Device};
//! struct Double;
//! impl CustomOp1 for Double {
//!     fn name(&self) -> &'static str { "double" }
//!     fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
//!         let CpuStorage::F32(v) = s else { candle_core::bail!("f32 only") };
//!         Ok((CpuStorage::F32(v.iter().map(|x| 2.0 * x).collect()), l.shape().clone()))
//!     }
//!     fn bwd(&self, _a: &Tensor, _r: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
//!         Ok(Some((g * 2.0)?))
//!     }
//! }
//! let x = Var::new(&[1f32, 2.0], &Device::Cpu)?;
//! let (y, tape) = kiln_memory::tape::record(|| kiln_memory::tape::apply_op1(x.as_tensor(), Double));
//! let y = y?;
//! let seed = Tensor::new(&[1f32, 10.0], &Device::Cpu)?;
//! let Some(grads) = tape.backward(&y, seed)? else {
//!     return Err(candle_core::Error::msg("the tape does not cover y"));
//! };
//! let Some(dx) = grads.get(x.as_tensor()) else {
//!     return Err(candle_core::Error::msg("no gradient for x"));
//! };
//! assert_eq!(dx.to_vec1::<f32>()?, vec![2.0, 20.0]);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{CustomOp1, CustomOp2, CustomOp3, Tensor, TensorId};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

mod thin;
pub use thin::Thinned;

type Op1 = Arc<Box<dyn CustomOp1 + Send + Sync>>;
type Op2 = Arc<Box<dyn CustomOp2 + Send + Sync>>;
type Op3 = Arc<Box<dyn CustomOp3 + Send + Sync>>;

/// A recorded op's kind, with which its forward runs again and its backward runs.
#[derive(Clone)]
enum Op {
    One(Op1),
    Two(Op2),
    Three(Op3),
}

impl Op {
    /// The op's forward of `inputs` (a recomputation: with inputs that track nothing, candle
    /// builds no graph).
    fn forward(&self, inputs: &[Tensor]) -> candle_core::Result<Tensor> {
        match (self, inputs) {
            (Op::One(op), [a]) => a.apply_op1_arc(op.clone()),
            (Op::Two(op), [a, b]) => a.apply_op2_arc(b, op.clone()),
            (Op::Three(op), [a, b, c]) => a.apply_op3_arc(b, c, op.clone()),
            _ => Err(arity(inputs.len())),
        }
    }

    /// The inputs' gradients given the output's, from the op's own backward.
    fn backward(
        &self,
        inputs: &[Tensor],
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        Ok(match (self, inputs) {
            (Op::One(op), [a]) => vec![op.bwd(a, out, grad)?],
            (Op::Two(op), [a, b]) => {
                let (ga, gb) = op.bwd(a, b, out, grad)?;
                vec![ga, gb]
            }
            (Op::Three(op), [a, b, c]) => {
                let (ga, gb, gc) = op.bwd(a, b, c, out, grad)?;
                vec![ga, gb, gc]
            }
            _ => return Err(arity(inputs.len())),
        })
    }
}

fn arity(got: usize) -> candle_core::Error {
    candle_core::Error::msg(format!(
        "tape: an op run with {got} inputs, not its own count"
    ))
}

/// An op whose backward gives any subset of its inputs' gradients without the others, from the
/// inputs and the output's gradient alone (the output itself is not needed): a linear layer's
/// `dx = dy W` apart from its `dW = dy^T x`. A zero-bubble pipeline schedule (Qi et al., 2024)
/// computes a stage's input gradient first, for the previous stage, and the weights' later,
/// where the pipeline would otherwise wait ([`Tape::backward_deferring`]).
pub trait SplitBackward: Send + Sync {
    /// The gradients of the inputs `wanted` marks (`None` for the others), each bitwise what
    /// the op's whole backward gives that input.
    fn backward_part(
        &self,
        inputs: &[Tensor],
        grad: &Tensor,
        wanted: &[bool],
    ) -> candle_core::Result<Vec<Option<Tensor>>>;
}

type Split = Arc<dyn SplitBackward>;

/// A recorded op: its inputs, its output, how to get the inputs' gradients (and some of them
/// without the others, where the op can), and whether its output may be dropped and computed
/// again ([`recomputable`]).
struct Entry {
    op: Op,
    split: Option<Split>,
    inputs: Vec<Tensor>,
    output: Tensor,
    cheap: bool,
}

impl Entry {
    /// The inputs' gradients given the output's, from the op's own backward.
    fn backward(&self, grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        self.op.backward(&self.inputs, &self.output, grad)
    }
}

/// The custom ops one segment's forward ran, in order (see the module documentation).
#[derive(Default)]
pub struct Tape {
    entries: Vec<Entry>,
}

impl std::fmt::Debug for Tape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tape")
            .field("ops", &self.entries.len())
            .finish()
    }
}

thread_local! {
    static RECORDING: RefCell<Option<Tape>> = const { RefCell::new(None) };
    /// How many [`recomputable`] calls are under way on this thread.
    static RECOMPUTABLE: Cell<usize> = const { Cell::new(0) };
}

/// Runs `f` with the ops it records marked as cheap to run again: in a segment checkpointed
/// selectively ([`crate::RecomputePolicy::Selective`]) their outputs are dropped after the
/// forward and computed again from their inputs where the backward needs them (see
/// [`Tape::thin`]). For ops whose forward is deterministic and cheap against the memory its
/// output holds: a LayerNorm, a GELU, a sequence-parallel all-gather. Outside a recording this
/// only runs `f`.
pub fn recomputable<R>(f: impl FnOnce() -> R) -> R {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            RECOMPUTABLE.with(|c| c.set(c.get().saturating_sub(1)));
        }
    }
    RECOMPUTABLE.with(|c| c.set(c.get() + 1));
    let _leave = Leave;
    f()
}

/// Runs `f` with a fresh tape recording this thread's [`apply_op1`], [`apply_op2`] and
/// [`apply_op3`] calls; returns `f`'s result and the tape. A recording already under way
/// (a nested call) goes on afterwards, without what `f` recorded.
pub fn record<R>(f: impl FnOnce() -> R) -> (R, Tape) {
    let outer = RECORDING.with(|r| r.replace(Some(Tape::default())));
    struct Restore(Option<Option<Tape>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(outer) = self.0.take() {
                RECORDING.with(|r| {
                    r.replace(outer);
                });
            }
        }
    }
    let mut restore = Restore(Some(outer));
    let out = f();
    let tape = RECORDING
        .with(|r| r.replace(restore.0.take().flatten()))
        .unwrap_or_default();
    (out, tape)
}

fn push(op: Op, split: Option<Split>, inputs: &[&Tensor], output: &Tensor) {
    RECORDING.with(|r| {
        if let Some(tape) = r.borrow_mut().as_mut() {
            tape.entries.push(Entry {
                op,
                split,
                inputs: inputs.iter().map(|&t| t.clone()).collect(),
                output: output.clone(),
                cheap: RECOMPUTABLE.with(|c| c.get() > 0),
            });
        }
    });
}

/// Whether a recording is under way on this thread.
fn recording() -> bool {
    RECORDING.with(|r| r.borrow().is_some())
}

/// `a.apply_op1(op)`, recorded where a [`record`] is under way on this thread.
pub fn apply_op1(
    a: &Tensor,
    op: impl CustomOp1 + Send + Sync + 'static,
) -> candle_core::Result<Tensor> {
    let op: Op1 = Arc::new(Box::new(op));
    let out = a.apply_op1_arc(op.clone())?;
    if recording() {
        push(Op::One(op), None, &[a], &out);
    }
    Ok(out)
}

/// `a.apply_op2(b, op)`, recorded where a [`record`] is under way on this thread.
pub fn apply_op2(
    a: &Tensor,
    b: &Tensor,
    op: impl CustomOp2 + Send + Sync + 'static,
) -> candle_core::Result<Tensor> {
    let op: Op2 = Arc::new(Box::new(op));
    let out = a.apply_op2_arc(b, op.clone())?;
    if recording() {
        push(Op::Two(op), None, &[a, b], &out);
    }
    Ok(out)
}

/// `a.apply_op3(b, c, op)`, recorded where a [`record`] is under way on this thread.
pub fn apply_op3(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    op: impl CustomOp3 + Send + Sync + 'static,
) -> candle_core::Result<Tensor> {
    let op: Op3 = Arc::new(Box::new(op));
    let out = a.apply_op3_arc(b, c, op.clone())?;
    if recording() {
        push(Op::Three(op), None, &[a, b, c], &out);
    }
    Ok(out)
}

/// [`apply_op2`] for an op that can also give its inputs' gradients apart
/// ([`SplitBackward`]), which [`Tape::backward_deferring`] uses.
pub fn apply_op2_split<O>(a: &Tensor, b: &Tensor, op: O) -> candle_core::Result<Tensor>
where
    O: CustomOp2 + SplitBackward + Clone + 'static,
{
    let split: Split = Arc::new(op.clone());
    let op: Op2 = Arc::new(Box::new(op));
    let out = a.apply_op2_arc(b, op.clone())?;
    if recording() {
        push(Op::Two(op), Some(split), &[a, b], &out);
    }
    Ok(out)
}

/// [`apply_op3`] for an op that can also give its inputs' gradients apart
/// ([`SplitBackward`]), which [`Tape::backward_deferring`] uses.
pub fn apply_op3_split<O>(a: &Tensor, b: &Tensor, c: &Tensor, op: O) -> candle_core::Result<Tensor>
where
    O: CustomOp3 + SplitBackward + Clone + 'static,
{
    let split: Split = Arc::new(op.clone());
    let op: Op3 = Arc::new(Box::new(op));
    let out = a.apply_op3_arc(b, c, op.clone())?;
    if recording() {
        push(Op::Three(op), Some(split), &[a, b, c], &out);
    }
    Ok(out)
}

/// Whether `t` takes part in the backward: a variable, or the result of a tracked op.
fn tracked(t: &Tensor) -> bool {
    t.is_variable() || t.track_op()
}

/// The gradient map of a backward walk, holding `grad` under `id` for `output` (the same
/// shape, or an error naming `walk` and both shapes).
fn seed_grads(
    walk: &str,
    id: TensorId,
    output: &Tensor,
    grad: Tensor,
) -> candle_core::Result<HashMap<TensorId, Tensor>> {
    if grad.shape() != output.shape() {
        return Err(candle_core::Error::msg(format!(
            "{walk}: the output gradient is {:?}, the output {:?}",
            grad.dims(),
            output.dims()
        )));
    }
    Ok(HashMap::from([(id, grad)]))
}

/// Adds `ig` to the gradient held under `id`, or holds it as it is where it is the first
/// contribution (the order candle's backward adds them in).
fn add_grad(
    grads: &mut HashMap<TensorId, Tensor>,
    id: TensorId,
    ig: Tensor,
) -> candle_core::Result<()> {
    let ig = ig.detach();
    let sum = match grads.remove(&id) {
        Some(sum) => sum.add(&ig)?.detach(),
        None => ig,
    };
    grads.insert(id, sum);
    Ok(())
}

/// Gradients from [`Tape::backward`], by tensor.
#[derive(Debug, Default)]
pub struct TapeGrads {
    grads: HashMap<TensorId, Tensor>,
}

impl TapeGrads {
    /// The gradient of `t`, if it received one.
    pub fn get(&self, t: &Tensor) -> Option<&Tensor> {
        self.grads.get(&t.id())
    }

    /// The gradient of the tensor with id `id`, if it received one.
    pub fn get_id(&self, id: TensorId) -> Option<&Tensor> {
        self.grads.get(&id)
    }
}

/// One contribution to the held-back gradients, in the order the walk met it.
enum Held {
    /// Gradients an op's whole backward gave, by tensor.
    Done(Vec<(TensorId, Tensor)>),
    /// Gradients a [`SplitBackward`] op gives later: of the inputs `wanted` marks.
    Todo {
        split: Split,
        inputs: Vec<Tensor>,
        grad: Tensor,
        wanted: Vec<bool>,
    },
}

/// The gradients [`Tape::backward_deferring`] held back (the weights'), computed and summed
/// by [`HeldGrads::compute`]. Until then it keeps what they are computed from: each split
/// op's inputs and output gradient.
#[derive(Default)]
pub struct HeldGrads {
    held: Vec<Held>,
}

impl std::fmt::Debug for HeldGrads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let todo = self
            .held
            .iter()
            .filter(|h| matches!(h, Held::Todo { .. }))
            .count();
        f.debug_struct("HeldGrads")
            .field("contributions", &self.held.len())
            .field("to_compute", &todo)
            .finish()
    }
}

impl HeldGrads {
    /// The held-back gradients: each split op's part computed now, every contribution added
    /// in the order the backward walk met it (so the sums are bitwise those of
    /// [`Tape::backward`]).
    pub fn compute(self) -> candle_core::Result<TapeGrads> {
        let mut grads = HashMap::new();
        for h in self.held {
            match h {
                Held::Done(gs) => {
                    for (id, g) in gs {
                        add_grad(&mut grads, id, g)?;
                    }
                }
                Held::Todo {
                    split,
                    inputs,
                    grad,
                    wanted,
                } => {
                    let igs = split.backward_part(&inputs, &grad, &wanted)?;
                    for ((input, ig), w) in inputs.iter().zip(igs).zip(&wanted) {
                        if let (Some(ig), true) = (ig, *w) {
                            add_grad(&mut grads, input.id(), ig)?;
                        }
                    }
                }
            }
        }
        Ok(TapeGrads { grads })
    }
}

impl Tape {
    /// Number of ops recorded.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether the records alone lead from the variables to `output`: `output` came from a
    /// recorded op, and every tracked input of a recorded op is a variable or the output of
    /// an earlier record.
    pub fn covers(&self, output: &Tensor) -> bool {
        let mut produced = HashSet::new();
        for e in &self.entries {
            let inputs_known = e
                .inputs
                .iter()
                .all(|t| !tracked(t) || t.is_variable() || produced.contains(&t.id()));
            if !inputs_known {
                return false;
            }
            produced.insert(e.output.id());
        }
        produced.contains(&output.id())
    }

    /// The gradients of every variable `output` depends on, given `grad` (`output`'s), by
    /// the recorded ops' own backward in reverse order: a gradient's first contribution is
    /// kept as it is and later ones are added to it. `None` (nothing computed) where the tape
    /// does not cover the way from the variables to `output` ([`Tape::covers`]); candle's
    /// backward then gives them. Each record is dropped once its backward has run, so
    /// activations are freed as the walk goes down.
    pub fn backward(
        mut self,
        output: &Tensor,
        grad: Tensor,
    ) -> candle_core::Result<Option<TapeGrads>> {
        if !self.covers(output) {
            return Ok(None);
        }
        let mut grads = seed_grads("tape backward", output.id(), output, grad)?;
        while let Some(e) = self.entries.pop() {
            // every use of the output came later in the forward, so its gradient is whole
            let Some(g) = grads.remove(&e.output.id()) else {
                continue;
            };
            let input_grads = e.backward(&g.detach())?;
            for (input, ig) in e.inputs.iter().zip(input_grads) {
                let Some(ig) = ig else {
                    continue;
                };
                if !tracked(input) {
                    continue;
                }
                add_grad(&mut grads, input.id(), ig)?;
            }
        }
        Ok(Some(TapeGrads { grads }))
    }

    /// [`Tape::backward`] with the gradients of `defer` (a segment's weights) held back: the
    /// walk computes the gradients every other input needs now (a pipeline stage's input
    /// gradient goes to the previous stage at once) and returns the held part, which
    /// [`HeldGrads::compute`] completes later. A [`SplitBackward`] op computes only its
    /// non-held inputs' gradients in the walk and its held ones later (a linear layer's
    /// `dx` now, `dW` later); any other op computes all of them in the walk and only their
    /// sum waits. The gradients are bitwise [`Tape::backward`]'s. `None` where the tape does
    /// not cover the way to `output`.
    pub fn backward_deferring(
        mut self,
        output: &Tensor,
        grad: Tensor,
        defer: &HashSet<TensorId>,
    ) -> candle_core::Result<Option<(TapeGrads, HeldGrads)>> {
        if !self.covers(output) {
            return Ok(None);
        }
        let mut grads = seed_grads("tape backward", output.id(), output, grad)?;
        let mut held = HeldGrads::default();
        while let Some(e) = self.entries.pop() {
            let Some(g) = grads.remove(&e.output.id()) else {
                continue;
            };
            let g = g.detach();
            let later: Vec<bool> = e
                .inputs
                .iter()
                .map(|t| tracked(t) && defer.contains(&t.id()))
                .collect();
            let input_grads = match &e.split {
                Some(split) if later.iter().any(|&l| l) => {
                    let now: Vec<bool> = e
                        .inputs
                        .iter()
                        .zip(&later)
                        .map(|(t, &l)| tracked(t) && !l)
                        .collect();
                    let igs = if now.iter().any(|&n| n) {
                        split.backward_part(&e.inputs, &g, &now)?
                    } else {
                        vec![None; e.inputs.len()]
                    };
                    held.held.push(Held::Todo {
                        split: split.clone(),
                        inputs: e.inputs.clone(),
                        grad: g,
                        wanted: later.clone(),
                    });
                    igs
                }
                _ => {
                    let mut igs = e.backward(&g)?;
                    let done: Vec<(TensorId, Tensor)> = e
                        .inputs
                        .iter()
                        .zip(igs.iter_mut())
                        .zip(&later)
                        .filter(|(_, &l)| l)
                        .filter_map(|((t, ig), _)| ig.take().map(|ig| (t.id(), ig.detach())))
                        .collect();
                    if !done.is_empty() {
                        held.held.push(Held::Done(done));
                    }
                    igs
                }
            };
            for ((input, ig), &l) in e.inputs.iter().zip(input_grads).zip(&later) {
                let Some(ig) = ig else {
                    continue;
                };
                if !tracked(input) || l {
                    continue;
                }
                add_grad(&mut grads, input.id(), ig)?;
            }
        }
        Ok(Some((TapeGrads { grads }, held)))
    }
}
