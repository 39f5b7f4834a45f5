//! Setting [`RunConfig`] fields from `(key, value)` pairs and command-line flags.

use super::RunConfig;
use crate::error::{Result, TrainError};
use kiln_precision::ComputeDType;
use serde_json::Value;

/// Short flag names and the field each one sets.
const ALIASES: &[(&str, &str)] = &[
    ("steps", "train.steps"),
    ("micro_batch", "train.micro_batch"),
    ("batch", "train.micro_batch"),
    ("accumulation", "train.accumulation"),
    ("accum", "train.accumulation"),
    ("seq_len", "train.seq_len"),
    ("ctx", "train.seq_len"),
    ("recompute", "train.recompute"),
    ("dp", "parallel.dp"),
    ("tp", "parallel.tp"),
    ("zero", "parallel.zero"),
    ("pp", "parallel.pp"),
    ("pp_schedule", "parallel.pp_schedule"),
    ("virtual_stages", "parallel.virtual_stages"),
    ("backend", "parallel.backend"),
    ("sequence_parallel", "parallel.sequence_parallel"),
    ("precision", "precision.compute"),
    ("preset", "model.preset"),
    ("lr", "optim.schedule.lr"),
    ("min_lr", "optim.schedule.min_lr"),
    ("warmup", "optim.schedule.warmup_steps"),
    ("optimizer", "optim.optimizer.type"),
    ("weight_decay", "optim.optimizer.weight_decay"),
    ("clip", "optim.max_grad_norm"),
    ("out", "output_dir"),
    ("device", "device"),
    ("output", "output_dir"),
    ("ckpt_dir", "checkpoint.dir"),
    ("ckpt_every", "checkpoint.every_steps"),
    ("resume_step", "checkpoint.resume_step"),
    ("eval_every", "eval.every"),
    ("eval_batches", "eval.batches"),
    ("data_dir", "data.data_dir"),
    ("cache_dir", "data.cache_dir"),
    ("corpora", "data.corpora"),
    ("workers", "data.workers"),
];

fn canonical_key(key: &str) -> String {
    let k = key.trim().trim_start_matches('-').replace('-', "_");
    ALIASES
        .iter()
        .find(|(a, _)| *a == k)
        .map_or(k, |(_, full)| full.to_string())
}

/// A value for the field at `path` whose current value is `current`, parsed from `text`.
fn parse_value(path: &str, current: &Value, text: &str) -> Result<Value> {
    let field = format!("RunConfig.{path}");
    let t = text.trim();
    let parse_bool = |s: &str| match s.to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Some(true),
        "false" | "no" | "off" | "0" => Some(false),
        _ => None,
    };
    let scalar = |s: &str| -> Value {
        if let Ok(u) = s.parse::<u64>() {
            Value::from(u)
        } else if let Ok(i) = s.parse::<i64>() {
            Value::from(i)
        } else if let Some(f) = s.parse::<f64>().ok().filter(|f| f.is_finite()) {
            Value::from(f)
        } else if let Some(b) = parse_bool(s) {
            Value::from(b)
        } else {
            Value::from(s)
        }
    };
    // JSON for lists of tables and sections (`--data.mixture '[{"step":1,"weights":[1,2]}]'`),
    // and `none` for an optional section (`--data.quality none`)
    if (t.starts_with('[') || t.starts_with('{')) && !matches!(current, Value::String(_)) {
        return serde_json::from_str(t)
            .map_err(|e| TrainError::config(&field, format!("expected JSON, got {t:?}: {e}")));
    }
    if matches!(t, "none" | "null") && matches!(current, Value::Object(_) | Value::Null) {
        return Ok(Value::Null);
    }
    Ok(match current {
        Value::Bool(_) => Value::from(parse_bool(t).ok_or_else(|| {
            TrainError::config(&field, format!("expected true or false, got {t:?}"))
        })?),
        Value::Number(n) if n.is_f64() => Value::from(
            t.parse::<f64>()
                .map_err(|_| TrainError::config(&field, format!("expected a number, got {t:?}")))?,
        ),
        Value::Number(_) => match t.parse::<u64>() {
            Ok(u) => Value::from(u),
            Err(_) => match t.parse::<f64>() {
                Ok(f) if f.fract() == 0.0 && f >= 0.0 && f <= u64::MAX as f64 => {
                    Value::from(f as u64)
                }
                _ => {
                    return Err(TrainError::config(
                        &field,
                        format!("expected a whole number, got {t:?}"),
                    ))
                }
            },
        },
        Value::String(_) => Value::from(t),
        Value::Array(items) => {
            let numeric = items.first().is_some_and(Value::is_number);
            Value::Array(
                t.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| if numeric { scalar(s) } else { Value::from(s) })
                    .collect(),
            )
        }
        Value::Null => scalar(t),
        Value::Object(map) => {
            return Err(TrainError::config(
                &field,
                format!(
                    "is a section; set one of its fields: {}",
                    map.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            ))
        }
    })
}

