//! Liveness of the world's processes on this host: a peer whose process has exited is noticed
//! within a tick instead of at the timeout.

/// The process id of every world rank that runs on this host and was visible at start-up
/// (`None` for ranks elsewhere, or in another process namespace).
#[derive(Debug, Default)]
pub(crate) struct Peers {
    pids: Vec<Option<u32>>,
}

impl Peers {
    /// From every world rank's `(host hash, pid)` as exchanged at start-up.
    pub(crate) fn new(me: usize, ids: &[(u64, u32)]) -> Peers {
        let my_host = ids.get(me).map(|&(h, _)| h);
        let pids = ids
            .iter()
            .enumerate()
            .map(|(r, &(host, pid))| {
                (r != me && Some(host) == my_host && process_alive(pid) == Some(true))
                    .then_some(pid)
            })
            .collect();
        Peers { pids }
    }

    /// False only when world rank `r` runs on this host and its process is gone.
    pub(crate) fn alive(&self, r: usize) -> bool {
        match self.pids.get(r).copied().flatten() {
            Some(pid) => process_alive(pid) != Some(false),
            None => true,
        }
    }
}

/// Whether process `pid` runs (`Some(false)`: gone or a zombie; `None`: cannot tell).
fn process_alive(pid: u32) -> Option<bool> {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // "pid (comm) S ...": the state follows the last ')' (comm may hold parentheses)
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(!matches!(state, 'Z' | 'X' | 'x'))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(false),
        Err(_) => None,
    }
}

/// FNV-1a of a host name: equal names give equal hashes on every rank.
pub(crate) fn host_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_finished_child_is_not() {
        assert_eq!(process_alive(std::process::id()), Some(true));
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = child.id();
        child.wait().expect("wait");
        // reaped: its /proc entry is gone (pid reuse within the test is vanishingly unlikely)
        assert_eq!(process_alive(pid), Some(false));
        let peers = Peers::new(0, &[(host_hash("a"), 1), (host_hash("a"), pid)]);
        assert!(peers.alive(0));
        assert!(
            peers.alive(1),
            "a peer invisible at start-up is never declared dead"
        );
    }
}
