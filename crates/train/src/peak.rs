//! [`run_peak`]: the peak FLOP/s of the devices a run trains on, the denominator of its MFU.

use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use candle_core::Device;
use kiln_comm::Backend;
use kiln_launch::LaunchEnv;
use kiln_monitor::{CpuInfo, PeakFlops};
use kiln_precision::ComputeDType;
use kiln_state::DType;

/// The peak FLOP/s of every device of the run together, in its compute dtype, with its basis:
/// `metrics.peak_flops_per_s` when the user gives it; otherwise asked of `device` (the rank's
/// device):
/// - a CPU: kiln-monitor's [`CpuInfo`] (cores available to the process x clock x vector
///   units). Thread ranks share the process's cores; with one rank per process (`mpi`), the
///   processes on a node share its cores (the launcher's local size, else every process on
///   one node) and each node counts once;
/// - a CUDA GPU: its name, looked up in kiln-monitor's table of published peaks
///   ([`PeakFlops::gpu`]), times the GPUs (one per process; thread ranks share one).
///
/// An unknown GPU, or a CPU whose clock or vector unit is not known, is an error: the run then
/// reports no MFU, and says why.
pub fn run_peak(cfg: &RunConfig, device: &Device) -> Result<PeakFlops> {
    if let Some(given) = cfg.metrics.peak_flops_per_s {
        return Ok(PeakFlops::given(given)?);
    }
    let dtype = match cfg.precision.compute {
        ComputeDType::F16 => DType::F16,
        ComputeDType::BF16 => DType::BF16,
        _ => DType::F32,
    };
    let p = &cfg.parallel;
    let world = p.world();
    let per_process = p.backend != Backend::Thread && world > 1;
    match device {
        Device::Cpu => {
            let mut cpu = CpuInfo::probe()?;
            if !per_process {
                return Ok(cpu.peak(dtype)?);
            }
            let local = LaunchEnv::from_env()?
                .local_world_size
                .unwrap_or(world)
                .clamp(1, world);
            // the node's processes together use at most its cores
            cpu.available_cpus = cpu.available_cpus.saturating_mul(local);
            Ok(cpu.peak(dtype)?.times(world.div_ceil(local), "nodes"))
        }
        Device::Cuda(_) => {
            let name = gpu_name(device)?;
            let gpus = if per_process { world } else { 1 };
            Ok(PeakFlops::gpu(&name, dtype)?.times(gpus, "GPUs"))
        }
        other => Err(TrainError::config(
            "RunConfig.metrics.peak_flops_per_s",
            format!("no peak FLOP/s known for device {other:?}: set it"),
        )),
    }
}

/// The name the CUDA driver reports for the device (`NVIDIA H100 80GB HBM3`).
#[cfg(feature = "cuda")]
fn gpu_name(device: &Device) -> Result<String> {
    match device {
        Device::Cuda(d) => d.cuda_stream().context().name().map_err(|e| {
            TrainError::config(
                "RunConfig.device",
                format!("the CUDA driver gives no device name ({e:?})"),
            )
        }),
        _ => Err(TrainError::config("RunConfig.device", "not a CUDA device")),
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_name(_device: &Device) -> Result<String> {
    Err(TrainError::config(
        "RunConfig.device",
        "a CUDA device needs a build with the cuda feature",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_peak_wins_and_the_cpu_is_asked_otherwise() {
        // given by a flag (as a float or a whole number) or in TOML, it wins
        let mut cfg = RunConfig::default();
        cfg.apply_overrides(&[("metrics.peak_flops_per_s", "989e12")])
            .unwrap();
        assert_eq!(cfg.metrics.peak_flops_per_s, Some(989e12));
        cfg.apply_overrides(&[("metrics.peak_flops_per_s", "350000000000")])
            .unwrap();
        assert_eq!(cfg.metrics.peak_flops_per_s, Some(3.5e11));
        let toml = RunConfig::from_toml_str("[metrics]\npeak_flops_per_s = 3.5e11\n").unwrap();
        assert_eq!(toml.metrics, cfg.metrics);
        let given = run_peak(&cfg, &Device::Cpu).unwrap();
        assert_eq!(given.flops_per_s, 3.5e11);
        assert!(given.basis.contains("given"), "{}", given.basis);
        let mut zero = cfg.clone();
        zero.metrics.peak_flops_per_s = Some(0.0);
        let e = zero.validate().unwrap_err().to_string();
        assert!(e.contains("RunConfig.metrics.peak_flops_per_s"), "{e}");
        // not given: this machine's CPU, as kiln-monitor computes it from /proc/cpuinfo
        cfg.metrics.peak_flops_per_s = None;
        let Ok(cpu) = CpuInfo::probe() else {
            eprintln!("skipped: this system has no /proc/cpuinfo to compare with");
            return;
        };
        for (compute, dtype) in [
            (ComputeDType::F32, DType::F32),
            (ComputeDType::F16, DType::F16),
            (ComputeDType::BF16, DType::BF16),
        ] {
            cfg.precision.compute = compute;
            // thread ranks share the process's cores: the world size does not multiply it
            cfg.parallel.dp = 2;
            let got = run_peak(&cfg, &Device::Cpu);
            match cpu.peak(dtype) {
                Ok(want) => assert_eq!(got.unwrap(), want),
                Err(e) => assert_eq!(
                    got.unwrap_err().to_string(),
                    TrainError::from(e).to_string()
                ),
            }
        }
    }
}
