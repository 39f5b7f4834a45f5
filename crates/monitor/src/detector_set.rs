//! [`DetectorSet`]: the detectors run together, and their memory as a kiln-state component.

use crate::detect::{
    Detector, Metric, NonFiniteDetector, SpikeDetector, StragglerDetector, Verdict,
};
use crate::metrics::{ScalerEvent, StepMetrics};
use kiln_state::{StateDict, Stateful};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// What the detectors saw of one step: the record a restored [`DetectorSet`] replays so that
/// its rolling windows continue exactly. A value that a detector flagged as a spike is left
/// out (spikes never enter a window).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetectorInput {
    /// The step.
    pub step: u64,
    /// Its loss.
    pub loss: Option<f64>,
    /// Its gradient norm.
    pub grad_norm: Option<f64>,
    /// What the loss scaler did.
    pub scaler_event: Option<ScalerEvent>,
}

impl DetectorInput {
    /// The part of `m` the detectors learn from.
    pub fn of(m: &StepMetrics) -> Self {
        DetectorInput {
            step: m.step,
            loss: m.loss,
            grad_norm: m.grad_norm,
            scaler_event: m.scaler_event,
        }
    }

    /// Back to a step record.
    pub fn to_metrics(&self) -> StepMetrics {
        StepMetrics {
            step: self.step,
            loss: self.loss,
            grad_norm: self.grad_norm,
            scaler_event: self.scaler_event,
            ..StepMetrics::default()
        }
    }
}

/// The default number of recent records a set remembers for its state.
pub const DEFAULT_DETECTOR_HISTORY: usize = 256;

/// A list of detectors run together, remembering the recent records it saw (its
/// [`Stateful`] state: a restored set replays them into its detectors).
pub struct DetectorSet {
    detectors: Vec<Box<dyn Detector>>,
    log: VecDeque<DetectorInput>,
    history: usize,
}

impl DetectorSet {
    /// An empty set.
    pub fn new() -> Self {
        DetectorSet {
            detectors: Vec::new(),
            log: VecDeque::new(),
            history: DEFAULT_DETECTOR_HISTORY,
        }
    }

    /// Non-finite, loss spike, gradient-norm spike and straggler detectors with their defaults.
    pub fn standard() -> Self {
        Self::new()
            .with(NonFiniteDetector::default())
            .with(SpikeDetector::loss())
            .with(SpikeDetector::grad_norm())
            .with(StragglerDetector::default())
    }

    /// Remembers the last `records` records for its state (default
    /// [`DEFAULT_DETECTOR_HISTORY`]); at least the longest window of its detectors, so that a
    /// restored set rebuilds every window.
    pub fn with_history(mut self, records: usize) -> Self {
        self.history = records;
        self
    }

    /// Adds a detector.
    pub fn with(mut self, d: impl Detector + 'static) -> Self {
        self.detectors.push(Box::new(d));
        self
    }

    /// Adds a boxed detector.
    pub fn push(&mut self, d: Box<dyn Detector>) {
        self.detectors.push(d);
    }

    /// Runs every detector on a record and returns their verdicts in order. Every detector sees
    /// every record (a spike detector keeps learning even when another detector fired).
    pub fn observe(&mut self, m: &StepMetrics) -> Vec<Verdict> {
        let verdicts: Vec<Verdict> = self
            .detectors
            .iter_mut()
            .filter_map(|d| d.observe(m))
            .collect();
        let spike = |metric: Metric| {
            verdicts
                .iter()
                .any(|v| matches!(v, Verdict::Spike { metric: x, .. } if *x == metric))
        };
        let mut input = DetectorInput::of(m);
        if spike(Metric::Loss) {
            input.loss = None;
        }
        if spike(Metric::GradNorm) {
            input.grad_norm = None;
        }
        self.log.push_back(input);
        while self.log.len() > self.history {
            self.log.pop_front();
        }
        verdicts
    }

    /// Forwards [`Detector::rollback`] to every detector and forgets the records after
    /// `to_step`.
    pub fn rollback(&mut self, to_step: u64) {
        for d in &mut self.detectors {
            d.rollback(to_step);
        }
        self.log.retain(|i| i.step <= to_step);
    }

    /// The detectors' names.
    pub fn names(&self) -> Vec<&'static str> {
        self.detectors.iter().map(|d| d.name()).collect()
    }

    /// The records it remembers, oldest first.
    pub fn history(&self) -> impl Iterator<Item = &DetectorInput> {
        self.log.iter()
    }
}

impl std::fmt::Debug for DetectorSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DetectorSet")
            .field("detectors", &self.names())
            .field("history", &self.log.len())
            .finish()
    }
}

impl Default for DetectorSet {
    fn default() -> Self {
        Self::new()
    }
}

/// The detectors' memory: the recent records (metadata `inputs`). Loading forgets what the
/// detectors saw and replays the records, so a set restored into fresh detectors of the same
/// configuration judges the next steps as the saved one would have.
impl Stateful for DetectorSet {
    fn state(&self) -> kiln_state::Result<StateDict> {
        let mut sd = StateDict::new();
        sd.set_meta("inputs", self.log.iter().collect::<Vec<_>>())?;
        Ok(sd)
    }

    fn load_state(&mut self, state: StateDict) -> kiln_state::Result<()> {
        let inputs: Vec<DetectorInput> = state.meta("inputs")?;
        self.rollback(0);
        self.log.clear();
        for i in &inputs {
            self.observe(&i.to_metrics());
        }
        Ok(())
    }
}
