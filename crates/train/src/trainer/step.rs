//! One training step: batch, backward, judgement by the detectors and the breaker, update or
//! not, and the step's record.

use crate::data::{decode_sample_id, encode_sample_id, micro_batches};
use crate::error::Result;
use crate::model::TrainModel;
use kiln_comm::{CommExt, Communicator};
use kiln_data::Batch;
use kiln_monitor::{
    Action, BatchInfo, CircuitBreaker, Decision, DetectorSet, Event, EventKind, RankStats,
    RankSummary, ScalerEvent, StepMetrics,
};
use kiln_optim::LrSchedule;
use kiln_precision::ScaleEvent;
use std::time::Instant;

use super::Trainer;

/// The breaker's view of a step's outcome.
pub(super) fn scaler_event(e: ScaleEvent) -> ScalerEvent {
    match e {
        ScaleEvent::Grew => ScalerEvent::Grew,
        ScaleEvent::Skipped => ScalerEvent::Skipped,
        ScaleEvent::BackedOff => ScalerEvent::BackedOff,
        _ => ScalerEvent::Stepped,
    }
}

/// Everything the detectors and the breaker look at for one step, the same on every rank.
pub(super) struct Observation<'a> {
    step: u64,
    loss: f32,
    grad_norm: Option<f64>,
    lr: f32,
    loss_scale: f32,
    event: ScaleEvent,
    elapsed_s: f64,
    ids: &'a [u64],
    last_ckpt: Option<u64>,
}

/// Runs the detectors on an observation (after gathering every rank's elapsed time, for the
/// straggler detector) and asks the breaker what to do. Collective over `world`.
pub(super) fn observe(
    world: &dyn Communicator,
    detectors: &mut DetectorSet,
    breaker: &mut CircuitBreaker,
    o: &Observation<'_>,
) -> Result<Decision> {
    let summary = RankSummary::gather(
        world,
        &RankStats {
            loss: o.loss as f64,
            step_time_s: o.elapsed_s,
            tokens: 0,
            samples: 0,
        },
    )?;
    let mut m = StepMetrics::new(o.step);
    summary.apply(&mut m);
    m.tokens_per_s = None;
    m.samples_per_s = None;
    m.loss = Some(o.loss as f64);
    m.grad_norm = o.grad_norm;
    m.lr = Some(o.lr as f64);
    m.loss_scale = Some(o.loss_scale as f64);
    m.scaler_event = Some(scaler_event(o.event));
    let verdicts = detectors.observe(&m);
    Ok(breaker.decide(
        o.step,
        &verdicts,
        &BatchInfo {
            sample_ids: o.ids,
            last_checkpoint_step: o.last_ckpt,
        },
    ))
}

impl<M: TrainModel> Trainer<M> {
    /// The ids of the global batch (every data-parallel rank's samples, in rank order).
    pub(super) fn global_sample_ids(&self, batch: &Batch) -> Result<Vec<u64>> {
        let local: Vec<i64> = batch
            .sample_ids
            .iter()
            .map(|&id| encode_sample_id(id) as i64)
            .collect();
        let mut all = vec![0i64; local.len() * self.dp.world_size()];
        self.dp.all_gather(&local, &mut all)?;
        Ok(all.into_iter().map(|v| v as u64).collect())
    }

