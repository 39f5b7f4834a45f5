//! [`DeviceSpec`]: where tensors live, as a configuration value (`cpu`, `cuda`, `cuda:N`).

use crate::error::{ModelError, Result};
use candle_core::Device;

/// A device as configured: the CPU, or CUDA GPU `N` (`cuda` is `cuda:0`). Serde, `Display` and
/// `FromStr` use those spellings. [`DeviceSpec::device`] opens it, with an error that says why
/// when it cannot: a build without the `cuda` feature, or no such GPU.
///
/// ```
/// use kiln_model::DeviceSpec;
/// let d: DeviceSpec = "cuda:1".parse()?;
/// assert_eq!((d, d.to_string()), (DeviceSpec::Cuda(1), "cuda:1".to_string()));
/// assert_eq!("cpu".parse::<DeviceSpec>()?.device()?.is_cpu(), true);
/// assert!("tpu".parse::<DeviceSpec>().is_err());
/// # Ok::<(), kiln_model::ModelError>(())
/// ```
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    /// The host CPU.
    #[default]
    Cpu,
    /// CUDA GPU with this ordinal.
    Cuda(usize),
}

impl DeviceSpec {
    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }

    /// The same device, `ordinal` GPUs further on (the local rank's GPU under a launcher that
    /// starts one process per GPU); the CPU stays the CPU.
    pub fn offset(self, ordinal: usize) -> DeviceSpec {
        match self {
            DeviceSpec::Cpu => DeviceSpec::Cpu,
            DeviceSpec::Cuda(n) => DeviceSpec::Cuda(n + ordinal),
        }
    }

    /// Opens the device.
    pub fn device(self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => {
                if !cfg!(feature = "cuda") {
                    return Err(ModelError::Device {
                        device: self.to_string(),
                        reason: "kiln was built without CUDA: build with `--features cuda` \
                                 (see docs/gpu.md)"
                            .into(),
                    });
                }
                Device::new_cuda(n).map_err(|e| ModelError::Device {
                    device: self.to_string(),
                    reason: format!("cannot open the GPU: {e}"),
                })
            }
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        let bad = || ModelError::Device {
            device: s.to_string(),
            reason: "expected cpu, cuda or cuda:N".into(),
        };
        match t.as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(bad),
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = ModelError;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(d: DeviceSpec) -> String {
        d.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_and_errors_say_why() {
        for (text, want) in [
            ("cpu", DeviceSpec::Cpu),
            ("CUDA", DeviceSpec::Cuda(0)),
            (" cuda:3 ", DeviceSpec::Cuda(3)),
        ] {
            let d: DeviceSpec = text.parse().unwrap();
            assert_eq!(d, want);
            assert_eq!(d.to_string().parse::<DeviceSpec>().unwrap(), d);
        }
        let e = "cuda:x".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(e.contains("cuda:x") && e.contains("cuda:N"), "{e}");
        assert_eq!(DeviceSpec::Cuda(1).offset(2), DeviceSpec::Cuda(3));
        assert_eq!(DeviceSpec::Cpu.offset(2), DeviceSpec::Cpu);
        if !cfg!(feature = "cuda") {
            let e = DeviceSpec::Cuda(0).device().unwrap_err().to_string();
            assert!(e.contains("--features cuda"), "{e}");
        }
    }
}
