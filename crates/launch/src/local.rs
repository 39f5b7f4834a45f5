//! Starting the processes of one node, torchrun-style: [`LocalLaunch`] runs a program once per
//! local rank with the variables [`super::LaunchEnv`] reads (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), waits for them, and when
//! one fails stops the others, so that a dead rank ends the job instead of leaving its peers
//! waiting in a collective. The processes also get the job's rendezvous token
//! (`KILN_STORE_TOKEN`), so that their store admits them and no other job's processes.

use crate::error::{LaunchError, Result};
use crate::token::{StoreToken, STORE_TOKEN_VAR};
use std::ffi::OsString;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// How to start the processes of this node.
#[derive(Debug, Clone)]
pub struct LocalLaunch {
    /// Processes on this node (one per GPU under NCCL).
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes` (ranks `node_rank * nproc_per_node ..`).
    pub node_rank: usize,
    /// Host of rank 0, where the rendezvous store listens.
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// How long the others get to exit after one failed, before they are killed.
    pub grace: Duration,
    /// The token the processes present to the rendezvous store, passed in `KILN_STORE_TOKEN`.
    /// `None`: this process's own `KILN_STORE_TOKEN` when set; else, on a single node, a fresh
    /// random one; across nodes none (each node's launcher would draw another), so the
    /// processes derive theirs from `MASTER_ADDR:MASTER_PORT` and the job id, unless every
    /// node's launcher is given the same token.
    pub store_token: Option<StoreToken>,
}

impl Default for LocalLaunch {
    fn default() -> Self {
        LocalLaunch {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            grace: Duration::from_secs(10),
            store_token: None,
        }
    }
}

/// How the job ended on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// Per local rank: its exit code (`None`: ended by a signal).
    pub codes: Vec<Option<i32>>,
    /// The first rank that failed (global rank) and how, if any.
    pub first_failure: Option<(usize, String)>,
}

impl LaunchOutcome {
    /// True when every process exited with 0.
    pub fn success(&self) -> bool {
        self.first_failure.is_none()
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => "an unknown status".into(),
    }
}

impl LocalLaunch {
    /// Checks the numbers: at least one process and node, the node inside the job.
    pub fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 || self.nnodes == 0 || self.node_rank >= self.nnodes {
            return Err(LaunchError::Env {
                variable: format!(
                    "--nproc-per-node {} --nnodes {} --node-rank {}",
                    self.nproc_per_node, self.nnodes, self.node_rank
                ),
                message: "need at least one process and one node, and node_rank < nnodes".into(),
            });
        }
        Ok(())
    }

    /// The variables of local rank `local`.
    pub fn env_for(&self, local: usize) -> Vec<(&'static str, String)> {
        let world = self.nproc_per_node * self.nnodes;
        vec![
            (
                "RANK",
                (self.node_rank * self.nproc_per_node + local).to_string(),
            ),
            ("WORLD_SIZE", world.to_string()),
            ("LOCAL_RANK", local.to_string()),
            ("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }

    /// The token this launch hands its processes (see [`LocalLaunch::store_token`]).
    pub fn job_token(&self) -> Result<Option<StoreToken>> {
        if let Some(t) = &self.store_token {
            return Ok(Some(t.clone()));
        }
        if let Some(t) = std::env::var(STORE_TOKEN_VAR)
            .ok()
            .filter(|t| !t.is_empty())
        {
            return Ok(Some(StoreToken::new(t, STORE_TOKEN_VAR)));
        }
        if self.nnodes == 1 {
            return StoreToken::random().map(Some);
        }
        Ok(None)
    }

    /// Runs `program args...` once per local rank with its variables ([`LocalLaunch::env_for`]
    /// and the job's token, [`LocalLaunch::job_token`]; the rest of the environment
    /// inherited), and waits. When one process fails (non-zero exit or a signal),
    /// the others get SIGTERM, and SIGKILL after [`LocalLaunch::grace`]; the outcome names the
    /// first failure. A program that cannot be started is an error.
    pub fn run(&self, program: &OsString, args: &[OsString]) -> Result<LaunchOutcome> {
        self.validate()?;
        let token = self.job_token()?;
        let mut children: Vec<Option<Child>> = Vec::with_capacity(self.nproc_per_node);
        for local in 0..self.nproc_per_node {
            let mut cmd = Command::new(program);
            cmd.args(args);
            for (k, v) in self.env_for(local) {
                cmd.env(k, v);
            }
            if let Some(t) = &token {
                cmd.env(STORE_TOKEN_VAR, t.value());
            }
            match cmd.spawn() {
                Ok(c) => children.push(Some(c)),
                Err(e) => {
                    kill_all(&mut children);
                    return Err(LaunchError::Env {
                        variable: format!("program {}", program.to_string_lossy()),
                        message: format!("cannot start local rank {local}: {e}"),
                    });
                }
            }
        }
        let mut codes = vec![None; self.nproc_per_node];
        let mut first_failure: Option<(usize, String)> = None;
        let mut stopping: Option<Instant> = None;
        loop {
            let mut running = 0;
            for (local, slot) in children.iter_mut().enumerate() {
                let Some(child) = slot else { continue };
                match child.try_wait() {
                    Ok(Some(status)) => {
                        codes[local] = status.code();
                        if !status.success() && first_failure.is_none() {
                            let rank = self.node_rank * self.nproc_per_node + local;
                            first_failure = Some((rank, describe(status)));
                        }
                        *slot = None;
                    }
                    Ok(None) => running += 1,
                    Err(e) => {
                        first_failure.get_or_insert((
                            self.node_rank * self.nproc_per_node + local,
                            format!("cannot be waited for: {e}"),
                        ));
                        running += 1;
                    }
                }
            }
            if running == 0 {
                break;
            }
            if first_failure.is_some() {
                let since = *stopping.get_or_insert_with(|| {
                    signal_all(&children, SIGTERM);
                    Instant::now()
                });
                if since.elapsed() >= self.grace {
                    kill_all(&mut children);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(LaunchOutcome {
            codes,
            first_failure,
        })
    }
}

/// SIGTERM: asks a process to exit.
const SIGTERM: i32 = 15;

/// Kills (SIGKILL) what is still running.
fn kill_all(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
    }
}

/// Sends `signal` to every running child (through `kill(1)`: the standard library only sends
/// SIGKILL).
fn signal_all(children: &[Option<Child>], signal: i32) {
    for c in children.iter().flatten() {
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(c.id().to_string())
            .status();
    }
}
