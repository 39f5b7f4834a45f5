//! [`PeakFlops`]: the denominator of MFU, with the basis it was found on: a CPU's cores, clock
//! and vector units ([`CpuInfo`]), a GPU's published dense peak by model name, or a value the
//! user gives.

use crate::error::{MonitorError, Result};
use kiln_state::DType;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt;

/// A peak FLOP/s and how it was arrived at, the denominator of [`crate::Mfu`].
///
/// ```
/// use kiln_monitor::{CpuInfo, PeakFlops};
/// use kiln_state::DType;
/// // two cores of a 2.6 GHz AVX-512 CPU: 2 x 2.6e9 x 2 FMA units x 16 f32 lanes x 2 FLOPs
/// let cpu = CpuInfo::parse(
///     "processor : 0\nvendor_id : GenuineIntel\ncpu family : 6\nmodel name : Xeon\n\
///      cpu MHz : 2600.000\nflags : fpu sse sse2 avx fma avx2 avx512f\n\n\
///      processor : 1\nvendor_id : GenuineIntel\ncpu family : 6\nmodel name : Xeon\n\
///      cpu MHz : 2600.000\nflags : fpu sse sse2 avx fma avx2 avx512f\n",
///     None,
///     2,
/// )?;
/// let peak = cpu.peak(DType::F32)?;
/// assert_eq!(peak.flops_per_s, 2.0 * 2.6e9 * 2.0 * 16.0 * 2.0);
/// assert_eq!(
///     peak.to_string(),
///     "333 GFLOP/s f32 peak: 2 cores x 2.6 GHz x 2 FMA x 16 lanes x 2 (Xeon, avx512f; clock: cpu MHz)"
/// );
/// // a GPU by the name its driver reports: H100 SXM, bf16 dense
/// let h100 = PeakFlops::gpu("NVIDIA H100 80GB HBM3", DType::BF16)?;
/// assert_eq!(h100.flops_per_s, 989e12);
/// // one the table does not know is an error, not a guess
/// assert!(PeakFlops::gpu("NVIDIA Z9000", DType::BF16).is_err());
/// # Ok::<(), kiln_monitor::MonitorError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeakFlops {
    /// The peak in FLOP/s, of every device counted.
    pub flops_per_s: f64,
    /// The number format it is for (none when the user gave the figure).
    pub dtype: Option<DType>,
    /// How it was arrived at: the product of its factors for a CPU (`2 cores x 2.6 GHz x 2
    /// FMA x 16 lanes x 2 (...)`), the table entry for a GPU, or `given`.
    pub basis: String,
}

impl PeakFlops {
    /// A peak the user gives (`metrics.peak_flops_per_s`): finite and above 0.
    pub fn given(flops_per_s: f64) -> Result<Self> {
        if !(flops_per_s.is_finite() && flops_per_s > 0.0) {
            return Err(MonitorError::config(
                "peak_flops_per_s",
                "a finite value > 0",
                flops_per_s,
            ));
        }
        Ok(PeakFlops {
            flops_per_s,
            dtype: None,
            basis: "given (metrics.peak_flops_per_s)".into(),
        })
    }

