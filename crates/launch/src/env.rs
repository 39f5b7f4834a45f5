//! Who this process is, read from the variables launchers set: torchrun, Open MPI's mpirun,
//! PMI (MPICH's Hydra) and Slurm's srun.

use super::nodelist::expand_nodelist;
use crate::error::{LaunchError, Result};
use crate::token::StoreToken;
use std::fmt;

/// The launcher whose variables describe this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// No launcher variables: a single process.
    None,
    /// torchrun / torch.distributed.launch style: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`.
    Torchrun,
    /// Open MPI's mpirun: `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`, `_LOCAL_SIZE`.
    OpenMpi,
    /// A PMI process manager (MPICH's Hydra `mpiexec`): `PMI_RANK`, `PMI_SIZE`,
    /// `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`.
    Pmi,
    /// Slurm's srun: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_NODELIST`.
    Slurm,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::None => "none",
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Pmi => "PMI",
            Launcher::Slurm => "Slurm",
        })
    }
}

/// The variables of one launcher.
struct Source {
    launcher: Launcher,
    rank: &'static str,
    size: &'static [&'static str],
    local_rank: &'static str,
    local_size: Option<&'static str>,
}

/// In order of precedence: the launcher that started this very process comes first (mpirun
/// inside a Slurm allocation sets both Open MPI's and Slurm's variables, and Slurm's then
/// describe the batch step; torchrun under srun likewise).
const SOURCES: [Source; 4] = [
    Source {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: &["OMPI_COMM_WORLD_SIZE"],
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
    },
    Source {
        launcher: Launcher::Pmi,
        rank: "PMI_RANK",
        size: &["PMI_SIZE"],
        local_rank: "MPI_LOCALRANKID",
        local_size: Some("MPI_LOCALNRANKS"),
    },
    Source {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        size: &["WORLD_SIZE"],
        local_rank: "LOCAL_RANK",
        local_size: Some("LOCAL_WORLD_SIZE"),
    },
    Source {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        size: &["SLURM_NTASKS", "SLURM_NPROCS"],
        local_rank: "SLURM_LOCALID",
        local_size: None,
    },
];

/// What the launch environment says about this process.
///
/// ```
/// use kiln_launch::{LaunchEnv, Launcher};
/// let vars = [("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"),
///             ("MASTER_ADDR", "node07"), ("MASTER_PORT", "29500")];
/// let env = LaunchEnv::from_vars(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))?;
/// assert_eq!((env.launcher, env.rank, env.world_size, env.local_rank), (Launcher::Torchrun, 3, 4, 1));
/// assert_eq!(env.master(), Some(("node07", 29500)));
/// # Ok::<(), kiln_launch::LaunchError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// The launcher the values come from.
    pub launcher: Launcher,
    /// This process's rank in the job.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// This process's rank on its node (the GPU it takes).
    pub local_rank: usize,
    /// Processes on this node, where the launcher says.
    pub local_world_size: Option<usize>,
    /// `MASTER_ADDR`; under Slurm without it, the first host of the node list.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`; under Slurm without it, `15000 + SLURM_JOB_ID % 10000`.
    pub master_port: Option<u16>,
    /// The job's hosts, expanded from `SLURM_JOB_NODELIST` (empty outside Slurm).
    pub nodes: Vec<String>,
    /// The token the job's rendezvous store asks of every client: `KILN_STORE_TOKEN`, or
    /// derived from the job's id and master ([`StoreToken::from_vars`]).
    pub store_token: StoreToken,
}

fn launch_err(variable: impl Into<String>, message: impl Into<String>) -> LaunchError {
    LaunchError::Env {
        variable: variable.into(),
        message: message.into(),
    }
}

