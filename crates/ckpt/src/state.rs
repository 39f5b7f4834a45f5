//! What one rank saves: [`RankState`] (named parts, each a [`StateDict`]), how strictly a
//! load must match ([`LoadOptions`]), and small stateful values ([`Step`], [`RngState`]).

use crate::error::{CkptError, Result};
use kiln_state::{StateDict, StateError, Stateful};
use std::collections::BTreeMap;

/// Checks a part name: ASCII letters, digits, `_`, `.`, `-`; not starting with `__`.
pub(crate) fn check_part_name(name: &str) -> Result<()> {
    let bad = |reason| {
        Err(CkptError::BadName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("a part name cannot be empty");
    }
    if name.len() > 256 {
        return bad("a part name is at most 256 bytes");
    }
    if name.starts_with("__") {
        return bad("names starting with __ are reserved");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return bad("a part name may hold only ASCII letters, digits, '_', '.' and '-'");
    }
    Ok(())
}

/// How strictly a checkpoint's tensors must match what a component expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// When true (the default), a tensor or part the checkpoint lacks or a tensor or part the
    /// target does not expect is an error; when false they are reported in [`KeyReport`] and
    /// the unexpected ones are dropped. Dtype and shape mismatches are always errors.
    pub strict: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { strict: true }
    }
}

impl LoadOptions {
    /// Non-strict loading.
    pub fn lenient() -> Self {
        LoadOptions { strict: false }
    }
}

/// What a restore found out about one part's keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyReport {
    /// The part.
    pub part: String,
    /// Tensors the target expected but the checkpoint lacks (non-strict only).
    pub missing: Vec<String>,
    /// Tensors the checkpoint held but the target did not expect, dropped (non-strict only).
    pub unexpected: Vec<String>,
}

/// Everything one rank saves or loads: named parts (`model`, `optim`, `scaler`, `rng`, ...),
/// each a [`StateDict`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankState {
    parts: BTreeMap<String, StateDict>,
}

impl RankState {
    /// An empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a part.
    pub fn insert(&mut self, part: &str, state: StateDict) -> Result<()> {
        check_part_name(part)?;
        self.parts.insert(part.to_string(), state);
        Ok(())
    }

    /// Adds a part from a component's [`Stateful::state`].
    pub fn capture(&mut self, part: &str, component: &dyn Stateful) -> Result<()> {
        self.insert(part, component.state()?)
    }

    /// The part called `part`.
    pub fn part(&self, part: &str) -> Option<&StateDict> {
        self.parts.get(part)
    }

    /// The part called `part`, mutable.
    pub fn part_mut(&mut self, part: &str) -> Option<&mut StateDict> {
        self.parts.get_mut(part)
    }

    /// Removes and returns a part, or [`CkptError::MissingPart`].
    pub fn take_part(&mut self, part: &str) -> Result<StateDict> {
        self.parts
            .remove(part)
            .ok_or_else(|| CkptError::MissingPart {
                part: part.to_string(),
            })
    }