    /// The published dense peak of the GPU named `name` (as its driver reports it:
    /// `NVIDIA H100 80GB HBM3`, `NVIDIA A100-SXM4-80GB`, `NVIDIA L4`, ...) in `dtype`: tensor
    /// cores for f16 and bf16 without sparsity, and the plain FP32 rate for f32 (candle
    /// computes f32 products without TF32). See [`GPU_PEAKS`]. A GPU the table does not
    /// know, or a dtype it has no figure for, is an error naming them.
    pub fn gpu(name: &str, dtype: DType) -> Result<Self> {
        let unknown = |reason: String| MonitorError::Peak {
            device: name.to_string(),
            dtype,
            reason,
        };
        let spec = GpuPeak::find(name).ok_or_else(|| {
            unknown(format!(
                "not in the table of published peaks ({}); set metrics.peak_flops_per_s",
                GPU_PEAKS
                    .iter()
                    .map(|g| g.model)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        let (tflops, how) = match dtype {
            DType::F32 => (Some(spec.f32), "FP32 without TF32"),
            DType::F16 => (spec.f16, "FP16 tensor cores, dense"),
            DType::BF16 => (spec.bf16, "BF16 tensor cores, dense"),
            _ => (None, ""),
        };
        let tflops = tflops.ok_or_else(|| {
            unknown(format!(
                "the {} has no published {dtype} peak in the table",
                spec.model
            ))
        })?;
        Ok(PeakFlops {
            flops_per_s: tflops * 1e12,
            dtype: Some(dtype),
            basis: format!("{} ({how}, published)", spec.model),
        })
    }

    /// The peak of `n` such devices (one GPU per rank, or one CPU per node).
    pub fn times(self, n: usize, what: &str) -> Self {
        if n == 1 {
            return self;
        }
        PeakFlops {
            flops_per_s: self.flops_per_s * n as f64,
            dtype: self.dtype,
            basis: format!("{n} {what} x {}", self.basis),
        }
    }
}

impl fmt::Display for PeakFlops {
    /// `333 GFLOP/s f32 peak: 2 cores x 2.6 GHz x ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", si_flops(self.flops_per_s))?;
        if let Some(d) = self.dtype {
            write!(f, " {d}")?;
        }
        write!(f, " peak: {}", self.basis)
    }
}

/// `3.33e11` as `333 GFLOP/s`: three significant digits and an SI prefix.
fn si_flops(v: f64) -> String {
    let (scaled, prefix) = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
        .into_iter()
        .find(|(s, _)| v >= *s)
        .map_or((v, ""), |(s, p)| (v / s, p));
    let digits = if scaled >= 100.0 {
        0
    } else if scaled >= 10.0 {
        1
    } else {
        2
    };
    format!("{scaled:.digits$} {prefix}FLOP/s")
}

/// One GPU model's published dense peaks in TFLOP/s (NVIDIA's datasheets; the tensor-core
/// figures without structured sparsity, half the "with sparsity" ones, to the TFLOP/s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuPeak {
    /// The model, as the table names it.
    pub model: &'static str,
    /// Words every matching device name holds (upper case, split at non-alphanumerics).
    pub words: &'static [&'static str],
    /// Words a matching device name must not hold (they name another variant).
    pub not: &'static [&'static str],
    /// FP32 (CUDA cores).
    pub f32: f64,
    /// FP16 tensor cores, dense.
    pub f16: Option<f64>,
    /// BF16 tensor cores, dense (none before Ampere).
    pub bf16: Option<f64>,
}

impl GpuPeak {
    /// The entry whose words a device name holds (the first, in [`GPU_PEAKS`]'s order).
    pub fn find(name: &str) -> Option<&'static GpuPeak> {
        let upper = name.to_ascii_uppercase();
        let words: BTreeSet<&str> = upper
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect();
        GPU_PEAKS.iter().find(|g| {
            g.words.iter().all(|w| words.contains(w)) && !g.not.iter().any(|w| words.contains(w))
        })
    }
}

const fn gpu(
    model: &'static str,
    words: &'static [&'static str],
    not: &'static [&'static str],
    f32: f64,
    f16: Option<f64>,
    bf16: Option<f64>,
) -> GpuPeak {
    GpuPeak {
        model,
        words,
        not,
        f32,
        f16,
        bf16,
    }
}

