//! `kiln plan-pipeline`: a pipeline schedule of kiln-parallel (GPipe, 1F1B, interleaved 1F1B,
//! ZB-H1) for pp stages and m micro-batches, checked and simulated with the given costs: each
//! rank's timeline, the bubble fraction against theory, the activations each rank holds, and
//! the timeline as a PNG.

use kiln_monitor::{Gantt, GanttLane, GanttSpan};
use kiln_parallel::pipeline::{
    theoretical_bubble_with, ComputeKind, Costs, PipelineSpec, Schedule, ScheduleKind, Timeline,
};
use std::fmt::Write;
use std::path::PathBuf;

/// The colours of the PNG: forward, backward (whole or input gradient), weight gradient.
const FORWARD: (u8, u8, u8) = (31, 119, 180);
const BACKWARD: (u8, u8, u8) = (44, 160, 44);
const WEIGHT: (u8, u8, u8) = (255, 127, 14);

/// `kiln plan-pipeline`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Example:\n  kiln plan-pipeline --pp 4 --micro-batches 8 --schedule interleaved --virtual-stages 2 --png pipeline.png"
)]
pub struct PlanPipelineArgs {
    /// Pipeline stages (ranks)
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub pp: usize,
    /// Micro-batches per step
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub micro_batches: usize,
    /// The schedule: gpipe, 1f1b, interleaved or zb_h1
    #[arg(long, value_name = "NAME", default_value = "1f1b")]
    pub schedule: ScheduleKind,
    /// Model chunks per rank (interleaved only; 2 when interleaved and not given)
    #[arg(long, value_name = "V")]
    pub virtual_stages: Option<usize>,
    /// Time of one forward (of one chunk)
    #[arg(long, value_name = "T", default_value_t = 1.0)]
    pub forward_cost: f64,
    /// Time of one whole backward: input and weight gradient
    #[arg(long, value_name = "T", default_value_t = 2.0)]
    pub backward_cost: f64,
    /// The weight-gradient part of the backward (zero-bubble splits it off); half of it when
    /// not given
    #[arg(long, value_name = "T")]
    pub weight_cost: Option<f64>,
    /// Time of one send
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub p2p_cost: f64,
    /// Draw the timeline into this PNG
    #[arg(long, value_name = "FILE")]
    pub png: Option<PathBuf>,
}

impl PlanPipelineArgs {
    /// The pipeline's shape from the flags.
    pub fn spec(&self) -> PipelineSpec {
        let default_v = if self.schedule == ScheduleKind::Interleaved {
            2
        } else {
            1
        };
        PipelineSpec {
            stages: self.pp,
            virtual_stages: self.virtual_stages.unwrap_or(default_v),
            micro_batches: self.micro_batches,
        }
    }

    /// The costs from the flags: the backward's input gradient is what the weight gradient
    /// leaves of it.
    pub fn costs(&self) -> anyhow::Result<Costs> {
        let weight = self.weight_cost.unwrap_or(self.backward_cost / 2.0);
        anyhow::ensure!(
            weight <= self.backward_cost,
            "--weight-cost {weight} is more than --backward-cost {}: the weight gradient is part of the backward",
            self.backward_cost
        );
        let costs = Costs {
            forward: self.forward_cost,
            backward_input: self.backward_cost - weight,
            backward_weight: weight,
            p2p: self.p2p_cost,
        };
        costs.validate()?;
        Ok(costs)
    }

    /// The checked schedule and its simulated timeline.
    pub fn simulate(&self) -> anyhow::Result<(Schedule, Timeline)> {
        let schedule = Schedule::build(self.schedule, self.spec())?;
        let timeline = schedule.simulate(&self.costs()?)?;
        Ok((schedule, timeline))
    }

    /// What the command prints: the shape, each rank's timeline, the bubble against theory and
    /// the peak activations in flight per rank.
    pub fn report(&self, timeline: &Timeline) -> anyhow::Result<String> {
        let spec = timeline.spec;
        let costs = self.costs()?;
        let mut out = String::new();
        writeln!(
            out,
            "{} schedule: pp={} micro-batches={} virtual-stages={}; costs F={} B={} (input {} + weight {}) p2p={}",
            self.schedule,
            spec.stages,
            spec.micro_batches,
            spec.virtual_stages,
            costs.forward,
            costs.backward_input + costs.backward_weight,
            costs.backward_input,
            costs.backward_weight,
            costs.p2p
        )?;
        out.push_str(&timeline.render_text());
        let theory = theoretical_bubble_with(self.schedule, spec, &costs);
        writeln!(
            out,
            "makespan {}; bubble fraction {:.4} (theory {:.4})",
            timeline.makespan, timeline.bubble_fraction, theory
        )?;
        let peaks: Vec<String> = timeline
            .peak_in_flight
            .iter()
            .enumerate()
            .map(|(r, p)| format!("rank {r}: {p}"))
            .collect();
        writeln!(
            out,
            "peak micro-batches in flight{}: {}",
            if spec.virtual_stages > 1 {
                " (model chunks)"
            } else {
                ""
            },
            peaks.join(", ")
        )?;
        Ok(out)
    }

    /// The timeline as a Gantt chart: one lane per rank, forwards, backwards and weight
    /// gradients in their colours, the bubble fraction in the title.
    pub fn gantt(&self, timeline: &Timeline) -> Gantt {
        let spec = timeline.spec;
        let lanes = (0..timeline.spans.len())
            .map(|rank| GanttLane {
                name: format!("rank {rank}"),
                spans: timeline
                    .compute_spans(rank)
                    .map(|s| GanttSpan {
                        start: s.start,
                        end: s.end,
                        label: s.action.label(spec.virtual_stages),
                        color: match s.action.compute() {
                            Some(ComputeKind::Forward) => FORWARD,
                            Some(ComputeKind::BackwardWeight) => WEIGHT,
                            _ => BACKWARD,
                        },
                    })
                    .collect(),
            })
            .collect();
        let mut legend = vec![
            ("forward".to_string(), FORWARD),
            ("backward".to_string(), BACKWARD),
        ];
        if timeline
            .spans
            .iter()
            .flatten()
            .any(|s| s.action.compute() == Some(ComputeKind::BackwardWeight))
        {
            legend[1].0 = "backward (input gradient)".into();
            legend.push(("weight gradient".to_string(), WEIGHT));
        }
        Gantt {
            title: format!(
                "{} pp={} m={}{}: bubble {:.1}%",
                self.schedule,
                spec.stages,
                spec.micro_batches,
                if spec.virtual_stages > 1 {
                    format!(" v={}", spec.virtual_stages)
                } else {
                    String::new()
                },
                100.0 * timeline.bubble_fraction
            ),
            x_label: "time".into(),
            lanes,
            legend,
        }
    }

    /// Prints the report and writes the PNG.
    pub fn run(&self) -> anyhow::Result<()> {
        let (_, timeline) = self.simulate()?;
        print!("{}", self.report(&timeline)?);
        if let Some(png) = &self.png {
            self.gantt(&timeline).write_png(png, png_size(&timeline))?;
            println!("timeline written to {}", png.display());
        }
        Ok(())
    }
}

/// The PNG's size in pixels: 40 per unit of time (at least 1600, at most 8000 wide), 70 per
/// rank under a 140-pixel head.
pub fn png_size(timeline: &Timeline) -> (u32, u32) {
    let width = (40.0 * timeline.makespan).clamp(1600.0, 8000.0) as u32;
    let height = 140 + 70 * timeline.spans.len() as u32;
    (width, height)
}
