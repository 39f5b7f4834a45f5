//! [`ZeroStage`]: how model states are split over the data-parallel group, the one type every
//! crate uses for it (the engine, the memory estimate, the checkpoint layout, the run config).

use crate::error::{Result, StateError};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// The ZeRO stage (Rajbhandari et al., 2020): what the data-parallel ranks shard.
///
/// Written as its number, 0 to 3, in configs, checkpoint manifests and on the command line
/// (`zero = 1`, `--zero 3`); the names `replicated`, `zero1`, `zero2` and `zero3` are
/// accepted too.
///
/// ```
/// use kiln_state::ZeroStage;
/// assert_eq!(ZeroStage::from_number(2)?, ZeroStage::Zero2);
/// assert_eq!("zero3".parse::<ZeroStage>()?.number(), 3);
/// assert!(ZeroStage::Zero2.shards_gradients() && !ZeroStage::Zero2.shards_parameters());
/// assert!(ZeroStage::from_number(4).is_err());
/// # Ok::<(), kiln_state::StateError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum ZeroStage {
    /// Plain data parallel: everything replicated (stage 0).
    #[default]
    Replicated,
    /// ZeRO-1: optimizer states (and the fp32 master weights) sharded.
    Zero1,
    /// ZeRO-2: also gradients.
    Zero2,
    /// ZeRO-3: also parameters.
    Zero3,
}

impl ZeroStage {
    /// Every stage, in order.
    pub const ALL: [ZeroStage; 4] = [
        ZeroStage::Replicated,
        ZeroStage::Zero1,
        ZeroStage::Zero2,
        ZeroStage::Zero3,
    ];

    /// The stage number, 0 (replicated) to 3.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Replicated => 0,
            ZeroStage::Zero1 => 1,
            ZeroStage::Zero2 => 2,
            ZeroStage::Zero3 => 3,
        }
    }

    /// The stage with number `n`; anything above 3 is an error naming it.
    pub fn from_number(n: u8) -> Result<Self> {
        Self::ALL
            .get(usize::from(n))
            .copied()
            .ok_or_else(|| StateError::Invalid {
                what: "zero stage".into(),
                message: format!("must be 0, 1, 2 or 3, got {n}"),
            })
    }

    /// The lowercase name: `replicated`, `zero1`, `zero2`, `zero3`.
    pub fn name(self) -> &'static str {
        match self {
            ZeroStage::Replicated => "replicated",
            ZeroStage::Zero1 => "zero1",
            ZeroStage::Zero2 => "zero2",
            ZeroStage::Zero3 => "zero3",
        }
    }

    /// Optimizer states sharded (stage 1 and above).
    pub fn shards_optimizer(self) -> bool {
        self >= ZeroStage::Zero1
    }

    /// Gradients reduce-scattered and sharded (stage 2 and above).
    pub fn shards_gradients(self) -> bool {
        self >= ZeroStage::Zero2
    }

    /// Parameters sharded and gathered per segment (stage 3).
    pub fn shards_parameters(self) -> bool {
        self == ZeroStage::Zero3
    }
}

impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ZeroStage {
    type Err = StateError;

    /// `0`..`3` or a name (`replicated`, `zero1`, ...; case-insensitive).
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        if let Ok(n) = t.parse::<u8>() {
            return Self::from_number(n);
        }
        Self::ALL
            .into_iter()
            .find(|z| z.name().eq_ignore_ascii_case(t))
            .ok_or_else(|| StateError::Invalid {
                what: "zero stage".into(),
                message: format!(
                    "must be 0, 1, 2, 3 or replicated, zero1, zero2, zero3, got {s:?}"
                ),
            })
    }
}

impl Serialize for ZeroStage {
    /// As its number, so manifests and configs read `zero_stage: 1`.
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_u8(self.number())
    }
}

impl<'de> Deserialize<'de> for ZeroStage {
    /// From its number or its name.
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ZeroStage;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a ZeRO stage: 0, 1, 2, 3 or replicated, zero1, zero2, zero3")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<ZeroStage, E> {
                u8::try_from(v)
                    .ok()
                    .and_then(|n| ZeroStage::from_number(n).ok())
                    .ok_or_else(|| E::custom(format!("zero stage must be 0, 1, 2 or 3, got {v}")))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<ZeroStage, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("zero stage must be 0, 1, 2 or 3, got {v}")))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<ZeroStage, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_names_and_serde_round_trip() {
        for z in ZeroStage::ALL {
            assert_eq!(ZeroStage::from_number(z.number()).unwrap(), z);
            assert_eq!(z.name().parse::<ZeroStage>().unwrap(), z);
            assert_eq!(z.number().to_string().parse::<ZeroStage>().unwrap(), z);
            let json = serde_json::to_string(&z).unwrap();
            assert_eq!(json, z.number().to_string());
            assert_eq!(serde_json::from_str::<ZeroStage>(&json).unwrap(), z);
            let named = format!("\"{}\"", z.name());
            assert_eq!(serde_json::from_str::<ZeroStage>(&named).unwrap(), z);
        }
        assert_eq!("ZeRO2".parse::<ZeroStage>().unwrap(), ZeroStage::Zero2);
        let e = "4".parse::<ZeroStage>().unwrap_err().to_string();
        assert!(e.contains("got 4"), "{e}");
        let e = "zero9".parse::<ZeroStage>().unwrap_err().to_string();
        assert!(e.contains("\"zero9\""), "{e}");
        assert!(serde_json::from_str::<ZeroStage>("7").is_err());
        assert!(serde_json::from_str::<ZeroStage>("-1").is_err());
    }

    #[test]
    fn what_each_stage_shards() {
        let shards = |z: ZeroStage| {
            (
                z.shards_optimizer(),
                z.shards_gradients(),
                z.shards_parameters(),
            )
        };
        assert_eq!(shards(ZeroStage::Replicated), (false, false, false));
        assert_eq!(shards(ZeroStage::Zero1), (true, false, false));
        assert_eq!(shards(ZeroStage::Zero2), (true, true, false));
        assert_eq!(shards(ZeroStage::Zero3), (true, true, true));
    }
}