/// The GPUs [`PeakFlops::gpu`] knows, from NVIDIA's datasheets (dense tensor-core peaks).
pub const GPU_PEAKS: &[GpuPeak] = &[
    gpu("GH200", &["GH200"], &[], 67.0, Some(989.0), Some(989.0)),
    gpu(
        "H200 NVL",
        &["H200", "NVL"],
        &[],
        60.0,
        Some(835.0),
        Some(835.0),
    ),
    gpu(
        "H200 SXM",
        &["H200"],
        &["NVL"],
        67.0,
        Some(989.0),
        Some(989.0),
    ),
    gpu(
        "H100 PCIe",
        &["H100", "PCIE"],
        &[],
        51.0,
        Some(756.0),
        Some(756.0),
    ),
    gpu(
        "H100 NVL",
        &["H100", "NVL"],
        &[],
        60.0,
        Some(835.0),
        Some(835.0),
    ),
    gpu(
        "H100 SXM",
        &["H100"],
        &["PCIE", "NVL"],
        67.0,
        Some(989.0),
        Some(989.0),
    ),
    gpu("A100", &["A100"], &[], 19.5, Some(312.0), Some(312.0)),
    gpu("A40", &["A40"], &[], 37.4, Some(149.7), Some(149.7)),
    gpu("A30", &["A30"], &[], 10.3, Some(165.0), Some(165.0)),
    gpu("A10", &["A10"], &[], 31.2, Some(125.0), Some(125.0)),
    gpu("L40S", &["L40S"], &[], 91.6, Some(362.0), Some(362.0)),
    gpu("L40", &["L40"], &[], 90.5, Some(181.0), Some(181.0)),
    gpu("L4", &["L4"], &[], 30.3, Some(121.0), Some(121.0)),
    gpu("V100S PCIe", &["V100S"], &[], 16.4, Some(130.0), None),
    gpu("V100 PCIe", &["V100", "PCIE"], &[], 14.0, Some(112.0), None),
    gpu("V100 SXM2", &["V100"], &[], 15.7, Some(125.0), None),
    gpu("T4", &["T4"], &[], 8.1, Some(65.0), None),
];

/// What the peak of a CPU is computed from: its `/proc/cpuinfo`, its clock, and the CPUs
/// available to the process.
///
/// The peak is `cores x GHz x units x lanes x 2` (a fused multiply-add is 2 FLOPs), with
/// - cores: the CPUs available to the process, at most the physical cores (SMT threads share
///   a core's vector units);
/// - the clock: the maximum frequency the kernel reports (`cpufreq/cpuinfo_max_freq`), else
///   `cpu MHz`, else the `@ x.xxGHz` of the model name; turbo and AVX-512 clock offsets are
///   not modelled;
/// - units x lanes, the multiply-adds per core per cycle of the best instructions the flags
///   list for the dtype: f32 with `avx512f` 2 FMA units x 16 lanes (Intel server cores; one
///   unit on Xeon Bronze, Silver and Gold 5xxx before Ice Lake and on client cores, where the
///   figure is twice theirs; AMD family 25 (Zen 4) runs 512-bit FMAs on 256-bit units: 2 x
///   8), with `fma` 2 x 8, with `avx` one add and one multiply a cycle (1 x 8), SSE 1 x 4;
///   bf16 with `amx_bf16` 1 AMX unit x 512 (1024 FLOPs a cycle), with `avx512_bf16`
///   (`vdpbf16ps`) twice the f32 lanes; f16 with `amx_fp16` 1 x 512, with `avx512_fp16` 2 x
///   32; on Arm (`Features`) NEON `asimd` 2 x 4 for f32, `asimdhp` 2 x 8 for f16, `bf16`
///   (`bfdot`) 2 x 8 for bf16. A half type without its instructions is converted and
///   computed at the f32 rate, and the basis says so.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuInfo {
    /// `model name` (x86) or `CPU part` (Arm), or `unknown CPU`.
    pub model_name: String,
    /// `vendor_id` (x86), empty elsewhere.
    pub vendor: String,
    /// `cpu family` (x86).
    pub family: Option<u32>,
    /// The instruction-set flags (`flags` on x86, `Features` on Arm).
    pub flags: BTreeSet<String>,
    /// Logical CPUs listed.
    pub logical_cpus: usize,
    /// Physical cores listed (distinct `physical id` and `core id`; the logical CPUs where
    /// they are not listed).
    pub physical_cores: usize,
    /// The CPUs available to the process.
    pub available_cpus: usize,
    /// The clock in GHz.
    pub ghz: f64,
    /// Where the clock came from: `max frequency`, `cpu MHz` or `model name`.
    pub clock_source: &'static str,
}