    /// Runs one training step (collective): the next batch, forward and backward with
    /// gradient reduction, the detectors and the breaker (whose verdict may skip the update or
    /// roll back to a checkpoint), the learning rate from the schedule at the optimizer step,
    /// evaluation and checkpoint when due, and the step record to every sink. Returns the
    /// record.
    pub fn train_step(&mut self) -> Result<StepMetrics> {
        let step = self.progress.step + 1;
        let total = self.cfg.train.steps;
        let t0 = Instant::now();
        // the mixture schedule: this step's weights (a no-op when they are in effect already)
        let mut events = Vec::new();
        if self.cfg.data.mixture.apply(&mut self.loader, step)? {
            events.push(Event::new(
                EventKind::Info,
                step,
                format!(
                    "mixture weights from step {step}: {:?}",
                    self.loader.weights()
                ),
            ));
        }
        let batch = self.loader.next_batch()?;
        let data_wait = t0.elapsed().as_secs_f64();
        let ids = self.global_sample_ids(&batch)?;
        if self.progress.source_samples.len() < self.source_names.len() {
            self.progress
                .source_samples
                .resize(self.source_names.len(), 0);
        }
        for &id in &ids {
            if let Some(c) = self
                .progress
                .source_samples
                .get_mut(decode_sample_id(id).source as usize)
            {
                *c += 1;
            }
        }
        let drift = match self.drift.as_mut() {
            Some(monitor) => {
                let mut tokens = vec![0u32; batch.inputs.len() * self.dp.world_size()];
                self.dp.all_gather(&batch.inputs, &mut tokens)?;
                let was = monitor.alerting();
                let r = monitor.observe(&tokens)?;
                if r.alert && !was {
                    self.drift_alerts += 1;
                    events.push(Event::new(
                        EventKind::Alert,
                        step,
                        format!(
                            "data drift: KL of the last {} batches from the reference is {:.4} \
                             nats, above {:.4}",
                            monitor.window_len(),
                            r.kl,
                            monitor.threshold()
                        ),
                    ));
                }
                Some(r.kl)
            }
            None => None,
        };
        let micro = micro_batches(&batch, self.cfg.train.accumulation, self.engine.device())?;
        let lr_factor = self.breaker.as_ref().map_or(1.0, |b| b.lr_factor(step));
        let lr = (self.schedule.lr(self.progress.optimizer_steps) as f64 * lr_factor) as f32;
        // one rank per data-parallel replica counts the batch: tp rank 0 of the first stage
        let tp_lead =
            self.dims.tp_rank(self.world.rank()) == 0 && self.dims.pp_rank(self.world.rank()) == 0;
        let (tokens, samples) = if tp_lead {
            (batch.num_tokens() as u64, batch.batch_size as u64)
        } else {
            (0, 0)
        };

        let last_ckpt = self.last_ckpt;
        // the open engine: backward, let the detectors and the breaker judge the step, then
        // apply or discard its update
        let preview = match &self.stage_plan {
            Some(sp) => self.engine.pipeline_step(
                &self.model,
                &sp.schedule,
                &sp.chunks,
                &micro,
                &mut *self.scaler,
            )?,
            None => self
                .engine
                .backward(&self.model, &micro, &mut *self.scaler)?,
        };
        let decision = match (self.detectors.as_mut(), self.breaker.as_mut()) {
            (Some(d), Some(b)) => {
                let o = Observation {
                    step,
                    loss: preview.loss,
                    grad_norm: preview.grad_norm,
                    lr,
                    loss_scale: preview.loss_scale,
                    event: preview.scale_event,
                    elapsed_s: t0.elapsed().as_secs_f64(),
                    ids: &ids,
                    last_ckpt,
                };
                match observe(&*self.world, d, b, &o) {
                    Ok(dec) => Some(dec),
                    Err(e) => {
                        self.engine.discard()?;
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        let apply =
            !preview.found_inf && decision.as_ref().is_none_or(|d| d.action.applies_update());
        let (report, applied) = if apply {
            let every = self.cfg.metrics.update_norms_every;
            self.engine
                .set_update_norms(every > 0 && step.is_multiple_of(every));
            (self.engine.apply(lr)?, true)
        } else {
            (self.engine.discard()?, false)
        };

        // the record
        let step_time = t0.elapsed().as_secs_f64();
        let summary = RankSummary::gather(
            &*self.world,
            &RankStats {
                loss: report.loss as f64,
                step_time_s: step_time,
                tokens,
                samples,
            },
        )?;
        let mut m = StepMetrics::new(step);
        summary.apply(&mut m);
        if let Some(mfu) = &self.mfu {
            m.set_mfu(mfu);
        }
        m.loss = Some(report.loss as f64);
        m.epoch = batch.epochs.iter().copied().max();
        m.grad_norm = report.grad_norm;
        m.grad_norm_clipped = match (report.grad_norm, self.cfg.optim.clip()) {
            (Some(n), Some(c)) if report.clipped => Some(n.min(c as f64)),
            (n, _) => n,
        };
        m.lr = Some(lr as f64);
        m.loss_scale = Some(report.loss_scale as f64);
        m.scaler_event = Some(scaler_event(report.scale_event));
        m.data_wait_s = Some(data_wait);
        m.comm_s = Some(report.comm_wait_s);
        m.optimizer_s = Some(report.optim_s);
        m.extra.insert("compute_s".into(), report.compute_s);
        m.extra.insert("forward_s".into(), report.forward_s);
        m.param_norm = report.param_norm;
        m.update_param_ratio = report.update_ratio;
        m.set_memory();

        self.progress.step = step;
        self.progress.tokens_seen += summary.tokens;
        self.progress.samples_seen += summary.samples;
        self.run_tokens += summary.tokens;
        if applied {
            self.progress.optimizer_steps += 1;
        } else {
            self.progress.skipped_steps += 1;
        }
        m.skipped_steps = Some(self.progress.skipped_steps);
        m.tokens_seen = Some(self.progress.tokens_seen);
        m.samples_seen = Some(self.progress.samples_seen);
        self.losses.push((step, report.loss));

        if let Some(kl) = drift {
            m.extra.insert("drift_kl".into(), kl);
        }
        let seen: u64 = self.progress.source_samples.iter().sum();
        if self.source_names.len() > 1 && seen > 0 {
            for (name, &n) in self.source_names.iter().zip(&self.progress.source_samples) {
                m.extra
                    .insert(format!("mix/{name}"), n as f64 / seen as f64);
            }
        }
        let action = match decision {
            Some(d) => {
                events.extend(d.events);
                d.action
            }
            None => Action::Continue,
        };
        match action {
            Action::Halt(reason) => {
                self.finish_record(&m, &events)?;
                self.close_sinks()?;
                return Err(kiln_monitor::MonitorError::Halted(Box::new(reason)).into());
            }
            Action::Rollback {
                to_step,
                skip_samples,
            } => {
                self.finish_record(&m, &events)?;
                self.rollback(step, to_step, skip_samples)?;
                return Ok(m);
            }
            _ => {}
        }

        let eval_due = (self.cfg.eval.every > 0 && step % self.cfg.eval.every == 0)
            || (step == total && self.cfg.eval.at_end);
        if eval_due {
            if let Some(v) = self.evaluate()? {
                m.extra.insert("val_loss".into(), v);
                self.val_losses.push((step, v));
            }
        }
        if let Some(c) = &self.ckpt {
            let due = self.cfg.checkpoint.enabled()
                && (c.should_save(&*self.world, step)?
                    || (step == total && self.cfg.checkpoint.save_final));
            if due {
                let secs = self.save_checkpoint()?;
                m.ckpt_time_s = Some(secs);
                events.push(Event::new(
                    EventKind::Info,
                    step,
                    format!(
                        "checkpoint of step {step} {} in {:.3} s",
                        if self.cfg.checkpoint.async_save {
                            "staged"
                        } else {
                            "saved"
                        },
                        secs
                    ),
                ));
            }
        }
        self.finish_record(&m, &events)?;
        Ok(m)
    }
}
