//! [`RunConfig::validate`]: every field checked, errors naming the field.

use super::RunConfig;
use crate::error::{Result, TrainError};
use kiln_parallel::pipeline::{PipelineSpec, ScheduleKind};
use kiln_parallel::{stage_segments, ParallelDims, StageSplit, ZeroStage};
use kiln_precision::ComputeDType;

impl RunConfig {
    /// Checks the whole configuration; the error names the field (`RunConfig.parallel.dp`) and
    /// the values that conflict.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, reason: String| {
            Err(TrainError::config(format!("RunConfig.{field}"), reason))
        };
        let model = self.gpt_config()?;
        model
            .validate()
            .map_err(|e| TrainError::config("RunConfig.model", e.to_string()))?;
        if let Some(lora) = &self.model.lora {
            lora.validate()
                .map_err(|e| TrainError::config("RunConfig.model.lora", e.to_string()))?;
        }
        if self.device.is_cuda() && !cfg!(feature = "cuda") {
            return bad(
                "device",
                format!(
                    "{} needs a build with the cuda feature (cargo build --features cuda; \
                     see docs/gpu.md)",
                    self.device
                ),
            );
        }
        let p = &self.parallel;
        let shape = model.shape();
        ParallelDims::with_pipeline(p.dp, p.tp, p.pp, p.world(), &shape).map_err(|e| {
            let pp = if p.pp == 1 {
                String::new()
            } else {
                format!(" x pp ({})", p.pp)
            };
            TrainError::config(
                "RunConfig.parallel",
                format!("dp ({}) x tp ({}){pp}: {e}", p.dp, p.tp),
            )
        })?;
        self.validate_pipeline(&shape)?;
        if !p.backend.is_built() {
            return bad(
                "parallel.backend",
                format!(
                    "{} is not built in: build with --features mpi (Open MPI needed: apt-get \
                     install openmpi-bin libopenmpi-dev libclang-dev)",
                    p.backend
                ),
            );
        }
        if !(p.bucket_mb.is_finite() && p.bucket_mb > 0.0) {
            return bad(
                "parallel.bucket_mb",
                format!("must be > 0, got {}", p.bucket_mb),
            );
        }
        if p.sequence_parallel && p.tp > 1 {
            for (field, len) in [
                ("train.seq_len", self.train.seq_len),
                ("model n_ctx", model.n_ctx),
            ] {
                if len % p.tp != 0 {
                    return bad(
                        "parallel.sequence_parallel",
                        format!(
                            "{field} ({len}) must be a multiple of parallel.tp ({}) to split \
                             the token rows",
                            p.tp
                        ),
                    );
                }
            }
            if self.model.lora.is_some() {
                return bad(
                    "parallel.sequence_parallel",
                    "LoRA adapters take every token row: turn off sequence_parallel or \
                     model.lora"
                        .into(),
                );
            }
        }
        let t = &self.train;
        if t.steps == 0 {
            return bad("train.steps", "must be at least 1, got 0".into());
        }
        if t.micro_batch == 0 {
            return bad("train.micro_batch", "must be at least 1, got 0".into());
        }
        if t.accumulation == 0 {
            return bad("train.accumulation", "must be at least 1, got 0".into());
        }
        if t.seq_len == 0 || t.seq_len > model.n_ctx {
            return bad(
                "train.seq_len",
                format!(
                    "must be in 1..={} (the model's n_ctx), got {}",
                    model.n_ctx, t.seq_len
                ),
            );
        }
        let o = &self.optim;
        let sch = &o.schedule;
        if !(sch.lr.is_finite() && sch.lr > 0.0) {
            return bad(
                "optim.schedule.lr",
                format!("must be finite and > 0, got {}", sch.lr),
            );
        }
        if !(sch.min_lr.is_finite() && sch.min_lr >= 0.0 && sch.min_lr <= sch.lr) {
            return bad(
                "optim.schedule.min_lr",
                format!(
                    "must be in [0, optim.schedule.lr ({})], got {}",
                    sch.lr, sch.min_lr
                ),
            );
        }
        // a warmup longer than the run is capped at it (see `short_run_notes`)
        if !(o.max_grad_norm.is_finite() && o.max_grad_norm >= 0.0) {
            return bad(
                "optim.max_grad_norm",
                format!("must be finite and >= 0 (0: off), got {}", o.max_grad_norm),
            );
        }
        o.optimizer
            .validate()
            .map_err(|e| TrainError::config("RunConfig.optim.optimizer", e.to_string()))?;
        o.schedule(t.steps)?;
        if self.precision.compute == ComputeDType::F16 {
            self.precision
                .scaler
                .validate()
                .map_err(|e| TrainError::config("RunConfig.precision.scaler", e.to_string()))?;
        }
        let c = &self.checkpoint;
        if !(c.every_minutes.is_finite() && c.every_minutes >= 0.0) {
            return bad(
                "checkpoint.every_minutes",
                format!("must be finite and >= 0, got {}", c.every_minutes),
            );
        }
        if self.eval.batches == 0 && (self.eval.every > 0 || self.eval.at_end) {
            return bad(
                "eval.batches",
                "must be at least 1 when evaluation is on (eval.every > 0 or eval.at_end)".into(),
            );
        }
        let d = &self.data;
        if d.corpora.is_empty() {
            return bad("data.corpora", "names no corpus".into());
        }
        if !(0.0..1.0).contains(&d.val_fraction) {
            return bad(
                "data.val_fraction",
                format!("must be in [0, 1), got {}", d.val_fraction),
            );
        }
        if d.prefetch == 0 {
            return bad("data.prefetch", "must be at least 1, got 0".into());
        }
        if !(d.stall_timeout_s.is_finite() && d.stall_timeout_s > 0.0) {
            return bad(
                "data.stall_timeout_s",
                format!("must be finite and > 0, got {}", d.stall_timeout_s),
            );
        }
        if d.cache_chunk_tokens == 0 {
            return bad(
                "data.cache_chunk_tokens",
                "must be at least 1, got 0".into(),
            );
        }
        for (i, w) in d.skip.iter().enumerate() {
            if w.end <= w.start {
                return bad(
                    &format!("data.skip[{i}]"),
                    format!("end ({}) must be past start ({})", w.end, w.start),
                );
            }
        }
        if let Some(q) = &d.quality {
            q.validate()
                .map_err(|e| TrainError::config("RunConfig.data.quality", e.to_string()))?;
        }
        if !d.mixture.is_empty() {
            if d.corpora.len() < 2 {
                return bad(
                    "data.mixture",
                    format!(
                        "a mixture schedule needs several corpora, data.corpora names {} \
                         (clear the schedule: data.mixture = [] (--data.mixture '[]'))",
                        d.corpora.len()
                    ),
                );
            }
            d.mixture.validate(d.corpora.len()).map_err(|e| {
                TrainError::config(
                    "RunConfig.data.mixture",
                    format!(
                        "{e} (data.corpora names {}; give data.mixture one weight per corpus \
                             (--data.mixture '[{{\"step\": 1, \"weights\": [...]}}]') or \
                             clear it: data.mixture = [] (--data.mixture '[]'))",
                        d.corpora.len()
                    ),
                )
            })?;
        }
        let dr = &d.drift;
        if dr.enabled {
            if dr.window == 0 {
                return bad("data.drift.window", "must be at least 1, got 0".into());
            }
            if !(dr.alpha.is_finite() && dr.alpha > 0.0) {
                return bad(
                    "data.drift.alpha",
                    format!("must be finite and > 0, got {}", dr.alpha),
                );
            }
            if !(dr.threshold.is_finite() && dr.threshold >= 0.0) {
                return bad(
                    "data.drift.threshold",
                    format!(
                        "must be finite and >= 0 (0: calibrate), got {}",
                        dr.threshold
                    ),
                );
            }
            if !(dr.calibrate_margin.is_finite() && dr.calibrate_margin > 0.0) {
                return bad(
                    "data.drift.calibrate_margin",
                    format!("must be finite and > 0, got {}", dr.calibrate_margin),
                );
            }
            if dr.reference_tokens == 0 {
                return bad(
                    "data.drift.reference_tokens",
                    "must be at least 1, got 0".into(),
                );
            }
        }
        if let Some(db) = &t.dynamic_batch {
            if !(db.budget_mib.is_finite() && db.budget_mib >= 0.0) {
                return bad(
                    "train.dynamic_batch.budget_mib",
                    format!(
                        "must be finite and >= 0 (0: available memory), got {}",
                        db.budget_mib
                    ),
                );
            }
        }
        if let Some(peak) = self.metrics.peak_flops_per_s {
            if !(peak.is_finite() && peak > 0.0) {
                return bad(
                    "metrics.peak_flops_per_s",
                    format!("must be finite and > 0 (or left out: the device's), got {peak}"),
                );
            }
        }
        let m = &self.monitor;
        if !(m.watchdog_s.is_finite() && m.watchdog_s >= 0.0) {
            return bad(
                "monitor.watchdog_s",
                format!("must be finite and >= 0 (0: off), got {}", m.watchdog_s),
            );
        }
        if m.detectors {
            m.detector_set()?;
            kiln_monitor::CircuitBreaker::new(m.breaker)
                .map_err(|e| TrainError::config("RunConfig.monitor.breaker", e.to_string()))?;
        }
        Ok(())
    }

    /// The step counts a run shorter than them shortens, one line each, for the trainer to
    /// say once at the start (empty when none is). A warmup longer than the run
    /// (`optim.schedule.warmup_steps > train.steps`) warms up over the whole run and never
    /// decays, as torchtitan and Hugging Face's schedules do (torchtitan caps it with a
    /// warning): the schedule caps it, the configuration keeps the value given, so the
    /// trajectory hash and a longer resumed run see the same setting. Evaluation,
    /// checkpoint, mixture and logging intervals past the last step need nothing: they are
    /// not reached, and the end-of-run evaluation and final checkpoint still happen.
    ///
    /// ```
    /// use kiln_train::RunConfig;
    /// let cfg = RunConfig::from_args("train_gpt", ["--steps", "3"].map(String::from))?;
    /// cfg.validate()?;
    /// assert_eq!(
    ///     cfg.short_run_notes(),
    ///     ["optim.schedule.warmup_steps 20 is longer than the run's 3 steps: warming up over all 3"]
    /// );
    /// assert!(RunConfig::preset("train_gpt")?.short_run_notes().is_empty());
    /// # Ok::<(), kiln_train::TrainError>(())
    /// ```
    pub fn short_run_notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let (warmup, steps) = (self.optim.schedule.warmup_steps, self.train.steps);
        if warmup > steps {
            notes.push(format!(
                "optim.schedule.warmup_steps {warmup} is longer than the run's {steps} steps: \
                 warming up over all {steps}"
            ));
        }
        notes
    }
}