    /// `(name, part)` pairs in sorted order.
    pub fn parts(&self) -> impl Iterator<Item = (&str, &StateDict)> {
        self.parts.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Part names in sorted order.
    pub fn part_names(&self) -> impl Iterator<Item = &str> {
        self.parts.keys().map(String::as_str)
    }

    /// Total tensor bytes over all parts.
    pub fn nbytes(&self) -> usize {
        self.parts.values().map(StateDict::nbytes).sum()
    }

    /// Checks part `part` against `target.state_spec()` and hands it to
    /// `target.load_state`.
    ///
    /// Strict (default): missing or unexpected tensors are [`CkptError::MissingKeys`] /
    /// [`CkptError::UnexpectedKeys`]. Always: a dtype or shape other than the target's is
    /// [`StateError::DtypeMismatch`] / [`StateError::ShapeMismatch`] naming `part/tensor`.
    pub fn restore(
        &mut self,
        part: &str,
        target: &mut dyn Stateful,
        opts: LoadOptions,
    ) -> Result<KeyReport> {
        let mut sd = self.take_part(part)?;
        let spec = target.state_spec()?;
        let missing: Vec<String> = spec
            .keys()
            .filter(|k| sd.tensor(k).is_none())
            .cloned()
            .collect();
        let unexpected: Vec<String> = sd
            .names()
            .filter(|k| !spec.contains_key(*k))
            .map(str::to_string)
            .collect();
        if opts.strict && !missing.is_empty() {
            return Err(CkptError::MissingKeys {
                part: part.to_string(),
                names: missing,
            });
        }
        if opts.strict && !unexpected.is_empty() {
            return Err(CkptError::UnexpectedKeys {
                part: part.to_string(),
                names: unexpected,
            });
        }
        for (name, want) in &spec {
            if let Some(t) = sd.tensor(name) {
                let full = format!("{part}/{name}");
                if t.dtype() != want.dtype {
                    return Err(StateError::DtypeMismatch {
                        name: full,
                        expected: want.dtype,
                        got: t.dtype(),
                    }
                    .into());
                }
                if t.shape() != want.shape {
                    return Err(StateError::ShapeMismatch {
                        name: full,
                        expected: want.shape.clone(),
                        got: t.shape().to_vec(),
                    }
                    .into());
                }
            }
        }
        for name in &unexpected {
            sd.remove(name);
        }
        target.load_state(sd)?;
        Ok(KeyReport {
            part: part.to_string(),
            missing,
            unexpected,
        })
    }

    /// The state of every named component: [`RankState::capture`] of each.
    pub fn capture_all(parts: &[(&str, &dyn Stateful)]) -> Result<RankState> {
        let mut st = RankState::new();
        for (name, part) in parts {
            st.capture(name, *part)?;
        }
        Ok(st)
    }

    /// Restores every target from the part of its name (see [`RankState::restore`]). Strict:
    /// a part no target asks for is [`CkptError::UnexpectedKeys`] (with an empty `part`), a
    /// part the state lacks is [`CkptError::MissingPart`]. Non-strict: missing parts are
    /// skipped and reported with an empty key list each.
    pub fn restore_all(
        mut self,
        targets: &mut [(&str, &mut dyn Stateful)],
        opts: LoadOptions,
    ) -> Result<Vec<KeyReport>> {
        let unexpected: Vec<String> = self
            .parts
            .keys()
            .filter(|k| !targets.iter().any(|(n, _)| n == k))
            .cloned()
            .collect();
        if opts.strict && !unexpected.is_empty() {
            return Err(CkptError::UnexpectedKeys {
                part: String::new(),
                names: unexpected,
            });
        }
        let mut reports = Vec::with_capacity(targets.len());
        for (name, target) in targets.iter_mut() {
            if self.parts.contains_key(*name) {
                reports.push(self.restore(name, &mut **target, opts)?);
            } else if opts.strict {
                return Err(CkptError::MissingPart {
                    part: name.to_string(),
                });
            } else {
                reports.push(KeyReport {
                    part: name.to_string(),
                    ..KeyReport::default()
                });
            }
        }
        Ok(reports)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_state::Step;

    #[test]
    fn names_are_checked() {
        let mut rs = RankState::new();
        for bad in ["", "__kiln", "a/b", "sp ace", "é"] {
            assert!(matches!(
                rs.insert(bad, StateDict::new()),
                Err(CkptError::BadName { .. })
            ));
        }
        rs.insert("model.ema-1_x", StateDict::new()).unwrap();
        let mut sd = StateDict::new();
        assert!(sd.put("", &[1], &[1.0f32]).is_err());
        assert!(sd.put("a\nb", &[1], &[1.0f32]).is_err());
        sd.put("layers/0/w", &[1], &[1.0f32]).unwrap();
    }

    fn model(w: &[f32]) -> StateDict {
        let mut sd = StateDict::new();
        sd.put("w", &[w.len()], w).unwrap();
        sd
    }

    #[test]
    fn restore_is_strict_by_default() {
        let mut saved = RankState::new();
        let mut m = model(&[1.0, 2.0]);
        m.put("extra", &[1], &[9.0f32]).unwrap();
        saved.insert("model", m).unwrap();

        let mut target = model(&[0.0, 0.0]);
        let e = saved
            .clone()
            .restore("model", &mut target, LoadOptions::default())
            .unwrap_err();
        assert!(matches!(e, CkptError::UnexpectedKeys { ref names, .. } if names == &["extra"]));

        let rep = saved
            .clone()
            .restore("model", &mut target, LoadOptions::lenient())
            .unwrap();
        assert_eq!(rep.unexpected, ["extra"]);
        assert_eq!(target.get::<f32>("w").unwrap(), [1.0, 2.0]);
        assert!(target.tensor("extra").is_none());

        // a different model: same names, other shape
        let mut other = model(&[0.0; 3]);
        let e = saved
            .clone()
            .restore("model", &mut other, LoadOptions::lenient())
            .unwrap_err();
        assert_eq!(e.to_string(), "tensor model/w: expected shape [3], got [2]");

        // missing keys
        let mut bigger = model(&[0.0, 0.0]);
        bigger.put("b", &[1], &[0.0f32]).unwrap();
        let mut only_w = RankState::new();
        only_w.insert("model", model(&[1.0, 2.0])).unwrap();
        let e = only_w
            .clone()
            .restore("model", &mut bigger, LoadOptions::default())
            .unwrap_err();
        assert!(matches!(e, CkptError::MissingKeys { ref names, .. } if names == &["b"]));

        // parts
        let mut step = Step(0);
        let e = only_w
            .clone()
            .restore_all(&mut [("step", &mut step)], LoadOptions::default())
            .unwrap_err();
        assert!(matches!(e, CkptError::UnexpectedKeys { ref names, .. } if names == &["model"]));
        let mut m = model(&[0.0, 0.0]);
        let e = only_w
            .clone()
            .restore_all(
                &mut [("model", &mut m), ("step", &mut step)],
                LoadOptions::default(),
            )
            .unwrap_err();
        assert!(matches!(e, CkptError::MissingPart { ref part } if part == "step"));
        let reps = only_w
            .restore_all(
                &mut [("model", &mut m), ("step", &mut step)],
                LoadOptions::lenient(),
            )
            .unwrap();
        assert_eq!(reps.len(), 2);
        assert_eq!(m.get::<f32>("w").unwrap(), [1.0, 2.0]);
    }
}
