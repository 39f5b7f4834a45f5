//! The parameters' gradients of a backward whose input gradient went ahead
//! ([`super::Executor::backward_deferring`]).

use super::{hook_err, GradHook, SegmentParams};
use crate::error::Result;
use crate::tape::HeldGrads;
use candle_core::{Tensor, TensorId};

/// One segment's part of a [`WeightPass`].
enum Segment {
    /// Gradients computed in the backward walk, to hand over.
    Done(usize, Vec<(String, Tensor)>),
    /// Gradients the tape held back, to compute: the segment's parameters by name and id.
    Held(usize, HeldGrads, Vec<(String, TensorId)>),
}

/// The parameters' gradients [`super::Executor::backward_deferring`] held back, segment by
/// segment from the last of its range to the first (the order [`super::Executor::backward`]
/// hands them over in). Until [`WeightPass::run`] it keeps what they are computed from: the
/// inputs of the segments' linear layers and their output gradients.
#[derive(Default)]
pub struct WeightPass {
    segments: Vec<Segment>,
}

impl std::fmt::Debug for WeightPass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self
            .segments
            .iter()
            .filter(|s| matches!(s, Segment::Held(..)))
            .count();
        f.debug_struct("WeightPass")
            .field("segments", &self.segments.len())
            .field("to_compute", &held)
            .finish()
    }
}

impl WeightPass {
    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// Segments whose gradients are still to compute (not only to hand over).
    pub fn to_compute(&self) -> usize {
        self.segments
            .iter()
            .filter(|s| matches!(s, Segment::Held(..)))
            .count()
    }

    /// Computes what is held and hands each segment's parameter gradients to `hook`, in the
    /// order [`super::Executor::backward`] would have: bitwise the same gradients.
    pub fn run(self, hook: &mut dyn GradHook) -> Result<()> {
        for s in self.segments {
            let (i, grads) = match s {
                Segment::Done(i, grads) => (i, grads),
                Segment::Held(i, held, names) => {
                    let computed = held.compute()?;
                    let grads = names
                        .into_iter()
                        .filter_map(|(name, id)| computed.get_id(id).map(|g| (name, g.clone())))
                        .collect();
                    (i, grads)
                }
            };
            hook.segment_grads(i, grads)
                .map_err(|source| hook_err("gradient hook", i, source))?;
        }
        Ok(())
    }

    /// Segment `i`'s computed gradients: to `hook` now where there is one, else held.
    pub(super) fn hand_over(
        &mut self,
        i: usize,
        grads: Vec<(String, Tensor)>,
        hook: &mut Option<&mut dyn GradHook>,
    ) -> Result<()> {
        match hook {
            Some(hook) => hook
                .segment_grads(i, grads)
                .map_err(|source| hook_err("gradient hook", i, source)),
            None => {
                self.segments.push(Segment::Done(i, grads));
                Ok(())
            }
        }
    }

    /// Segment `i`'s gradients the tape held back, for its parameters `params`.
    pub(super) fn hold(&mut self, i: usize, held: HeldGrads, params: &SegmentParams) {
        let names = params
            .vars()
            .iter()
            .map(|(name, v)| (name.clone(), v.as_tensor().id()))
            .collect();
        self.segments.push(Segment::Held(i, held, names));
    }
}