impl RunConfig {
    /// The pipeline settings: the schedule can run `pp` stages with `virtual_stages` chunks
    /// and `train.accumulation` micro-batches, the blocks give every stage one, and the stage
    /// runs a ZeRO stage it supports. Errors name the factor and the rule.
    fn validate_pipeline(&self, shape: &kiln_memory::ModelShape) -> Result<()> {
        let p = &self.parallel;
        let bad = |field: &str, why: String| Err(TrainError::config(field, why));
        if p.virtual_stages == 0 {
            return bad(
                "parallel.virtual_stages",
                "must be at least 1, got 0".into(),
            );
        }
        if p.pp <= 1 {
            if p.virtual_stages > 1 {
                return bad(
                    "parallel.virtual_stages",
                    format!(
                        "{} model chunks per rank need a pipeline: set parallel.pp above 1",
                        p.virtual_stages
                    ),
                );
            }
            return Ok(());
        }
        let spec = PipelineSpec {
            stages: p.pp,
            virtual_stages: p.virtual_stages,
            micro_batches: self.train.accumulation,
        };
        spec.validate(p.pp_schedule).map_err(|e| {
            TrainError::config(
                "RunConfig.parallel.pp_schedule",
                format!(
                    "{} with pp = {}, virtual_stages = {} and train.accumulation = {} \
                     micro-batches: {e}",
                    p.pp_schedule, p.pp, p.virtual_stages, self.train.accumulation
                ),
            )
        })?;
        let stages = p.pp * p.virtual_stages;
        let layers = shape.n_layers as usize;
        if p.pp_schedule == ScheduleKind::Interleaved && layers % stages != 0 {
            return bad(
                "parallel.virtual_stages",
                format!(
                    "the interleaved schedule gives every chunk the same blocks: pp ({}) x \
                     virtual_stages ({}) = {stages} must divide the model's n_layers ({layers})",
                    p.pp, p.virtual_stages
                ),
            );
        }
        stage_segments(shape, stages, &StageSplit::Balanced).map_err(|e| {
            TrainError::config(
                "RunConfig.parallel.pp",
                format!("pp ({}) x virtual_stages ({}): {e}", p.pp, p.virtual_stages),
            )
        })?;
        if p.zero == ZeroStage::Zero3 {
            return bad(
                "parallel.zero",
                "pipeline stages run ZeRO stages 0 to 2 (ZeRO-3's per-segment gathers are not \
                 driven by a pipeline schedule): use zero = 1 or 2 with pp > 1"
                    .into(),
            );
        }
        Ok(())
    }
}
