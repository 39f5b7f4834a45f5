//! The step record: every standard training metric, most of them optional so a trainer fills
//! what it has.

use crate::jsonfloat;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// What the loss scaler did on a step (mirrors kiln-precision's `ScaleEvent`, which this crate
/// does not depend on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ScalerEvent {
    /// The optimizer stepped and the scale stayed.
    Stepped,
    /// Non-finite gradients: the step was skipped.
    Skipped,
    /// The scale grew after a run of clean steps.
    Grew,
    /// The scale was lowered after non-finite gradients.
    BackedOff,
}

/// One training step's metrics. The JSONL schema is this struct's serde form: one object per
/// line, absent fields omitted, non-finite floats as the strings `"NaN"`, `"Infinity"`,
/// `"-Infinity"`. See the crate docs or `METRICS.md` for the table of fields.
///
/// Build one with [`StepMetrics::new`] (which stamps the wall-clock time) and fill the fields
/// the trainer has:
///
/// ```
/// use kiln_monitor::StepMetrics;
/// let m = StepMetrics { loss: Some(2.5), lr: Some(3e-4), ..StepMetrics::new(10) };
/// assert_eq!(m.step, 10);
/// assert!(m.time.is_some() && m.grad_norm.is_none());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepMetrics {
    /// Optimizer step this record describes (the step just completed).
    pub step: u64,
    /// Wall-clock time the record was made, seconds since the Unix epoch.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub time: Option<f64>,
    /// Epoch of the data sampler.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Training loss of the step (mean over ranks after [`crate::RankSummary::apply`]).
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Global gradient L2 norm before clipping.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Global gradient L2 norm after clipping.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub grad_norm_clipped: Option<f64>,
    /// Learning rate used by the step.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Loss scale of mixed-precision training.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// What the loss scaler did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scaler_event: Option<ScalerEvent>,
    /// Training throughput, tokens per second (all ranks).
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Training throughput, samples (sequences) per second (all ranks).
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub samples_per_s: Option<f64>,
    /// Achieved model FLOP/s (all ranks): tokens/s x FLOPs per token.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub model_flops_per_s: Option<f64>,
    /// Model FLOPs utilisation, 0..1: achieved model FLOP/s over the peak (see [`crate::Mfu`]).
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// Wall time of the whole step, seconds (the slowest rank after aggregation).
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub step_time_s: Option<f64>,
    /// Time spent waiting for the data loader, seconds.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub data_wait_s: Option<f64>,
    /// Forward pass time, seconds.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub forward_s: Option<f64>,
    /// Backward pass time, seconds.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub backward_s: Option<f64>,
    /// Communication time not overlapped with compute, seconds.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub comm_s: Option<f64>,
    /// Optimizer step time (clipping, update, scaler), seconds.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub optimizer_s: Option<f64>,
    /// Fastest rank's step time, seconds.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub step_time_min_s: Option<f64>,
    /// Slowest rank's step time (the straggler), seconds.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub step_time_max_s: Option<f64>,
    /// Rank with the largest step time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub straggler_rank: Option<u64>,
    /// Every rank's step time in rank order, seconds (for the straggler detector).
    #[serde(with = "jsonfloat::vec", skip_serializing_if = "Vec::is_empty")]
    pub rank_step_time_s: Vec<f64>,
    /// L2 norm of all parameters.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub param_norm: Option<f64>,
    /// Norm of the parameter update over the parameter norm.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub update_param_ratio: Option<f64>,
    /// Loss per data source of the mixture.
    #[serde(with = "jsonfloat::map", skip_serializing_if = "BTreeMap::is_empty")]
    pub source_loss: BTreeMap<String, f64>,
    /// KL divergence of the observed source mix from the target mixture weights, nats.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub data_kl: Option<f64>,
    /// Steps skipped so far (loss scaler overflows and circuit-breaker skips).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
    /// Resident memory of the process, bytes (`VmRSS`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_rss_bytes: Option<u64>,
    /// Peak resident memory of the process, bytes (`VmHWM`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_peak_bytes: Option<u64>,
    /// Time spent saving a checkpoint during this step, seconds.
    #[serde(with = "jsonfloat::opt", skip_serializing_if = "Option::is_none")]
    pub ckpt_time_s: Option<f64>,
    /// Tokens trained on so far (all ranks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_seen: Option<u64>,
    /// Samples trained on so far (all ranks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub samples_seen: Option<u64>,
    /// Any other scalar, by name.
    #[serde(with = "jsonfloat::map", skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, f64>,
}

