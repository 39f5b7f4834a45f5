//! Pipeline schedules as data: per rank, the list of forwards, backwards (whole, or split into
//! the input and the weight gradient) and point-to-point sends and receives of one step.
//!
//! - [`Schedule::build`] generates GPipe, 1F1B (PipeDream-Flush), Megatron-LM's interleaved
//!   1F1B and the zero-bubble ZB-H1 for a [`PipelineSpec`] (pp stages, v virtual stages,
//!   m micro-batches).
//! - [`Schedule::check`] proves a schedule runnable: every send has its receive, in the same
//!   order per pair of ranks (a receive takes the next message from its peer), every
//!   micro-batch runs forward and backward once on every stage in dependency order, forwards
//!   and weight gradients ascend by micro-batch on each chunk (so the gradients accumulate in
//!   the order of one rank), and a simulation finds no deadlock.
//! - [`Schedule::simulate`] runs the lists with [`Costs`]: a [`Timeline`] with its bubble
//!   fraction and the activations each rank holds, against [`theoretical_bubble`].
//!
//! ```
//! use kiln_parallel::pipeline::{theoretical_bubble, Costs, PipelineSpec, Schedule, ScheduleKind};
//! let spec = PipelineSpec { stages: 4, virtual_stages: 1, micro_batches: 8 };
//! let schedule = Schedule::build(ScheduleKind::OneFOneB, spec)?;
//! let timeline = schedule.simulate(&Costs::default())?;
//! // 1F1B idles (p - 1) (F + B) of each rank's (m + p - 1) (F + B)
//! assert!((timeline.bubble_fraction - 3.0 / 11.0).abs() < 1e-12);
//! assert!((timeline.bubble_fraction - theoretical_bubble(ScheduleKind::OneFOneB, spec)).abs() < 1e-12);
//! assert_eq!(timeline.peak_in_flight, vec![4, 3, 2, 1]);
//! # Ok::<(), kiln_parallel::pipeline::ScheduleError>(())
//! ```

mod action;
mod build;
mod check;
mod error;
mod simulate;

pub use action::{Action, ComputeKind, PipelineSpec, ScheduleKind};
pub use error::{Blocked, ScheduleError};
pub use simulate::{
    peak_in_flight, theoretical_bubble, theoretical_bubble_with, Costs, Span, Timeline,
};

/// A schedule: per pipeline rank, its actions in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Which schedule generated it.
    pub kind: ScheduleKind,
    /// The pipeline's shape.
    pub spec: PipelineSpec,
    /// Per rank, its actions in the order it runs them.
    pub ranks: Vec<Vec<Action>>,
}

impl Schedule {
    /// Generates `kind` for `spec` (after [`PipelineSpec::validate`]), checked.
    pub fn build(kind: ScheduleKind, spec: PipelineSpec) -> Result<Schedule, ScheduleError> {
        spec.validate(kind)?;
        let compute = build::compute_orders(kind, &spec);
        let ranks = build::wire(&spec, &compute)?;
        let schedule = Schedule { kind, spec, ranks };
        schedule.check()?;
        Ok(schedule)
    }

    /// Checks the rules every schedule holds (see the module documentation) and simulates it
    /// with unit costs to find any deadlock.
    pub fn check(&self) -> Result<(), ScheduleError> {
        self.check_static()?;
        self.run(&Costs::default()).map(|_| ())
    }
}

impl From<ScheduleError> for crate::ParallelError {
    fn from(e: ScheduleError) -> Self {
        crate::ParallelError::Config(e.to_string())
    }
}