/// Checks that the document still reads as a [`RunConfig`] after setting `path`, so that a
/// value the field's type refuses is named by its field.
fn check_field(doc: &Value, path: &str) -> Result<()> {
    serde_json::from_value::<RunConfig>(doc.clone())
        .map(|_| ())
        .map_err(|e| TrainError::config(format!("RunConfig.{path}"), e.to_string()))
}

impl RunConfig {
    /// Sets fields from `(key, value)` pairs, in order. A key is a dotted path
    /// (`optim.schedule.lr`, `parallel.dp`, `seed`) or a short alias (`steps`, `dp`, `tp`, `zero`,
    /// `precision`, `preset`, `lr`, `micro_batch`, `seq_len`, `out`, ...); `-` and `_` are
    /// interchangeable. The value is parsed for the field's type (lists are comma-separated;
    /// lists of tables and sections as JSON; `none` empties an optional section). Setting
    /// `data.corpora` drops a mixture schedule written for other corpora unless
    /// `data.mixture` is set too. Setting the model (`model.preset`, `model.n_ctx`) sets
    /// `train.seq_len` to its context length unless `train.seq_len` is among the pairs too.
    ///
    /// ```
    /// use kiln_train::RunConfig;
    /// // the main job trains small_cpu at context 128; the tiny model has 64 positions
    /// let mut cfg = RunConfig::preset("train_gpt")?;
    /// cfg.apply_overrides(&[("preset", "tiny")])?;
    /// assert_eq!(cfg.train.seq_len, 64);
    /// cfg.apply_overrides(&[("preset", "small_cpu"), ("ctx", "32")])?;
    /// assert_eq!(cfg.train.seq_len, 32);
    /// # Ok::<(), kiln_train::TrainError>(())
    /// ```
    pub fn apply_overrides<K: AsRef<str>, V: AsRef<str>>(
        &mut self,
        pairs: &[(K, V)],
    ) -> Result<()> {
        let mut doc = serde_json::to_value(&*self)
            .map_err(|e| TrainError::config("RunConfig", e.to_string()))?;
        for (k, v) in pairs {
            let path = canonical_key(k.as_ref());
            let mut node = &mut doc;
            let parts: Vec<&str> = path.split('.').collect();
            for (i, part) in parts.iter().enumerate() {
                let here = parts[..=i].join(".");
                let Value::Object(map) = node else {
                    return Err(TrainError::config(
                        format!("RunConfig.{here}"),
                        "is not a section",
                    ));
                };
                let known: Vec<String> = map.keys().cloned().collect();
                node = map.get_mut(*part).ok_or_else(|| {
                    TrainError::config(
                        format!("RunConfig.{here}"),
                        format!(
                            "no such field (flag --{}); known here: {}",
                            k.as_ref().trim_start_matches('-'),
                            known.join(", ")
                        ),
                    )
                })?;
            }
            if path == "optim.optimizer.type" {
                // another optimizer: its own defaults, not the old one's options
                let fresh: kiln_optim::OptimizerConfig = v.as_ref().parse().map_err(|e| {
                    TrainError::config("RunConfig.optim.optimizer.type", format!("{e}"))
                })?;
                let section = doc
                    .get_mut("optim")
                    .and_then(|o| o.get_mut("optimizer"))
                    .ok_or_else(|| TrainError::config("RunConfig.optim.optimizer", "missing"))?;
                *section = serde_json::to_value(fresh)
                    .map_err(|e| TrainError::config("RunConfig.optim.optimizer", e.to_string()))?;
                check_field(&doc, &path)?;
                continue;
            }
            *node = if path == "precision.compute" {
                let d: ComputeDType = v.as_ref().trim().parse().map_err(|e| {
                    TrainError::config("RunConfig.precision.compute", format!("{e}"))
                })?;
                Value::from(d.name())
            } else {
                parse_value(&path, node, v.as_ref())?
            };
            check_field(&doc, &path)?;
        }
        *self = serde_json::from_value(doc)
            .map_err(|e| TrainError::config("RunConfig (after overrides)", e.to_string()))?;
        // a preset's mixture schedule is written for its corpora: other corpora given without a
        // schedule of their own are mixed with equal weights
        let set = |key: &str| pairs.iter().any(|(k, _)| canonical_key(k.as_ref()) == key);
        let d = &mut self.data;
        if set("data.corpora")
            && !set("data.mixture")
            && d.mixture.validate(d.corpora.len()).is_err()
        {
            d.mixture = kiln_data::MixtureSchedule::default();
        }
        // a model chosen here brings its context length, unless the sequence length is set
        // here too (an unknown preset is left for `validate` to name)
        if (set("model.preset") || set("model.n_ctx")) && !set("train.seq_len") {
            if let Ok(model) = self.gpt_config() {
                self.train.seq_len = model.n_ctx;
            }
        }
        Ok(())
    }