/// Seconds since the Unix epoch now (0 if the clock is before 1970).
pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl StepMetrics {
    /// An empty record for `step`, stamped with the current wall-clock time.
    pub fn new(step: u64) -> Self {
        StepMetrics {
            step,
            time: Some(unix_now()),
            ..StepMetrics::default()
        }
    }

    /// Fills `tokens_per_s` and `samples_per_s` from what one step processed (all ranks) and
    /// its wall time; also sets `step_time_s` if unset. A non-positive time leaves them unset.
    pub fn set_throughput(&mut self, tokens: u64, samples: u64, step_time_s: f64) {
        if step_time_s > 0.0 && step_time_s.is_finite() {
            self.tokens_per_s = Some(tokens as f64 / step_time_s);
            self.samples_per_s = Some(samples as f64 / step_time_s);
            self.step_time_s.get_or_insert(step_time_s);
        }
    }

    /// Fills `model_flops_per_s` and `mfu` from `tokens_per_s` (no-op when it is unset).
    pub fn set_mfu(&mut self, mfu: &Mfu) {
        if let Some(tps) = self.tokens_per_s {
            self.model_flops_per_s = Some(mfu.achieved_flops_per_s(tps));
            self.mfu = Some(mfu.mfu(tps));
        }
    }

    /// Fills `mem_rss_bytes` and `mem_peak_bytes` from [`MemoryUsage::current`] (left unset
    /// where the platform does not report them).
    pub fn set_memory(&mut self) {
        if let Some(m) = MemoryUsage::current() {
            self.mem_rss_bytes = Some(m.rss_bytes);
            self.mem_peak_bytes = Some(m.peak_bytes);
        }
    }

    /// Calls `f(prefix, name, value)` for every numeric metric that is set, in schema order:
    /// `prefix` is `""` for fields, `"source_loss/"` for per-source losses and `"extra/"` for
    /// [`StepMetrics::extra`]. `step`, `time`, `epoch`, `straggler_rank`, `scaler_event` and
    /// `rank_step_time_s` are not scalars of the run and are left out.
    pub fn for_each_scalar(&self, mut f: impl FnMut(&str, &str, f64)) {
        let fields: [(&str, Option<f64>); 25] = [
            ("loss", self.loss),
            ("grad_norm", self.grad_norm),
            ("grad_norm_clipped", self.grad_norm_clipped),
            ("lr", self.lr),
            ("loss_scale", self.loss_scale),
            ("tokens_per_s", self.tokens_per_s),
            ("samples_per_s", self.samples_per_s),
            ("model_flops_per_s", self.model_flops_per_s),
            ("mfu", self.mfu),
            ("step_time_s", self.step_time_s),
            ("data_wait_s", self.data_wait_s),
            ("forward_s", self.forward_s),
            ("backward_s", self.backward_s),
            ("comm_s", self.comm_s),
            ("optimizer_s", self.optimizer_s),
            ("step_time_min_s", self.step_time_min_s),
            ("step_time_max_s", self.step_time_max_s),
            ("param_norm", self.param_norm),
            ("update_param_ratio", self.update_param_ratio),
            ("data_kl", self.data_kl),
            ("skipped_steps", self.skipped_steps.map(|v| v as f64)),
            ("mem_rss_bytes", self.mem_rss_bytes.map(|v| v as f64)),
            ("mem_peak_bytes", self.mem_peak_bytes.map(|v| v as f64)),
            ("ckpt_time_s", self.ckpt_time_s),
            ("tokens_seen", self.tokens_seen.map(|v| v as f64)),
        ];
        for (name, v) in fields {
            if let Some(v) = v {
                f("", name, v);
            }
        }
        if let Some(v) = self.samples_seen {
            f("", "samples_seen", v as f64);
        }
        for (k, &v) in &self.source_loss {
            f("source_loss/", k, v);
        }
        for (k, &v) in &self.extra {
            f("extra/", k, v);
        }
    }
}

