//! The [`Stateful`] trait every component with state implements.

use crate::dict::{StateDict, TensorSpec};
use crate::error::Result;
use crate::want::Want;
use std::collections::BTreeMap;

/// A component whose state a checkpoint saves and restores: model parameters, optimizer
/// shards, loss scaler, LR schedule, data loader position, RNG streams, monitors.
///
/// `state` copies the state out (the copy is what an async save writes while training goes
/// on); `load_state` takes it back. Components validate what they receive and return typed
/// errors, never panic.
pub trait Stateful {
    /// A copy of the current state.
    fn state(&self) -> Result<StateDict>;

    /// Replaces the current state.
    fn load_state(&mut self, state: StateDict) -> Result<()>;

    /// The tensors `load_state` expects (names, dtypes and shapes), used to check a
    /// checkpoint before loading it. The default copies the state to find out; large
    /// components override it with a cheap description.
    fn state_spec(&self) -> Result<BTreeMap<String, TensorSpec>> {
        Ok(self.state()?.spec())
    }

    /// Which slice of each saved global tensor this component needs when it loads a
    /// checkpoint written under another layout (another data-parallel degree, ZeRO stage or
    /// tensor-parallel degree), by tensor name. `None` (the default): every tensor as this
    /// rank saved it.
    fn state_wants(&self) -> Option<BTreeMap<String, Want>> {
        None
    }
}

/// A plain `StateDict` is itself stateful: `state` clones it and `load_state` replaces it.
impl Stateful for StateDict {
    fn state(&self) -> Result<StateDict> {
        Ok(self.clone())
    }

    fn load_state(&mut self, state: StateDict) -> Result<()> {
        *self = state;
        Ok(())
    }
}

/// The training step counter as a stateful component (metadata `step`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Step(pub u64);

impl Stateful for Step {
    fn state(&self) -> Result<StateDict> {
        let mut sd = StateDict::new();
        sd.set_meta("step", self.0)?;
        Ok(sd)
    }

    fn load_state(&mut self, state: StateDict) -> Result<()> {
        self.0 = state.meta("step")?;
        Ok(())
    }
}

/// The position of a counter-based random stream: the stream is a pure function of
/// `(seed, stream)`, and `counter` says how many blocks were drawn, so saving these three
/// numbers resumes the stream bitwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RngState {
    /// The run's seed.
    pub seed: u64,
    /// Which stream (purpose and rank folded in by the caller).
    pub stream: u64,
    /// Blocks drawn so far.
    pub counter: u64,
}

impl Stateful for RngState {
    fn state(&self) -> Result<StateDict> {
        let mut sd = StateDict::new();
        sd.set_meta("seed", self.seed)?;
        sd.set_meta("stream", self.stream)?;
        sd.set_meta("counter", self.counter)?;
        Ok(sd)
    }

    fn load_state(&mut self, state: StateDict) -> Result<()> {
        *self = RngState {
            seed: state.meta("seed")?,
            stream: state.meta("stream")?,
            counter: state.meta("counter")?,
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_and_rng_round_trip() {
        let r = RngState {
            seed: u64::MAX,
            stream: 3,
            counter: 1 << 60,
        };
        let mut back = RngState::default();
        back.load_state(r.state().unwrap()).unwrap();
        assert_eq!(back, r);
        let mut s = Step(0);
        s.load_state(Step(41).state().unwrap()).unwrap();
        assert_eq!(s, Step(41));
        assert!(s.load_state(StateDict::new()).is_err());
    }
}