    /// What [`RunConfig::from_args`] accepts, for a program's `--help`: the flags, their short
    /// names and the fields they set, and the configuration `preset` starts from (TOML; any
    /// field of it is a flag as `--section.field value`).
    ///
    /// ```
    /// let help = kiln_train::RunConfig::args_help("tiny")?;
    /// assert!(help.contains("--steps") && help.contains("train.steps"));
    /// assert!(help.contains("[train]"));
    /// # Ok::<(), kiln_train::TrainError>(())
    /// ```
    pub fn args_help(preset: &str) -> Result<String> {
        let mut out = String::from(
            "flags (--key value or --key=value, applied in order):\n  \
             --config FILE          load a TOML run configuration instead of the preset\n  \
             --resume, --no-resume  resume from the newest valid checkpoint, or not\n",
        );
        for (short, field) in ALIASES {
            out.push_str(&format!("  --{short:<20} {field}\n"));
        }
        out.push_str(&format!(
            "  --<section>.<field>    any field below\n\n--preset picks the model ({}) and \
             trains at its context length unless --ctx is given too; a run shorter than its \
             warmup warms up over all its steps.\n\nthe preset {preset:?}:\n{}",
            kiln_model::PRESET_NAMES.join(", "),
            RunConfig::preset(preset)?.to_toml_string()?
        ));
        Ok(out)
    }

    /// Builds a configuration from command-line arguments (the program name excluded):
    /// `--config FILE` loads a TOML file instead of `preset`'s configuration, `--resume`
    /// turns resuming on, and every other `--key value` or `--key=value` is an override
    /// ([`RunConfig::apply_overrides`]). Flags apply in order.
    ///
    /// ```
    /// use kiln_train::RunConfig;
    /// let args = ["--steps", "30", "--dp=2", "--precision", "bf16", "--resume"].map(String::from);
    /// let cfg = RunConfig::from_args("tiny", args)?;
    /// assert_eq!((cfg.train.steps, cfg.parallel.dp, cfg.checkpoint.resume), (30, 2, true));
    /// assert_eq!(cfg.precision.compute, kiln_precision::ComputeDType::BF16);
    /// # Ok::<(), kiln_train::TrainError>(())
    /// ```
    pub fn from_args<I: IntoIterator<Item = String>>(preset: &str, args: I) -> Result<Self> {
        let mut cfg = RunConfig::preset(preset)?;
        let mut it = args.into_iter().peekable();
        let mut pairs: Vec<(String, String)> = Vec::new();
        while let Some(arg) = it.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                return Err(TrainError::config(
                    "command line",
                    format!("expected a --flag, got {arg:?}"),
                ));
            };
            let (key, value) = match flag.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (flag.to_string(), None),
            };
            let key_norm = key.replace('-', "_");
            match key_norm.as_str() {
                "resume" | "no_resume" => {
                    let on = key_norm == "resume";
                    let v = value.unwrap_or_else(|| on.to_string());
                    pairs.push(("checkpoint.resume".into(), v));
                    continue;
                }
                _ => {}
            }
            let value = match value {
                Some(v) => v,
                None => match it.peek() {
                    Some(v) if !v.starts_with("--") => it.next().unwrap_or_default(),
                    _ => {
                        return Err(TrainError::config(
                            format!("--{key}"),
                            "expects a value (--key value or --key=value)",
                        ))
                    }
                },
            };
            if key_norm == "config" {
                if !pairs.is_empty() {
                    cfg.apply_overrides(&pairs)?;
                    pairs.clear();
                }
                cfg = RunConfig::from_toml_file(&value)?;
                continue;
            }
            pairs.push((key, value));
        }
        cfg.apply_overrides(&pairs)?;
        Ok(cfg)
    }
}