/// Resident and peak memory of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Resident set size, bytes (`VmRSS`).
    pub rss_bytes: u64,
    /// Peak resident set size, bytes (`VmHWM`).
    pub peak_bytes: u64,
}

impl MemoryUsage {
    /// Reads `/proc/self/status` on Linux; `None` elsewhere or if it cannot be read.
    pub fn current() -> Option<Self> {
        if cfg!(target_os = "linux") {
            let text = std::fs::read_to_string("/proc/self/status").ok()?;
            Self::parse_proc_status(&text)
        } else {
            None
        }
    }

    /// Parses the `VmRSS:` and `VmHWM:` lines (in kB) of a Linux `/proc/<pid>/status` text.
    ///
    /// ```
    /// use kiln_monitor::MemoryUsage;
    /// let m = MemoryUsage::parse_proc_status("VmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n").ok_or("no VmRSS or VmHWM")?;
    /// assert_eq!((m.rss_bytes, m.peak_bytes), (1024 * 1024, 2048 * 1024));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn parse_proc_status(text: &str) -> Option<Self> {
        let field = |key: &str| -> Option<u64> {
            let line = text.lines().find(|l| l.starts_with(key))?;
            let mut it = line[key.len()..].split_whitespace();
            let kb: u64 = it.next()?.parse().ok()?;
            match it.next() {
                Some("kB") | None => Some(kb * 1024),
                Some(_) => None,
            }
        };
        Some(MemoryUsage {
            rss_bytes: field("VmRSS:")?,
            peak_bytes: field("VmHWM:")?,
        })
    }
}

/// Model FLOPs utilisation: `mfu = tokens_per_s * flops_per_token / peak_flops_per_s`.
///
/// `flops_per_token` is the model's training FLOPs per token (forward and backward), as
/// kiln-model reports it or [`Mfu::transformer_flops_per_token`] estimates it; the peak is the
/// hardware's (all devices together): [`crate::PeakFlops`] finds it from the device (a CPU's
/// cores, clock and vector units; a GPU's published peak) and states its basis.
///
/// ```
/// use kiln_monitor::Mfu;
/// // 1M parameters: 6e6 FLOPs per token; 1000 tokens/s on a 1e10 FLOP/s machine
/// let mfu = Mfu::new(6.0e6, 1.0e10)?;
/// assert!((mfu.mfu(1000.0) - 0.6).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Mfu {
    flops_per_token: f64,
    peak_flops_per_s: f64,
}

impl Mfu {
    /// Validates that both values are finite and positive.
    pub fn new(flops_per_token: f64, peak_flops_per_s: f64) -> crate::Result<Self> {
        for (name, v) in [
            ("flops_per_token", flops_per_token),
            ("peak_flops_per_s", peak_flops_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(crate::MonitorError::config(name, "a finite value > 0", v));
            }
        }
        Ok(Mfu {
            flops_per_token,
            peak_flops_per_s,
        })
    }

    /// Training FLOPs per token of a decoder-only transformer (PaLM, appendix B):
    /// `6 N + 12 L d T`, with `N` the non-embedding parameters, `L` layers, `d` the model width
    /// and `T` the sequence length (the second term is attention's score and value matmuls).
    pub fn transformer_flops_per_token(
        n_params: u64,
        n_layers: u64,
        d_model: u64,
        seq_len: u64,
    ) -> f64 {
        6.0 * n_params as f64 + 12.0 * n_layers as f64 * d_model as f64 * seq_len as f64
    }