impl LaunchEnv {
    /// Reads this process's environment.
    pub fn from_env() -> Result<LaunchEnv> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (for tests, or another source of variables).
    ///
    /// A launcher counts as present when its rank or size variable is set; then all of its
    /// rank, size and local-rank variables must be set and valid, and the rank must be below
    /// the size. Open MPI, PMI and torchrun variables that are all present must agree.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let get = |k: &str| {
            get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let num = |k: &str| -> Result<Option<usize>> {
            get(k)
                .map(|v| {
                    v.parse::<usize>()
                        .map_err(|_| launch_err(format!("{k}={v}"), "not a non-negative integer"))
                })
                .transpose()
        };
        let mut found: Vec<(Launcher, usize, usize, usize, Option<usize>)> = Vec::new();
        for s in &SOURCES {
            let size_var = s.size.iter().find(|k| get(k).is_some()).copied();
            if get(s.rank).is_none() && size_var.is_none() {
                continue;
            }
            let Some(rank) = num(s.rank)? else {
                return Err(launch_err(
                    s.rank,
                    format!("missing, but {} is set ({} launch)", s.size[0], s.launcher),
                ));
            };
            let Some(size_var) = size_var else {
                return Err(launch_err(
                    s.size[0],
                    format!("missing, but {} is set ({} launch)", s.rank, s.launcher),
                ));
            };
            let size = num(size_var)?.unwrap_or(0);
            if size == 0 {
                return Err(launch_err(
                    format!("{size_var}=0"),
                    "a world needs a process",
                ));
            }
            if rank >= size {
                return Err(launch_err(
                    format!("{}={rank}, {size_var}={size}", s.rank),
                    "the rank must be below the world size",
                ));
            }
            let Some(local) = num(s.local_rank)? else {
                return Err(launch_err(
                    s.local_rank,
                    format!("missing, but {} is set ({} launch)", s.rank, s.launcher),
                ));
            };
            let local_size = s.local_size.map(num).transpose()?.flatten();
            if let Some(ls) = local_size {
                if local >= ls {
                    return Err(launch_err(
                        format!(
                            "{}={local}, {}={ls}",
                            s.local_rank,
                            s.local_size.unwrap_or_default()
                        ),
                        "the local rank must be below the local world size",
                    ));
                }
            }
            found.push((s.launcher, rank, size, local, local_size));
        }
        let nodes = match get("SLURM_JOB_NODELIST").or_else(|| get("SLURM_NODELIST")) {
            Some(list) => expand_nodelist(&list)?,
            None => Vec::new(),
        };
        let mut env = match found.first() {
            None => LaunchEnv {
                launcher: Launcher::None,
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: None,
                master_addr: None,
                master_port: None,
                nodes,
                store_token: StoreToken::new("", "unset"),
            },
            Some(&(launcher, rank, world_size, local_rank, local_world_size)) => LaunchEnv {
                launcher,
                rank,
                world_size,
                local_rank,
                local_world_size,
                master_addr: None,
                master_port: None,
                nodes,
                store_token: StoreToken::new("", "unset"),
            },
        };
        // Open MPI, PMI and torchrun each describe the process itself: they must agree.
        // Slurm may describe an outer layer (the srun task that runs mpirun or torchrun).
        let direct: Vec<_> = found.iter().filter(|f| f.0 != Launcher::Slurm).collect();
        if let Some(first) = direct.first() {
            for other in &direct[1..] {
                if (other.1, other.2) != (first.1, first.2) {
                    let var = |l: Launcher| SOURCES.iter().find(|s| s.launcher == l);
                    let (a, b) = (var(first.0), var(other.0));
                    let names = |s: Option<&Source>| s.map_or(("?", "?"), |s| (s.rank, s.size[0]));
                    let ((ar, asz), (br, bsz)) = (names(a), names(b));
                    return Err(launch_err(
                        format!(
                            "{ar}={}, {asz}={} against {br}={}, {bsz}={}",
                            first.1, first.2, other.1, other.2
                        ),
                        format!(
                            "the {} and {} variables describe different processes (a stale \
                             export?)",
                            first.0, other.0
                        ),
                    ));
                }
            }
        }
        env.master_addr = get("MASTER_ADDR");
        env.master_port = match get("MASTER_PORT") {
            Some(p) => Some(p.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| {
                launch_err(format!("MASTER_PORT={p}"), "not a TCP port (1-65535)")
            })?),
            None => None,
        };
        if env.launcher == Launcher::Slurm {
            if env.master_addr.is_none() {
                env.master_addr = env.nodes.first().cloned();
            }
            if env.master_port.is_none() {
                if let Some(job) = num("SLURM_JOB_ID")? {
                    env.master_port = u16::try_from(15_000 + job % 10_000).ok();
                }
            }
        }
        // every process of the job derives the same token from what it was told
        let (addr, port) = (
            env.master_addr.clone(),
            env.master_port.map(|p| p.to_string()),
        );
        env.store_token = StoreToken::from_vars(|k| match k {
            "MASTER_ADDR" => addr.clone(),
            "MASTER_PORT" => port.clone(),
            k => get(k),
        });
        if env.launcher == Launcher::Torchrun && env.world_size > 1 {
            for (k, v) in [
                ("MASTER_ADDR", env.master_addr.is_some()),
                ("MASTER_PORT", env.master_port.is_some()),
            ] {
                if !v {
                    return Err(launch_err(
                        k,
                        format!(
                            "missing in a torchrun-style launch of {} processes",
                            env.world_size
                        ),
                    ));
                }
            }
        }
        Ok(env)
    }

    /// `(MASTER_ADDR, MASTER_PORT)` when both are known.
    pub fn master(&self) -> Option<(&str, u16)> {
        Some((self.master_addr.as_deref()?, self.master_port?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<LaunchEnv> {
        LaunchEnv::from_vars(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn nothing_set_is_one_process() {
        let e = parse(&[]).unwrap();
        assert_eq!(e.launcher, Launcher::None);
        assert_eq!((e.rank, e.world_size, e.local_rank), (0, 1, 0));
        assert_eq!(e.master(), None);
    }

    #[test]
    fn torchrun_variables() {
        let e = parse(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
        assert_eq!((e.rank, e.world_size, e.local_rank), (5, 8, 1));
        assert_eq!(e.local_world_size, Some(4));
        assert_eq!(e.master(), Some(("10.0.0.1", 29500)));
    }

    #[test]
    fn open_mpi_variables_and_slurm_underneath() {
        // mpirun inside an sbatch allocation: Slurm's variables describe the batch step
        let e = parse(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "cn[1-2]"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!((e.rank, e.world_size, e.local_rank), (2, 4, 0));
        assert_eq!(e.nodes, ["cn1", "cn2"]);
    }

    #[test]
    fn pmi_variables() {
        let e = parse(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "3"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "3"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Pmi);
        assert_eq!((e.rank, e.world_size, e.local_rank), (1, 3, 1));
    }

    #[test]
    fn slurm_variables_give_master_from_the_node_list_and_job_id() {
        let e = parse(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_JOB_ID", "123456"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Slurm);
        assert_eq!((e.rank, e.world_size, e.local_rank), (6, 8, 2));
        assert_eq!(e.nodes, ["gpu07", "gpu08"]);
        assert_eq!(e.master(), Some(("gpu07", 18456)));
        // SLURM_NPROCS stands in for SLURM_NTASKS on older Slurm
        let e = parse(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NPROCS", "2"),
            ("SLURM_LOCALID", "0"),
        ])
        .unwrap();
        assert_eq!(e.world_size, 2);
    }

    #[test]
    fn missing_and_bad_variables_are_named() {
        let cases: [(&[(&str, &str)], &str); 9] = [
            (&[("RANK", "0")], "WORLD_SIZE: missing"),
            (&[("WORLD_SIZE", "2")], "RANK: missing"),
            (&[("RANK", "0"), ("WORLD_SIZE", "2")], "LOCAL_RANK: missing"),
            (
                &[("RANK", "x"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
                "RANK=x: not a non-negative integer",
            ),
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
                "RANK=2, WORLD_SIZE=2: the rank must be below",
            ),
            (
                &[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
                "MASTER_ADDR: missing",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "1"),
                    ("LOCAL_RANK", "0"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT=99999: not a TCP port",
            ),
            (
                &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")],
                "SLURM_LOCALID: missing",
            ),
            (
                &[
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "1"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_JOB_NODELIST", "n[1-"),
                ],
                "SLURM_JOB_NODELIST=n[1-",
            ),
        ];
        for (vars, want) in cases {
            let e = parse(vars).unwrap_err().to_string();
            assert!(e.contains(want), "{vars:?}: {e}");
        }
    }

    #[test]
    fn contradicting_launchers_are_an_error_naming_both() {
        let e = parse(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("OMPI_COMM_WORLD_RANK=1"), "{e}");
        assert!(e.contains("RANK=0"), "{e}");
        // the same values agree
        let ok = parse(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
        ]);
        assert_eq!(ok.unwrap().launcher, Launcher::OpenMpi);
    }
}
