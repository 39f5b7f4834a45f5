//! The trainer's sinks: the run header, step records and events, closing.

use crate::error::{Result, TrainError};
use crate::model::TrainModel;
use kiln_comm::Communicator;
use kiln_monitor::{
    ConsoleSink, Event, EventKind, JsonlSink, MetricSink, PlotSink, StepMetrics, TensorBoardSink,
};

use super::Trainer;

impl<M: TrainModel> Trainer<M> {
    pub(super) fn header(&self) -> Event {
        let c = &self.cfg;
        let params: usize = self.engine.layout().params().iter().map(|p| p.numel).sum();
        Event::new(
            EventKind::Info,
            self.progress.step,
            format!(
                "{}: model {} ({:.2}M parameters per {}), dp={} tp={}{} zero={}, {}, \
                 micro-batch {} x {} accumulation x seq {}, {} steps",
                c.name,
                c.model.preset,
                params as f64 / 1e6,
                if c.parallel.pp > 1 {
                    "stage and tp rank on rank 0"
                } else {
                    "tp rank"
                },
                c.parallel.dp,
                c.parallel.tp,
                if c.parallel.pp > 1 {
                    format!(
                        " pp={} ({}, {} chunk(s) per rank)",
                        c.parallel.pp, c.parallel.pp_schedule, c.parallel.virtual_stages
                    )
                } else {
                    String::new()
                },
                c.parallel.zero.number(),
                c.precision.compute,
                c.train.micro_batch,
                c.train.accumulation,
                c.train.seq_len,
                c.train.steps
            ),
        )
    }

    pub(super) fn open_sinks(
        &mut self,
        defaults: bool,
        extra: Vec<Box<dyn MetricSink>>,
    ) -> Result<()> {
        let m = &self.cfg.metrics;
        let dir = self.cfg.output_dir.clone();
        let mk = |op: &'static str| {
            let dir = dir.clone();
            move |e| TrainError::File {
                op,
                path: dir.clone(),
                source: e,
            }
        };
        if defaults && (m.jsonl || m.tensorboard || m.png) {
            std::fs::create_dir_all(&dir).map_err(mk("create directory"))?;
        }
        if defaults && m.jsonl {
            let path = dir.join("metrics.jsonl");
            let sink = if self.resumed_from.is_some() && path.exists() {
                JsonlSink::append(&path)?
            } else {
                JsonlSink::create(&path)?
            };
            self.sinks.push(Box::new(sink));
            self.outputs.jsonl = Some(path);
        }
        if defaults && m.tensorboard {
            let tb = dir.join("tb");
            self.sinks.push(Box::new(TensorBoardSink::create(&tb)?));
            self.outputs.tensorboard = Some(tb);
        }
        if defaults && m.png {
            let png = dir.join("loss.png");
            self.sinks.push(Box::new(PlotSink::new(&png)));
            self.outputs.png = Some(png);
        }
        if defaults && m.console {
            self.sinks.push(Box::new(ConsoleSink::new(
                Some(self.cfg.train.steps),
                m.console_every,
            )));
        }
        for s in extra {
            self.sinks.push(s);
        }
        Ok(())
    }

    pub(super) fn emit_events(&mut self, events: &[Event]) -> Result<()> {
        if self.world.rank() == 0 && !events.is_empty() {
            self.sinks.events(events)?;
        }
        Ok(())
    }

    pub(super) fn finish_record(&mut self, m: &StepMetrics, events: &[Event]) -> Result<()> {
        if self.world.rank() == 0 {
            self.sinks.record(m)?;
            if !events.is_empty() {
                self.sinks.events(events)?;
            }
        }
        if let Some(f) = self.on_step.as_mut() {
            f(m);
        }
        if let Some(w) = &self.watchdog {
            w.heartbeat(m.step);
            w.check()?;
        }
        self.last_metrics = Some(m.clone());
        Ok(())
    }

    pub(super) fn close_sinks(&mut self) -> Result<()> {
        if self.world.rank() == 0 {
            self.sinks.flush()?;
            self.sinks.close()?;
        }
        Ok(())
    }
}
