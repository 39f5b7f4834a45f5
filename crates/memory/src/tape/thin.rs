//! A tape whose cheap outputs are dropped after the forward and computed again in the
//! backward: selective activation recomputation (Korthikanti et al., 2022, recompute only
//! what costs little to run again).
//!
//! [`Tape::thin`] turns a segment's records into a table of values, each held once: the
//! segment's variables as they are, every other tensor without candle's graph (so nothing
//! but the table keeps it), and the outputs of ops recorded under
//! [`recomputable`](super::recomputable) not at all. [`Thinned::backward`] walks the records
//! in reverse as [`Tape::backward`] does; where a record needs a dropped value, the op that
//! produced it runs again on its inputs (themselves computed again where they were dropped),
//! which gives bitwise the value the forward had. A value is released once the last record
//! that uses it has run its backward.

use super::{add_grad, seed_grads, tracked, Op, Tape, TapeGrads};
use candle_core::{Tensor, TensorId};
use std::collections::HashMap;

/// One tensor of the segment.
struct Value {
    /// The id the forward gave it, by which gradients are keyed.
    id: TensorId,
    /// Whether it takes part in the backward (as in [`Tape::backward`]).
    tracked: bool,
    /// The tensor, where it is held now.
    tensor: Option<Tensor>,
    /// The record that produced it (none for the segment's input, variables and constants).
    producer: Option<usize>,
    /// Records not yet walked that read or produced it.
    uses: usize,
}

/// A record of the table: its op and its values.
struct Rec {
    op: Op,
    inputs: Vec<usize>,
    output: usize,
}

/// A segment's records with the outputs of its cheap ops dropped (see the module docs).
pub struct Thinned {
    recs: Vec<Rec>,
    values: Vec<Value>,
    output: usize,
}

impl std::fmt::Debug for Thinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Thinned")
            .field("ops", &self.recs.len())
            .field("values", &self.values.len())
            .field("held", &self.held())
            .finish()
    }
}

impl Tape {
    /// The records as a [`Thinned`] table leading to `output`: the outputs of the ops recorded
    /// under [`recomputable`](super::recomputable) dropped (all but `output` itself), every
    /// other tensor kept without candle's graph. Gives the tape back where it does not cover
    /// `output` ([`Tape::covers`]).
    pub fn thin(self, output: &Tensor) -> std::result::Result<Thinned, Tape> {
        if !self.covers(output) {
            return Err(self);
        }
        let mut index: HashMap<TensorId, usize> = HashMap::new();
        let mut values: Vec<Value> = Vec::new();
        let mut recs = Vec::with_capacity(self.entries.len());
        let mut slot = |t: &Tensor, producer: Option<usize>, values: &mut Vec<Value>| {
            let v = *index.entry(t.id()).or_insert_with(|| {
                values.push(Value {
                    id: t.id(),
                    tracked: tracked(t),
                    // a variable as it is (its gradient is asked for by the tensor); anything
                    // else without the graph that would keep its inputs alive
                    tensor: Some(if t.is_variable() {
                        t.clone()
                    } else {
                        t.detach()
                    }),
                    producer,
                    uses: 0,
                });
                values.len() - 1
            });
            values[v].uses += 1;
            v
        };
        let mut dropped = Vec::new();
        for (r, e) in self.entries.into_iter().enumerate() {
            let inputs: Vec<usize> = e
                .inputs
                .iter()
                .map(|t| slot(t, None, &mut values))
                .collect();
            let out = slot(&e.output, Some(r), &mut values);
            if e.cheap && e.output.id() != output.id() {
                dropped.push(out);
            }
            recs.push(Rec {
                op: e.op,
                inputs,
                output: out,
            });
        }
        for v in dropped {
            values[v].tensor = None;
        }
        let output = index[&output.id()];
        Ok(Thinned {
            recs,
            values,
            output,
        })
    }
}

impl Thinned {
    /// The segment's output (without its graph).
    pub fn output(&self) -> Option<&Tensor> {
        self.values[self.output].tensor.as_ref()
    }

    /// How many values the table holds now.
    pub fn held(&self) -> usize {
        self.values.iter().filter(|v| v.tensor.is_some()).count()
    }

    /// How many values were dropped (and would be computed again).
    pub fn dropped(&self) -> usize {
        self.values.len() - self.held()
    }

    /// [`Tape::backward`] over the table: the gradients of every variable the output depends
    /// on, given the output's, computing dropped values again where a record needs them.
    pub fn backward(mut self, grad: Tensor) -> candle_core::Result<TapeGrads> {
        let Some(out) = self.output() else {
            return Err(candle_core::Error::msg(
                "thinned tape: the output was dropped",
            ));
        };
        // the output is held without its graph; gradients go by the forward's ids
        let id = self.values[self.output].id;
        let mut grads = seed_grads("thinned tape backward", id, out, grad)?;
        while let Some(last) = self.recs.last() {
            let out_id = self.values[last.output].id;
            let g = grads.remove(&out_id);
            if g.is_some() {
                // while the record is still among the records, so that its own output can be
                // computed again (a consumer's backward has normally done that already)
                let vs: Vec<usize> = last.inputs.iter().copied().chain([last.output]).collect();
                for v in vs {
                    self.materialize(v)?;
                }
            }
            let Some(rec) = self.recs.pop() else {
                break;
            };
            if let Some(g) = g {
                let inputs = self.tensors(&rec.inputs)?;
                let out = self.tensors(&[rec.output])?.remove(0);
                let input_grads = rec.op.backward(&inputs, &out, &g.detach())?;
                for (&v, ig) in rec.inputs.iter().zip(input_grads) {
                    let Some(ig) = ig else {
                        continue;
                    };
                    if !self.values[v].tracked {
                        continue;
                    }
                    add_grad(&mut grads, self.values[v].id, ig)?;
                }
            }
            for &v in rec.inputs.iter().chain([&rec.output]) {
                let value = &mut self.values[v];
                value.uses = value.uses.saturating_sub(1);
                if value.uses == 0 {
                    value.tensor = None;
                }
            }
        }
        Ok(TapeGrads { grads })
    }

    /// The tensors of `vs`, every one held.
    fn tensors(&self, vs: &[usize]) -> candle_core::Result<Vec<Tensor>> {
        vs.iter()
            .map(|&v| {
                self.values[v].tensor.clone().ok_or_else(|| {
                    candle_core::Error::msg("thinned tape: a value is not held where it is read")
                })
            })
            .collect()
    }

    /// Holds value `v` again where it was dropped: its producer runs on its inputs, each
    /// computed again first where it was dropped too.
    fn materialize(&mut self, v: usize) -> candle_core::Result<()> {
        if self.values[v].tensor.is_some() {
            return Ok(());
        }
        let Some(p) = self.values[v].producer else {
            return Err(candle_core::Error::msg(
                "thinned tape: a dropped value has no op to compute it again",
            ));
        };
        // the producer came earlier in the forward (or is the record being walked), so it is
        // still among the records
        let Some(rec) = self.recs.get(p) else {
            return Err(candle_core::Error::msg(
                "thinned tape: a dropped value's op has already been walked",
            ));
        };
        let (op, inputs) = (rec.op.clone(), rec.inputs.clone());
        for &i in &inputs {
            self.materialize(i)?;
        }
        let out = op.forward(&self.tensors(&inputs)?)?;
        self.values[v].tensor = Some(out);
        Ok(())
    }
}