/// Multiply-adds per core per cycle in one dtype: `units x lanes`.
#[derive(Clone, Copy)]
struct VectorRate {
    units: usize,
    lanes: usize,
    /// `FMA`, `AMX`, `add+mul`.
    unit: &'static str,
    /// The instructions, as the flags name them.
    isa: &'static str,
    /// Why a half type runs at the f32 rate, when it does.
    note: Option<&'static str>,
}

impl CpuInfo {
    /// Reads this machine's `/proc/cpuinfo`, the maximum frequency of `cpu0` from
    /// `/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq` when the kernel has it, and the
    /// CPUs available to the process (`std::thread::available_parallelism`: affinity and
    /// cgroup quota).
    pub fn probe() -> Result<Self> {
        let path = "/proc/cpuinfo";
        let text = std::fs::read_to_string(path).map_err(MonitorError::file("read", path))?;
        let max_khz =
            std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
                .ok()
                .and_then(|s| s.trim().parse().ok());
        let available = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::parse(&text, max_khz, available)
    }

    /// Parses a `/proc/cpuinfo` text; `max_khz` is the kernel's maximum frequency in kHz, if
    /// known, and `available_cpus` the CPUs the process may use.
    pub fn parse(cpuinfo: &str, max_khz: Option<u64>, available_cpus: usize) -> Result<Self> {
        let mut model_name = None;
        let mut part = None;
        let mut vendor = String::new();
        let mut family = None;
        let mut flags = BTreeSet::new();
        let mut mhz = None;
        let mut logical = 0usize;
        let mut cores = BTreeSet::new();
        let mut package = None;
        for line in cpuinfo.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let (key, value) = (key.trim(), value.trim());
            match key {
                "processor" => logical += 1,
                "model name" => {
                    model_name.get_or_insert_with(|| value.to_string());
                }
                "CPU part" => {
                    part.get_or_insert_with(|| format!("Arm CPU part {value}"));
                }
                "vendor_id" => vendor = value.to_string(),
                "cpu family" => family = value.parse().ok(),
                "flags" | "Features" if flags.is_empty() => {
                    flags = value.split_whitespace().map(str::to_string).collect();
                }
                "cpu MHz" => {
                    mhz = mhz.or(value.parse::<f64>().ok().filter(|v| *v > 0.0));
                }
                "physical id" => package = Some(value.to_string()),
                "core id" => {
                    cores.insert((package.clone(), value.to_string()));
                }
                _ => {}
            }
        }
        let model_name = model_name
            .or(part)
            .unwrap_or_else(|| "unknown CPU".to_string());
        if logical == 0 {
            return Err(MonitorError::Peak {
                device: model_name,
                dtype: DType::F32,
                reason: "the cpuinfo text lists no processor".into(),
            });
        }
        let nominal = model_name
            .rsplit_once('@')
            .and_then(|(_, f)| f.trim().strip_suffix("GHz"))
            .and_then(|f| f.trim().parse::<f64>().ok());
        let (ghz, clock_source) = match (max_khz, mhz, nominal) {
            (Some(khz), _, _) if khz > 0 => (khz as f64 / 1e6, "max frequency"),
            (_, Some(mhz), _) => (mhz / 1e3, "cpu MHz"),
            (_, _, Some(ghz)) => (ghz, "model name"),
            _ => {
                return Err(MonitorError::Peak {
                    device: model_name,
                    dtype: DType::F32,
                    reason: "no clock frequency (no cpufreq maximum, cpu MHz or @ GHz in the \
                             model name); set metrics.peak_flops_per_s"
                        .into(),
                })
            }
        };
        Ok(CpuInfo {
            model_name,
            vendor,
            family,
            flags,
            logical_cpus: logical,
            physical_cores: if cores.is_empty() {
                logical
            } else {
                cores.len()
            },
            available_cpus,
            ghz,
            clock_source,
        })
    }

    /// The cores counted: the CPUs available to the process, at most the physical cores.
    pub fn cores(&self) -> usize {
        self.available_cpus.clamp(1, self.physical_cores.max(1))
    }

    fn has(&self, flag: &str) -> bool {
        self.flags.contains(flag)
    }

    fn f32_rate(&self) -> Option<VectorRate> {
        let rate = |units, lanes, unit, isa| VectorRate {
            units,
            lanes,
            unit,
            isa,
            note: None,
        };
        if self.has("avx512f") {
            // Zen 4 executes 512-bit FMAs on its two 256-bit units
            let lanes = if self.vendor == "AuthenticAMD" && self.family == Some(25) {
                8
            } else {
                16
            };
            Some(rate(2, lanes, "FMA", "avx512f"))
        } else if self.has("fma") && self.has("avx") {
            Some(rate(2, 8, "FMA", "avx2 fma"))
        } else if self.has("avx") {
            Some(rate(1, 8, "add+mul", "avx"))
        } else if self.has("sse") || self.has("sse2") {
            Some(rate(1, 4, "add+mul", "sse"))
        } else if self.has("asimd") {
            Some(rate(2, 4, "FMA", "asimd"))
        } else {
            None
        }
    }

    fn rate(&self, dtype: DType) -> Option<VectorRate> {
        let f32 = self.f32_rate()?;
        let at_f32 = |note| VectorRate {
            note: Some(note),
            ..f32
        };
        let half = |units, lanes, unit, isa| VectorRate {
            units,
            lanes,
            unit,
            isa,
            note: None,
        };
        Some(match dtype {
            DType::F32 => f32,
            DType::F64 => VectorRate {
                lanes: f32.lanes / 2,
                ..f32
            },
            DType::BF16 if self.has("amx_bf16") => half(1, 512, "AMX", "amx_bf16"),
            DType::BF16 if self.has("avx512_bf16") => {
                half(f32.units, 2 * f32.lanes, "FMA", "avx512_bf16 vdpbf16ps")
            }
            DType::BF16 if self.has("asimd") && self.has("bf16") => half(2, 8, "FMA", "bf16 bfdot"),
            DType::BF16 => at_f32("no bf16 arithmetic: converted, at the f32 rate"),
            DType::F16 if self.has("amx_fp16") => half(1, 512, "AMX", "amx_fp16"),
            DType::F16 if self.has("avx512_fp16") => half(2, 32, "FMA", "avx512_fp16"),
            DType::F16 if self.has("asimdhp") => half(2, 8, "FMA", "asimdhp"),
            DType::F16 => at_f32("no f16 arithmetic: converted, at the f32 rate"),
            _ => return None,
        })
    }

    /// The peak in `dtype` (f32, f64, f16 or bf16) of the cores counted ([`CpuInfo::cores`]).
    pub fn peak(&self, dtype: DType) -> Result<PeakFlops> {
        let r = self.rate(dtype).ok_or_else(|| MonitorError::Peak {
            device: self.model_name.clone(),
            dtype,
            reason: format!(
                "no {dtype} vector unit known from its flags; set metrics.peak_flops_per_s"
            ),
        })?;
        let cores = self.cores();
        let flops_per_s = cores as f64 * self.ghz * 1e9 * r.units as f64 * r.lanes as f64 * 2.0;
        let note = r.note.map_or(String::new(), |n| format!("; {n}"));
        let basis = format!(
            "{cores} {} x {} GHz x {} {} x {} lanes x 2 ({}, {}{note}; clock: {})",
            if cores == 1 { "core" } else { "cores" },
            trim_float(self.ghz),
            r.units,
            r.unit,
            r.lanes,
            self.model_name,
            r.isa,
            self.clock_source
        );
        Ok(PeakFlops {
            flops_per_s,
            dtype: Some(dtype),
            basis,
        })
    }
}

