//! What gets saved: [`StateDict`] (one component's named tensors and metadata), the
//! [`Stateful`] trait components implement, and [`RankState`] (all parts one rank saves).

use crate::error::{CkptError, Result};
use crate::shard::Shard;
use crate::tensor::{DType, Element, TensorData};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
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

/// Checks a tensor name: non-empty, no control characters, at most 1024 bytes.
pub(crate) fn check_tensor_name(name: &str) -> Result<()> {
    let bad = |reason| {
        Err(CkptError::BadName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("a tensor name cannot be empty");
    }
    if name.len() > 1024 {
        return bad("a tensor name is at most 1024 bytes");
    }
    if name.chars().any(char::is_control) {
        return bad("a tensor name cannot hold control characters");
    }
    Ok(())
}

/// The dtype and shape a component expects of one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
}

/// One component's state: named tensors (each optionally a [`Shard`] of a global tensor)
/// and JSON metadata.
///
/// Tensor names may contain `/` (`layers/0/w`); in a checkpoint file they are stored as
/// `<part>/<name>`. Metadata holds small values (counters, seeds, scale factors, positions)
/// as JSON.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StateDict {
    tensors: BTreeMap<String, TensorData>,
    shards: BTreeMap<String, Shard>,
    meta: BTreeMap<String, Value>,
}

impl StateDict {
    /// An empty state dict.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a whole tensor.
    pub fn insert(&mut self, name: &str, tensor: TensorData) -> Result<()> {
        check_tensor_name(name)?;
        self.shards.remove(name);
        self.tensors.insert(name.to_string(), tensor);
        Ok(())
    }

    /// Adds (or replaces) a tensor that is `shard` of a global tensor; the tensor's shape
    /// must be the shard's local shape.
    pub fn insert_sharded(&mut self, name: &str, tensor: TensorData, shard: Shard) -> Result<()> {
        check_tensor_name(name)?;
        shard
            .validate_local(tensor.shape())
            .map_err(|e| e.named(name))?;
        self.tensors.insert(name.to_string(), tensor);
        self.shards.insert(name.to_string(), shard);
        Ok(())
    }

    /// Adds a tensor copied from a typed slice with the given shape.
    pub fn put<T: Element>(&mut self, name: &str, shape: &[usize], data: &[T]) -> Result<()> {
        let t = TensorData::from_slice(shape, data).map_err(|e| e.named(name))?;
        self.insert(name, t)
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorData> {
        self.tensors.get(name)
    }

    /// The shard `name` is of its global tensor (`None` for a whole tensor).
    pub fn shard(&self, name: &str) -> Option<&Shard> {
        self.shards.get(name)
    }

    /// The tensor called `name`, or [`CkptError::MissingTensor`].
    pub fn require(&self, name: &str) -> Result<&TensorData> {
        self.tensors
            .get(name)
            .ok_or_else(|| CkptError::MissingTensor {
                name: name.to_string(),
            })
    }

    /// Removes and returns a tensor (and forgets its shard).
    pub fn remove(&mut self, name: &str) -> Option<TensorData> {
        self.shards.remove(name);
        self.tensors.remove(name)
    }

    /// The elements of tensor `name`; fails if it is missing or of another dtype.
    pub fn get<T: Element>(&self, name: &str) -> Result<Vec<T>> {
        self.require(name)?.to_vec().map_err(|e| e.named(name))
    }

    /// The elements of tensor `name`, checking its dtype and shape.
    pub fn get_shaped<T: Element>(&self, name: &str, shape: &[usize]) -> Result<Vec<T>> {
        let t = self.require(name)?;
        t.check_shape(shape).map_err(|e| e.named(name))?;
        t.to_vec().map_err(|e| e.named(name))
    }

    /// Copies tensor `name` into `out`, checking dtype and element count.
    pub fn read_into<T: Element>(&self, name: &str, out: &mut [T]) -> Result<()> {
        self.require(name)?.copy_to(out).map_err(|e| e.named(name))
    }

    /// Tensor names in sorted order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// `(name, tensor)` pairs in sorted order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &TensorData)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when there are no tensors and no metadata.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty() && self.meta.is_empty()
    }

