//! A hang watchdog: when no training step completes within a timeout, report every registered
//! communicator's last collective instead of hanging silently.

use crate::{MonitorError, Result};
use kiln_comm::{Communicator, Descriptor};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One communicator's position when the watchdog fired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankCollective {
    /// The communicator's rank.
    pub rank: usize,
    /// Its group size.
    pub world_size: usize,
    /// Its backend (`thread`, `mpi`, `nccl`).
    pub backend: &'static str,
    /// The last collective it entered (`None`: it never called one).
    pub last: Option<Descriptor>,
}

/// What the watchdog saw when it fired.
#[derive(Debug, Clone, PartialEq)]
pub struct HangReport {
    /// The timeout that expired.
    pub timeout: Duration,
    /// Time since the last heartbeat (or the start).
    pub waited: Duration,
    /// The last step that completed (`None`: no heartbeat yet).
    pub last_step: Option<u64>,
    /// Every registered communicator, in registration order.
    pub ranks: Vec<RankCollective>,
}

impl HangReport {
    /// The ranks whose last collective has the lowest sequence number: the ones the others are
    /// waiting for (ranks that never called a collective count lowest). Empty if all agree.
    pub fn laggards(&self) -> Vec<usize> {
        let key = |r: &RankCollective| r.last.map(|d| d.seq as i128).unwrap_or(-1);
        let (Some(lo), Some(hi)) = (
            self.ranks.iter().map(key).min(),
            self.ranks.iter().map(key).max(),
        ) else {
            return Vec::new();
        };
        if lo == hi {
            return Vec::new();
        }
        self.ranks
            .iter()
            .filter(|r| key(r) == lo)
            .map(|r| r.rank)
            .collect()
    }
}

impl fmt::Display for HangReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "hang: no step completed in {:.1?} (timeout {:?})",
            self.waited, self.timeout
        )?;
        match self.last_step {
            Some(s) => write!(f, ", last completed step {s}")?,
            None => write!(f, ", no step completed yet")?,
        }
        for r in &self.ranks {
            write!(f, "; rank {}/{} ({}): ", r.rank, r.world_size, r.backend)?;
            match &r.last {
                Some(d) => write!(f, "last collective {d}")?,
                None => write!(f, "no collective yet")?,
            }
        }
        let lag = self.laggards();
        if !lag.is_empty() {
            write!(f, "; ranks {lag:?} are behind the others")?;
        }
        Ok(())
    }
}

type OnHang = Box<dyn Fn(&HangReport) + Send + Sync>;

struct State {
    last_beat: Instant,
    last_step: Option<u64>,
    report: Option<HangReport>,
    fired_since_beat: bool,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // the state stays consistent under a panicking holder: every update is a plain store
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A background thread that fails the run when no step completes within a timeout.
///
/// The training loop calls [`Watchdog::heartbeat`] after every step. When a timeout passes
/// without one, the watchdog asks every registered communicator for its
/// [`Communicator::last_collective`], builds a [`HangReport`], hands it to the callback (the
/// default prints it to stderr) and stores it: [`Watchdog::check`] then returns
/// [`MonitorError::Hang`]. It fires once per silence; the next heartbeat re-arms it. A callback
/// that must stop a process stuck inside a collective can call `std::process::abort`.
///
/// ```
/// use kiln_monitor::Watchdog;
/// use std::time::Duration;
///
/// let dog = Watchdog::start(Duration::from_secs(600), Vec::new())?;
/// dog.heartbeat(1);
/// assert!(dog.check().is_ok());
/// dog.stop();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching with the default callback (print the report to stderr).
    pub fn start(timeout: Duration, comms: Vec<Arc<dyn Communicator>>) -> Result<Self> {
        Self::start_with(timeout, comms, |r| eprintln!("kiln-monitor watchdog: {r}"))
    }

    /// Starts watching; `on_hang` is called on the watchdog thread with each report.
    pub fn start_with(
        timeout: Duration,
        comms: Vec<Arc<dyn Communicator>>,
        on_hang: impl Fn(&HangReport) + Send + Sync + 'static,
    ) -> Result<Self> {
        if timeout.is_zero() {
            return Err(MonitorError::config("timeout", "a positive duration", "0s"));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                last_beat: Instant::now(),
                last_step: None,
                report: None,
                fired_since_beat: false,
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let on_hang: OnHang = Box::new(on_hang);
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kiln-watchdog".into())
            .spawn(move || watch(&sh, timeout, &comms, &on_hang))?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
        })
    }

    /// Records that `step` completed, re-arming the watchdog.
    pub fn heartbeat(&self, step: u64) {
        let mut st = lock(&self.shared.state);
        st.last_beat = Instant::now();
        st.last_step = Some(step);
        st.fired_since_beat = false;
        drop(st);
        self.shared.wake.notify_all();
    }

    /// `Err(MonitorError::Hang)` once the watchdog has fired (it stays failed).
    pub fn check(&self) -> Result<()> {
        match &lock(&self.shared.state).report {
            Some(r) => Err(MonitorError::Hang(Box::new(r.clone()))),
            None => Ok(()),
        }
    }

    /// The first report, if the watchdog has fired.
    pub fn report(&self) -> Option<HangReport> {
        lock(&self.shared.state).report.clone()
    }

    /// Stops the watchdog thread and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        lock(&self.shared.state).stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            // a panicking callback already printed its message; nothing more to report
            let _ = t.join();
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.shared.state);
        f.debug_struct("Watchdog")
            .field("last_step", &st.last_step)
            .field("fired", &st.report.is_some())
            .finish()
    }
}

fn watch(sh: &Shared, timeout: Duration, comms: &[Arc<dyn Communicator>], on_hang: &OnHang) {
    let mut st = lock(&sh.state);
    loop {
        if st.stop {
            return;
        }
        let waited = st.last_beat.elapsed();
        if !st.fired_since_beat && waited >= timeout {
            st.fired_since_beat = true;
            let last_step = st.last_step;
            drop(st);
            let report = HangReport {
                timeout,
                waited,
                last_step,
                ranks: comms
                    .iter()
                    .map(|c| RankCollective {
                        rank: c.rank(),
                        world_size: c.world_size(),
                        backend: c.backend(),
                        last: c.last_collective(),
                    })
                    .collect(),
            };
            // stored before the callback runs, so a panicking callback cannot lose it
            lock(&sh.state).report.get_or_insert_with(|| report.clone());
            on_hang(&report);
            st = lock(&sh.state);
            continue;
        }
        let wait = if st.fired_since_beat {
            timeout
        } else {
            timeout - waited
        };
        st = sh
            .wake
            .wait_timeout(st, wait)
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
    }
}