/// `2.6` as `2.6`, `2.0` as `2`, `2.2999999` as `2.3`: at most three decimals.
fn trim_float(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/proc/cpuinfo` of a 2-CPU virtual machine on a Xeon with AVX-512, AVX512-FP16 and
    /// AMX, as its kernel printed it.
    const XEON_AMX_2CPU: &str = include_str!("../tests/fixtures/cpuinfo_xeon_amx_2cpu.txt");

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs()
    }

    /// The fixture with `from` replaced by `to` on every line that starts with `key`.
    fn edit(text: &str, key: &str, from: &str, to: &str) -> String {
        text.lines()
            .map(|l| {
                if l.starts_with(key) {
                    format!("{}\n", l.replace(from, to))
                } else {
                    format!("{l}\n")
                }
            })
            .collect()
    }

    #[test]
    fn cpu_peak_is_cores_clock_units_lanes_and_two() {
        let cpu = CpuInfo::parse(XEON_AMX_2CPU, None, 2).unwrap();
        assert_eq!(
            (cpu.logical_cpus, cpu.physical_cores, cpu.cores()),
            (2, 2, 2)
        );
        assert_eq!((cpu.ghz, cpu.clock_source), (2.6, "cpu MHz"));
        // f32: 2 cores x 2.6 GHz x 2 FMA units x 16 lanes x 2
        let f32 = cpu.peak(DType::F32).unwrap();
        assert!(close(f32.flops_per_s, 2.0 * 2.6e9 * 2.0 * 16.0 * 2.0));
        assert_eq!(
            f32.to_string(),
            "333 GFLOP/s f32 peak: 2 cores x 2.6 GHz x 2 FMA x 16 lanes x 2 \
             (Intel(R) Xeon(R) Processor, avx512f; clock: cpu MHz)"
        );
        // bf16 on AMX: 1024 FLOPs per core per cycle; f16 on AVX512-FP16: 2 x 32 lanes
        let bf16 = cpu.peak(DType::BF16).unwrap();
        assert!(close(bf16.flops_per_s, 2.0 * 2.6e9 * 1024.0));
        assert!(bf16.basis.contains("1 AMX x 512 lanes"), "{}", bf16.basis);
        let f16 = cpu.peak(DType::F16).unwrap();
        assert!(close(f16.flops_per_s, 2.0 * 2.6e9 * 2.0 * 32.0 * 2.0));
        let f64 = cpu.peak(DType::F64).unwrap();
        assert!(close(f64.flops_per_s, 2.0 * 2.6e9 * 2.0 * 8.0 * 2.0));
        assert!(cpu.peak(DType::U8).is_err());
        // one CPU available to the process: one core counted
        let one = CpuInfo::parse(XEON_AMX_2CPU, None, 1).unwrap();
        assert!(close(
            one.peak(DType::F32).unwrap().flops_per_s,
            2.6e9 * 64.0
        ));
        // more available than listed (a cgroup quota over the whole machine): the cores listed
        assert_eq!(CpuInfo::parse(XEON_AMX_2CPU, None, 8).unwrap().cores(), 2);
        // the kernel's maximum frequency wins over cpu MHz
        let max = CpuInfo::parse(XEON_AMX_2CPU, Some(3_800_000), 2).unwrap();
        assert_eq!((max.ghz, max.clock_source), (3.8, "max frequency"));
        // bf16 without AMX: avx512_bf16's vdpbf16ps, twice the f32 lanes
        let no_amx = edit(XEON_AMX_2CPU, "flags", " amx_bf16", "");
        let cpu = CpuInfo::parse(&no_amx, None, 2).unwrap();
        let bf16 = cpu.peak(DType::BF16).unwrap();
        assert!(close(bf16.flops_per_s, 2.0 * 2.6e9 * 2.0 * 32.0 * 2.0));
        assert!(bf16.basis.contains("vdpbf16ps"), "{}", bf16.basis);
    }

    #[test]
    fn avx2_smt_and_half_types_without_instructions() {
        // the fixture as an AVX2 machine without AVX-512 or AMX, each core listed twice (SMT)
        let avx2 = XEON_AMX_2CPU
            .lines()
            .map(|l| {
                if l.starts_with("flags") {
                    let kept: Vec<&str> = l
                        .split(' ')
                        .filter(|f| !f.starts_with("avx512") && !f.starts_with("amx"))
                        .collect();
                    format!("{}\n", kept.join(" "))
                } else {
                    format!("{l}\n")
                }
            })
            .collect::<String>();
        let smt = format!("{avx2}\n{}", edit(&avx2, "processor", ": ", ": 2"));
        let cpu = CpuInfo::parse(&smt, None, 4).unwrap();
        assert_eq!(
            (cpu.logical_cpus, cpu.physical_cores, cpu.cores()),
            (4, 2, 2)
        );
        let f32 = cpu.peak(DType::F32).unwrap();
        assert!(close(f32.flops_per_s, 2.0 * 2.6e9 * 2.0 * 8.0 * 2.0));
        assert!(f32.basis.contains("2 FMA x 8 lanes"), "{}", f32.basis);
        for d in [DType::BF16, DType::F16] {
            let p = cpu.peak(d).unwrap();
            assert_eq!(p.flops_per_s, f32.flops_per_s, "{d}");
            assert!(p.basis.contains("at the f32 rate"), "{}", p.basis);
        }
        // without cpu MHz, the model name's nominal clock; without either, an error
        let no_mhz: String = XEON_AMX_2CPU
            .lines()
            .filter(|l| !l.starts_with("cpu MHz"))
            .map(|l| format!("{l}\n"))
            .collect();
        let e = CpuInfo::parse(&no_mhz, None, 2).unwrap_err().to_string();
        assert!(e.contains("no clock frequency"), "{e}");
        let named = edit(
            &no_mhz,
            "model name",
            "Processor",
            "Gold 6148 CPU @ 2.40GHz",
        );
        let cpu = CpuInfo::parse(&named, None, 2).unwrap();
        assert_eq!((cpu.ghz, cpu.clock_source), (2.4, "model name"));
        // AMD Zen 4 (family 25) runs AVX-512 on 256-bit units
        let zen4 = edit(
            &edit(XEON_AMX_2CPU, "vendor_id", "GenuineIntel", "AuthenticAMD"),
            "cpu family",
            ": 6",
            ": 25",
        );
        let cpu = CpuInfo::parse(&zen4, None, 2).unwrap();
        assert!(close(
            cpu.peak(DType::F32).unwrap().flops_per_s,
            2.0 * 2.6e9 * 2.0 * 8.0 * 2.0
        ));
    }

    #[test]
    fn arm_from_its_features_and_the_kernel_clock() {
        // the fields an Arm kernel prints (no model name, no clock)
        let text = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull \
                    sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n\
                    CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\n\
                    CPU part\t: 0xd0c\nCPU revision\t: 1\n\n";
        let four = text.repeat(4);
        let e = CpuInfo::parse(&four, None, 4).unwrap_err().to_string();
        assert!(e.contains("no clock frequency"), "{e}");
        let cpu = CpuInfo::parse(&four, Some(3_000_000), 4).unwrap();
        assert_eq!(
            (cpu.cores(), cpu.model_name.as_str()),
            (4, "Arm CPU part 0xd0c")
        );
        let f32 = cpu.peak(DType::F32).unwrap().flops_per_s;
        assert!(close(f32, 4.0 * 3e9 * 2.0 * 4.0 * 2.0));
        let f16 = cpu.peak(DType::F16).unwrap().flops_per_s;
        assert!(close(f16, 4.0 * 3e9 * 2.0 * 8.0 * 2.0));
        // no bf16 feature: the f32 rate
        assert_eq!(cpu.peak(DType::BF16).unwrap().flops_per_s, f32);
    }

    #[test]
    fn gpu_table_by_driver_name() {
        for (name, dtype, tflops, model) in [
            ("NVIDIA H100 80GB HBM3", DType::BF16, 989.0, "H100 SXM"),
            ("NVIDIA H100 PCIe", DType::BF16, 756.0, "H100 PCIe"),
            ("NVIDIA H100 NVL", DType::F16, 835.0, "H100 NVL"),
            ("NVIDIA H100 80GB HBM3", DType::F32, 67.0, "H100 SXM"),
            ("NVIDIA H200", DType::BF16, 989.0, "H200 SXM"),
            ("NVIDIA H200 NVL", DType::BF16, 835.0, "H200 NVL"),
            ("NVIDIA GH200 480GB", DType::BF16, 989.0, "GH200"),
            ("NVIDIA A100-SXM4-80GB", DType::BF16, 312.0, "A100"),
            ("NVIDIA A100-PCIE-40GB", DType::F32, 19.5, "A100"),
            ("NVIDIA A10", DType::BF16, 125.0, "A10"),
            ("NVIDIA L4", DType::BF16, 121.0, "L4"),
            ("NVIDIA L40S", DType::BF16, 362.0, "L40S"),
            ("NVIDIA L40", DType::F16, 181.0, "L40"),
            ("Tesla V100-SXM2-16GB", DType::F16, 125.0, "V100 SXM2"),
            ("Tesla V100-PCIE-32GB", DType::F32, 14.0, "V100 PCIe"),
            ("Tesla T4", DType::F16, 65.0, "T4"),
        ] {
            let p = PeakFlops::gpu(name, dtype).unwrap();
            assert_eq!(p.flops_per_s, tflops * 1e12, "{name}");
            assert!(p.basis.starts_with(model), "{name}: {}", p.basis);
            assert_eq!(p.dtype, Some(dtype));
        }
        assert_eq!(
            PeakFlops::gpu("NVIDIA H100 80GB HBM3", DType::BF16)
                .unwrap()
                .to_string(),
            "989 TFLOP/s bf16 peak: H100 SXM (BF16 tensor cores, dense, published)"
        );
        // no guesses: an unknown model, or a dtype the model has no figure for
        let e = PeakFlops::gpu("NVIDIA B300", DType::BF16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("NVIDIA B300") && e.contains("H100 SXM"), "{e}");
        let e = PeakFlops::gpu("Tesla T4", DType::BF16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no published bf16 peak"), "{e}");
    }

    #[test]
    fn a_given_peak_and_several_devices() {
        let p = PeakFlops::given(2.5e14).unwrap();
        assert_eq!(
            p.to_string(),
            "250 TFLOP/s peak: given (metrics.peak_flops_per_s)"
        );
        assert!(PeakFlops::given(0.0).is_err() && PeakFlops::given(f64::NAN).is_err());
        let eight = PeakFlops::gpu("NVIDIA H200", DType::BF16)
            .unwrap()
            .times(8, "GPUs");
        assert_eq!(eight.flops_per_s, 8.0 * 989e12);
        assert_eq!(
            eight.to_string(),
            "7.91 PFLOP/s bf16 peak: 8 GPUs x H200 SXM (BF16 tensor cores, dense, published)"
        );
        assert_eq!(si_flops(999.0), "999 FLOP/s");
        assert_eq!(si_flops(1.234e10), "12.3 GFLOP/s");
    }
}