    /// Total bytes of all tensors.
    pub fn nbytes(&self) -> usize {
        self.tensors.values().map(|t| t.bytes().len()).sum()
    }

    /// Sets a metadata entry from any serializable value.
    pub fn set_meta<V: Serialize>(&mut self, key: &str, value: V) -> Result<()> {
        let v = serde_json::to_value(value).map_err(|e| CkptError::Meta {
            key: key.to_string(),
            reason: e.to_string(),
        })?;
        self.meta.insert(key.to_string(), v);
        Ok(())
    }

    /// Reads a metadata entry as `V`; fails if it is missing or has another form.
    pub fn meta<V: DeserializeOwned>(&self, key: &str) -> Result<V> {
        let v = self.meta.get(key).ok_or_else(|| CkptError::Meta {
            key: key.to_string(),
            reason: "missing".to_string(),
        })?;
        V::deserialize(v).map_err(|e| CkptError::Meta {
            key: key.to_string(),
            reason: e.to_string(),
        })
    }

    /// All metadata.
    pub fn meta_map(&self) -> &BTreeMap<String, Value> {
        &self.meta
    }

    /// All metadata, mutable.
    pub fn meta_map_mut(&mut self) -> &mut BTreeMap<String, Value> {
        &mut self.meta
    }

    /// The dtype and shape of every tensor (what [`Stateful::state_spec`] returns by default).
    pub fn spec(&self) -> BTreeMap<String, TensorSpec> {
        self.tensors
            .iter()
            .map(|(k, t)| {
                (
                    k.clone(),
                    TensorSpec {
                        dtype: t.dtype(),
                        shape: t.shape().to_vec(),
                    },
                )
            })
            .collect()
    }
}

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
    /// [`CkptError::DtypeMismatch`] / [`CkptError::ShapeMismatch`] naming `part/tensor`.
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
                    return Err(CkptError::DtypeMismatch {
                        name: full,
                        expected: want.dtype,
                        got: t.dtype(),
                    });
                }
                if t.shape() != want.shape {
                    return Err(CkptError::ShapeMismatch {
                        name: full,
                        expected: want.shape.clone(),
                        got: t.shape().to_vec(),
                    });
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

    #[test]
    fn typed_getters_name_the_tensor() {
        let mut sd = StateDict::new();
        sd.put("w", &[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])
            .unwrap();
        assert_eq!(
            sd.get_shaped::<f32>("w", &[2, 3]).unwrap(),
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
        assert_eq!(
            sd.get_shaped::<f32>("w", &[3, 2]).unwrap_err().to_string(),
            "tensor w: expected shape [3, 2], got [2, 3]"
        );
        assert_eq!(
            sd.get::<half::bf16>("w").unwrap_err().to_string(),
            "tensor w: expected dtype bf16, got f32"
        );
        assert_eq!(
            sd.get::<f32>("v").unwrap_err().to_string(),
            "missing tensor v"
        );
        let mut buf = [0.0f32; 5];
        assert!(matches!(
            sd.read_into("w", &mut buf),
            Err(CkptError::ElementCount { ref name, expected: 6, got: 5 }) if name == "w"
        ));
        sd.set_meta("lr", 3e-4f64).unwrap();
        assert_eq!(sd.meta::<f64>("lr").unwrap(), 3e-4);
        assert!(sd.meta::<String>("lr").is_err());
        assert!(sd.meta::<f64>("nope").is_err());
    }

    #[test]
    fn sharded_insert_checks_local_shape() {
        let mut sd = StateDict::new();
        let t = TensorData::from_slice(&[2, 3], &[0.0f32; 6]).unwrap();
        let e = sd
            .insert_sharded("w", t.clone(), Shard::dim(&[4, 3], 0, 0, 3))
            .unwrap_err();
        assert!(e.to_string().starts_with("tensor w: invalid shard"), "{e}");
        sd.insert_sharded("w", t, Shard::dim(&[4, 3], 0, 2, 2))
            .unwrap();
        assert_eq!(sd.shard("w"), Some(&Shard::dim(&[4, 3], 0, 2, 2)));
    }

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
