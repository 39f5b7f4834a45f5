//! JSON encoding of floats that keeps non-finite values.
//!
//! serde_json writes NaN and infinities as `null`, which would erase exactly the values a
//! monitor must report. kiln writes finite values as JSON numbers and the others as the strings
//! `"NaN"`, `"Infinity"` and `"-Infinity"` (the tokens JavaScript and Python print), and reads
//! both forms back.

use serde::{Deserialize, Deserializer, Serializer};
use std::collections::BTreeMap;

#[derive(Deserialize)]
#[serde(untagged)]
enum Num {
    F(f64),
    S(String),
}

fn to_f64<E: serde::de::Error>(n: Num) -> Result<f64, E> {
    match n {
        Num::F(v) => Ok(v),
        Num::S(s) => match s.as_str() {
            "NaN" | "nan" => Ok(f64::NAN),
            "Infinity" | "inf" => Ok(f64::INFINITY),
            "-Infinity" | "-inf" => Ok(f64::NEG_INFINITY),
            other => Err(E::custom(format!(
                "expected a number, \"NaN\", \"Infinity\" or \"-Infinity\", got \"{other}\""
            ))),
        },
    }
}

fn write<S: Serializer>(v: f64, s: S) -> Result<S::Ok, S::Error> {
    if v.is_finite() {
        s.serialize_f64(v)
    } else if v.is_nan() {
        s.serialize_str("NaN")
    } else if v > 0.0 {
        s.serialize_str("Infinity")
    } else {
        s.serialize_str("-Infinity")
    }
}

/// `#[serde(with = "jsonfloat::plain")]` for `f64`.
pub(crate) mod plain {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        write(*v, s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        to_f64(Num::deserialize(d)?)
    }
}

/// `#[serde(with = "jsonfloat::opt")]` for `Option<f64>`.
pub(crate) mod opt {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => write(*v, s),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        match Option::<Num>::deserialize(d)? {
            Some(n) => to_f64(n).map(Some),
            None => Ok(None),
        }
    }
}

/// `#[serde(with = "jsonfloat::vec")]` for `Vec<f64>`.
pub(crate) mod vec {
    use super::*;
    use serde::ser::SerializeSeq;

    pub(crate) fn serialize<S: Serializer>(v: &[f64], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(v.len()))?;
        for &x in v {
            seq.serialize_element(&Wrap(x))?;
        }
        seq.end()
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
        Vec::<Num>::deserialize(d)?
            .into_iter()
            .map(to_f64)
            .collect()
    }
}

/// `#[serde(with = "jsonfloat::map")]` for `BTreeMap<String, f64>`.
pub(crate) mod map {
    use super::*;
    use serde::ser::SerializeMap;

    pub(crate) fn serialize<S: Serializer>(
        v: &BTreeMap<String, f64>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(v.len()))?;
        for (k, &x) in v {
            m.serialize_entry(k, &Wrap(x))?;
        }
        m.end()
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, f64>, D::Error> {
        BTreeMap::<String, Num>::deserialize(d)?
            .into_iter()
            .map(|(k, n)| to_f64(n).map(|v| (k, v)))
            .collect()
    }
}

struct Wrap(f64);

impl serde::Serialize for Wrap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        write(self.0, s)
    }
}
