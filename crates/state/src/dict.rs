//! [`StateDict`]: one component's named tensors (whole or a [`Shard`] of a global tensor) and
//! JSON metadata, and [`TensorSpec`], what a component expects of one tensor.

use crate::error::{Result, StateError};
use crate::shard::Shard;
use crate::tensor::{DType, Element, TensorData};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;

/// Checks a tensor name: non-empty, no control characters, at most 1024 bytes.
pub fn check_tensor_name(name: &str) -> Result<()> {
    let bad = |reason| {
        Err(StateError::BadName {
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

    /// The tensor called `name`, or [`StateError::MissingTensor`].
    pub fn require(&self, name: &str) -> Result<&TensorData> {
        self.tensors
            .get(name)
            .ok_or_else(|| StateError::MissingTensor {
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
        let v = serde_json::to_value(value).map_err(|e| StateError::Meta {
            key: key.to_string(),
            reason: e.to_string(),
        })?;
        self.meta.insert(key.to_string(), v);
        Ok(())
    }

    /// Reads a metadata entry as `V`; fails if it is missing or has another form.
    pub fn meta<V: DeserializeOwned>(&self, key: &str) -> Result<V> {
        let v = self.meta.get(key).ok_or_else(|| StateError::Meta {
            key: key.to_string(),
            reason: "missing".to_string(),
        })?;
        V::deserialize(v).map_err(|e| StateError::Meta {
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

    /// The dtype and shape of every tensor (what [`crate::Stateful::state_spec`] returns by default).
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

#[cfg(test)]
mod tests {
    use super::*;

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
            Err(StateError::ElementCount { ref name, expected: 6, got: 5 }) if name == "w"
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
}