    /// The FLOPs per token it was built with.
    pub fn flops_per_token(&self) -> f64 {
        self.flops_per_token
    }

    /// The peak FLOP/s it was built with.
    pub fn peak_flops_per_s(&self) -> f64 {
        self.peak_flops_per_s
    }

    /// Achieved model FLOP/s at a throughput.
    pub fn achieved_flops_per_s(&self, tokens_per_s: f64) -> f64 {
        tokens_per_s * self.flops_per_token
    }

    /// Utilisation at a throughput, as a fraction of the peak.
    pub fn mfu(&self, tokens_per_s: f64) -> f64 {
        self.achieved_flops_per_s(tokens_per_s) / self.peak_flops_per_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> StepMetrics {
        StepMetrics {
            step: 7,
            time: Some(1.7e9),
            epoch: Some(1),
            loss: Some(f64::NAN),
            grad_norm: Some(f64::INFINITY),
            grad_norm_clipped: Some(f64::NEG_INFINITY),
            lr: Some(4.0 / 1.1),
            loss_scale: Some(65536.0),
            scaler_event: Some(ScalerEvent::BackedOff),
            tokens_per_s: Some(3600.5),
            samples_per_s: Some(28.1),
            model_flops_per_s: Some(1e12),
            mfu: Some(0.41),
            step_time_s: Some(0.25),
            data_wait_s: Some(0.001),
            forward_s: Some(0.08),
            backward_s: Some(0.15),
            comm_s: Some(0.01),
            optimizer_s: Some(0.009),
            step_time_min_s: Some(0.24),
            step_time_max_s: Some(0.25),
            straggler_rank: Some(3),
            rank_step_time_s: vec![0.24, 0.245, 0.241, 0.25],
            param_norm: Some(120.0),
            update_param_ratio: Some(1e-3),
            source_loss: [("web".to_string(), 2.5), ("code".to_string(), f64::NAN)].into(),
            data_kl: Some(0.002),
            skipped_steps: Some(2),
            mem_rss_bytes: Some(1 << 30),
            mem_peak_bytes: Some(2 << 30),
            ckpt_time_s: Some(1.5),
            tokens_seen: Some(1_000_000),
            samples_seen: Some(7_812),
            extra: [("my/metric".to_string(), -1.0)].into(),
        }
    }

    fn same(a: &StepMetrics, b: &StepMetrics) -> bool {
        // NaN != NaN: compare through the JSON text, which spells non-finite values
        serde_json::to_string(a).unwrap() == serde_json::to_string(b).unwrap()
    }

    #[test]
    fn json_round_trip_keeps_non_finite_values() {
        let m = full();
        let line = serde_json::to_string(&m).unwrap();
        assert!(line.contains(r#""loss":"NaN""#), "{line}");
        assert!(line.contains(r#""grad_norm":"Infinity""#), "{line}");
        assert!(
            line.contains(r#""grad_norm_clipped":"-Infinity""#),
            "{line}"
        );
        assert!(line.contains(r#""scaler_event":"backed_off""#), "{line}");
        let back: StepMetrics = serde_json::from_str(&line).unwrap();
        assert!(back.loss.unwrap().is_nan());
        assert_eq!(back.grad_norm, Some(f64::INFINITY));
        // finite values come back bitwise (serde_json's float_roundtrip)
        assert_eq!(back.lr.unwrap().to_bits(), (4.0f64 / 1.1).to_bits());
        assert!(same(&m, &back));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        // every field of the struct is present when set
        assert_eq!(v.as_object().unwrap().len(), 34);
    }

    #[test]
    fn empty_record_is_just_the_step() {
        let m = StepMetrics {
            step: 3,
            ..StepMetrics::default()
        };
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"step":3}"#);
        let back: StepMetrics = serde_json::from_str(r#"{"step":3}"#).unwrap();
        assert_eq!(back, m);
        assert!(serde_json::from_str::<StepMetrics>(r#"{"step":3,"loss":"abc"}"#).is_err());
    }

    #[test]
    fn scalars_cover_every_numeric_field() {
        let m = full();
        let mut names = Vec::new();
        m.for_each_scalar(|p, n, _| names.push(format!("{p}{n}")));
        // 26 plain fields + 2 per-source losses + 1 extra
        assert_eq!(names.len(), 29);
        assert_eq!(names[0], "loss");
        assert!(names.contains(&"source_loss/code".to_string()));
        assert!(names.contains(&"extra/my/metric".to_string()));
        // every plain scalar name is a JSON field of the record
        let v: serde_json::Value = serde_json::to_value(&m).unwrap();
        for n in names.iter().filter(|n| !n.contains('/')) {
            assert!(v.get(n).is_some(), "{n} is not a JSON field");
        }
    }

    #[test]
    fn throughput_and_mfu_follow_the_closed_form() {
        let mut m = StepMetrics::new(1);
        m.set_throughput(8 * 128, 8, 0.256);
        assert_eq!(m.tokens_per_s, Some(4000.0));
        assert_eq!(m.samples_per_s, Some(31.25));
        assert_eq!(m.step_time_s, Some(0.256));
        // GPT-3 small-ish: N = 85M non-embedding params, 12 layers, d 768, T 2048
        let fpt = Mfu::transformer_flops_per_token(85_000_000, 12, 768, 2048);
        assert_eq!(fpt, 6.0 * 85e6 + 12.0 * 12.0 * 768.0 * 2048.0);
        let mfu = Mfu::new(fpt, 312e12).unwrap();
        m.set_mfu(&mfu);
        let expected = 4000.0 * (510e6 + 226_492_416.0) / 312e12;
        assert!((m.mfu.unwrap() - expected).abs() <= 1e-15 * expected);
        assert_eq!(m.model_flops_per_s, Some(4000.0 * fpt));
        assert!(Mfu::new(0.0, 1.0).is_err());
        assert!(Mfu::new(1.0, f64::NAN).is_err());
        // no step time, no throughput
        let mut z = StepMetrics::new(1);
        z.set_throughput(10, 1, 0.0);
        assert_eq!(z.tokens_per_s, None);
    }

    #[test]
    fn proc_status_parsing() {
        let text =
            "Name:\tkiln\nVmPeak:\t 999 kB\nVmHWM:\t   5000 kB\nVmRSS:\t   4096 kB\nThreads: 3\n";
        let m = MemoryUsage::parse_proc_status(text).unwrap();
        assert_eq!(m.rss_bytes, 4096 * 1024);
        assert_eq!(m.peak_bytes, 5000 * 1024);
        assert_eq!(MemoryUsage::parse_proc_status("VmRSS:\t1 kB\n"), None);
        assert_eq!(
            MemoryUsage::parse_proc_status("VmRSS: x kB\nVmHWM: 1 kB"),
            None
        );
    }

    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    #[test]
    fn memory_matches_statm() {
        // a second reading of the same quantity: /proc/self/statm's resident pages
        let big = std::hint::black_box(vec![1u8; 64 << 20]);
        let m = MemoryUsage::current().unwrap();
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        let statm_bytes = pages * 4096;
        assert!(
            m.rss_bytes >= 64 << 20,
            "rss {} below the 64 MiB just touched",
            m.rss_bytes
        );
        assert!(m.peak_bytes >= m.rss_bytes);
        let rel = (m.rss_bytes as f64 - statm_bytes as f64).abs() / statm_bytes as f64;
        assert!(rel < 0.05, "VmRSS {} vs statm {}", m.rss_bytes, statm_bytes);
        assert_eq!(big.iter().map(|&b| b as u64).sum::<u64>(), 64 << 20);
    }
}
