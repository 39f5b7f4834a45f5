//! Elastic restarts, torchrun's `--max-restarts`: [`Supervisor`] runs a training command,
//! and when it dies abnormally relaunches it with `--resume` (and, if asked, a smaller
//! data-parallel degree), up to a number of times, timing each recovery from the crash to the
//! first step the relaunched run records.
//!
//! Which endings are restarted ([`SupervisorConfig::decide`]):
//! - exit code 0: done, nothing more to do;
//! - killed by a signal (SIGKILL, the OOM killer, SIGSEGV, a scheduler's SIGTERM): restart;
//! - an exit code in [`SupervisorConfig::fatal_codes`] (default 2, 64 and 78: the usage and
//!   configuration errors of `sysexits.h` and of most command lines): give up at once;
//! - an exit code in [`SupervisorConfig::retry_codes`] (default 75, `EX_TEMPFAIL`, which is
//!   also kiln's hang watchdog's status): restart;
//! - any other non-zero code: restart, unless a progress file is watched and the child wrote
//!   nothing to it. A child that fails before its first line there (kiln's trainer writes its
//!   header once the configuration is valid, the data is ready and the checkpoint is loaded)
//!   failed at start-up, as a bad flag, a refused configuration or an unloadable checkpoint
//!   does, and a restart would fail the same way.

use super::events::{ChildExit, SuperviseEvent};
use super::progress::{ProgressLine, ProgressWatcher};
use crate::error::{LaunchError, Result};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// What the supervisor runs and how it restarts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisorConfig {
    /// The program (kiln's `train_gpt`, or anything that resumes from its own checkpoints).
    pub program: OsString,
    /// Its arguments on the first launch; a restart adds to these.
    pub args: Vec<OsString>,
    /// The most relaunches (0: never restart).
    pub max_restarts: usize,
    /// Arguments added on every restart (default `--resume`; not added again when the
    /// arguments already hold them).
    pub resume_args: Vec<OsString>,
    /// Data-parallel degrees for the restarts: restart `k` (from 1) runs at `restart_dp[k-1]`,
    /// or the last entry when there are fewer; empty keeps the command's own degree.
    pub restart_dp: Vec<usize>,
    /// The flag that sets the data-parallel degree (default `--dp`; added after the other
    /// arguments, so it wins for a command whose flags apply in order).
    pub dp_flag: OsString,
    /// The run's progress file (kiln's `<out>/metrics.jsonl`), for the recovery time and
    /// for telling a start-up failure from a crash.
    pub progress: Option<PathBuf>,
    /// Where to write the events, one JSON line each (created, or truncated).
    pub events: Option<PathBuf>,
    /// Exit codes never restarted.
    pub fatal_codes: Vec<i32>,
    /// Exit codes always restarted.
    pub retry_codes: Vec<i32>,
    /// How often the child and the progress file are looked at.
    pub poll: Duration,
    /// A pause before each relaunch.
    pub restart_delay: Duration,
}

impl SupervisorConfig {
    /// `program args...` with the defaults: 3 restarts, `--resume`, the same dp, no progress
    /// or events file, fatal codes 2, 64 and 78, retry code 75, a 5 ms poll, no delay.
    pub fn new<S: AsRef<OsStr>>(program: impl AsRef<OsStr>, args: &[S]) -> Self {
        SupervisorConfig {
            program: program.as_ref().to_os_string(),
            args: args.iter().map(|a| a.as_ref().to_os_string()).collect(),
            max_restarts: 3,
            resume_args: vec!["--resume".into()],
            restart_dp: Vec::new(),
            dp_flag: "--dp".into(),
            progress: None,
            events: None,
            fatal_codes: vec![2, 64, 78],
            retry_codes: vec![75],
            poll: Duration::from_millis(5),
            restart_delay: Duration::ZERO,
        }
    }

    /// The data-parallel degree of restart `restart` (from 1), if any.
    pub fn dp_for(&self, restart: usize) -> Option<usize> {
        self.restart_dp
            .get(restart.saturating_sub(1))
            .or(self.restart_dp.last())
            .copied()
    }

    /// What to do after a child ended with `exit`; `wrote_progress` says whether it wrote
    /// anything to the progress file (`None`: no progress file is watched). See the module
    /// documentation for the rules.
    ///
    /// ```
    /// use kiln_launch::{ChildExit, RestartDecision, SupervisorConfig};
    /// let mut cfg = SupervisorConfig::new("train_gpt", &["--out", "runs/a"]);
    /// cfg.progress = Some("runs/a/metrics.jsonl".into());
    /// let code = |c| ChildExit { code: Some(c), signal: None };
    /// let killed = ChildExit { code: None, signal: Some(9) };
    /// assert_eq!(cfg.decide(killed, Some(false)), RestartDecision::Restart);
    /// assert_eq!(cfg.decide(code(0), None), RestartDecision::Done);
    /// assert_eq!(cfg.decide(code(1), Some(true)), RestartDecision::Restart);
    /// assert!(matches!(cfg.decide(code(1), Some(false)), RestartDecision::GiveUp(_)));
    /// assert!(matches!(cfg.decide(code(78), Some(true)), RestartDecision::GiveUp(_)));
    /// assert_eq!(cfg.decide(code(75), Some(false)), RestartDecision::Restart);
    /// ```
    pub fn decide(&self, exit: ChildExit, wrote_progress: Option<bool>) -> RestartDecision {
        let Some(code) = exit.code else {
            return RestartDecision::Restart;
        };
        if code == 0 {
            return RestartDecision::Done;
        }
        if self.fatal_codes.contains(&code) {
            return RestartDecision::GiveUp(format!(
                "the run ended with {exit}, a usage or configuration error (fatal codes {:?}): \
                 a restart would fail the same way",
                self.fatal_codes
            ));
        }
        if self.retry_codes.contains(&code) {
            return RestartDecision::Restart;
        }
        match (wrote_progress, &self.progress) {
            (Some(false), Some(p)) => RestartDecision::GiveUp(format!(
                "the run ended with {exit} before writing anything to {}: a configuration or \
                 start-up error, which a restart would repeat (its output above says what)",
                p.display()
            )),
            _ => RestartDecision::Restart,
        }
    }

    /// The arguments restart `restart` (from 1) adds to [`SupervisorConfig::args`] before
    /// any hook's: the resume arguments, then the dp flag.
    pub fn restart_args(&self, restart: usize) -> Vec<OsString> {
        let mut added = Vec::new();
        let r = &self.resume_args;
        let present = !r.is_empty() && self.args.windows(r.len()).any(|w| w == &r[..]);
        if !present {
            added.extend(r.iter().cloned());
        }
        if let Some(dp) = self.dp_for(restart) {
            added.push(self.dp_flag.clone());
            added.push(dp.to_string().into());
        }
        added
    }
}

/// What the supervisor does after a child ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RestartDecision {
    /// It succeeded: stop.
    Done,
    /// It crashed: relaunch (if restarts are left).
    Restart,
    /// It failed in a way a restart cannot fix: stop, with this reason.
    GiveUp(String),
}

/// One launch of the command.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    /// The child's process id.
    pub pid: u32,
    /// The arguments it ran with.
    pub args: Vec<OsString>,
    /// How it ended.
    pub exit: ChildExit,
    /// Seconds it ran.
    pub uptime_s: f64,
    /// Its first and last step records in the progress file.
    pub steps: Option<(u64, u64)>,
    /// For a restart: seconds from the crash to its first progress line.
    pub up_s: Option<f64>,
    /// For a restart: seconds from the crash to its first step record (the recovery time).
    pub recovery_s: Option<f64>,
}

/// How supervision ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SuperviseEnd {
    /// The command succeeded.
    Succeeded,
    /// It failed in a way a restart cannot fix.
    Failed(String),
    /// It crashed once more with no restart left.
    Exhausted(String),
}

/// Everything a supervised run did.
#[derive(Debug, Clone, PartialEq)]
pub struct SuperviseOutcome {
    /// Every launch, the first one first.
    pub attempts: Vec<Attempt>,
    /// How it ended.
    pub end: SuperviseEnd,
}

impl SuperviseOutcome {
    /// True when the command finally succeeded.
    pub fn success(&self) -> bool {
        self.end == SuperviseEnd::Succeeded
    }

    /// The restarts made.
    pub fn restarts(&self) -> usize {
        self.attempts.len().saturating_sub(1)
    }

    /// The status to exit with: the last child's on success or a fatal error (128 + signal
    /// for a signal), and at least 1 when the run did not succeed.
    pub fn exit_code(&self) -> i32 {
        let last = self.attempts.last().map_or(1, |a| a.exit.shell_code());
        if self.success() {
            last
        } else {
            last.max(1)
        }
    }
}

/// The callback that receives every event.
type EventHook = Box<dyn FnMut(&SuperviseEvent) + Send>;
/// The callback that adds arguments to a restart.
type ArgsHook = Box<dyn FnMut(usize, &ChildExit) -> Vec<OsString> + Send>;

/// Runs a command and relaunches it after crashes ([`SupervisorConfig`]), recording each
/// start, exit, restart and recovery.
///
/// ```no_run
/// use kiln_launch::{Supervisor, SupervisorConfig};
/// let mut cfg = SupervisorConfig::new("target/release/examples/train_gpt", &["--out", "runs/a"]);
/// cfg.max_restarts = 2;
/// cfg.restart_dp = vec![1]; // after a crash, continue on one data-parallel rank
/// cfg.progress = Some("runs/a/metrics.jsonl".into());
/// let outcome = Supervisor::new(cfg).on_event(|e| eprintln!("supervise: {e}")).run()?;
/// std::process::exit(outcome.exit_code());
/// # Ok::<(), kiln_launch::LaunchError>(())
/// ```
pub struct Supervisor {
    cfg: SupervisorConfig,
    on_event: Option<EventHook>,
    extra_args: Option<ArgsHook>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// The events file and the callback.
struct Log<'a> {
    file: Option<File>,
    hook: Option<&'a mut EventHook>,
    path: Option<PathBuf>,
}

impl Log<'_> {
    fn emit(&mut self, e: SuperviseEvent) -> Result<()> {
        if let Some(h) = self.hook.as_mut() {
            h(&e);
        }
        if let (Some(f), Some(p)) = (self.file.as_mut(), &self.path) {
            writeln!(f, "{}", e.to_json())
                .and_then(|()| f.flush())
                .map_err(|err| LaunchError::Env {
                    variable: format!("events file {}", p.display()),
                    message: format!("cannot write: {err}"),
                })?;
        }
        Ok(())
    }
}

/// What the progress file said about the running attempt.
struct Seen {
    attempt: usize,
    any_line: bool,
    steps: Option<(u64, u64)>,
    up_s: Option<f64>,
    recovery_s: Option<f64>,
}

impl Supervisor {
    /// A supervisor of `cfg`.
    pub fn new(cfg: SupervisorConfig) -> Self {
        Supervisor {
            cfg,
            on_event: None,
            extra_args: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SupervisorConfig {
        &self.cfg
    }

    /// Calls `f` with every event as it happens (the command line prints them).
    pub fn on_event(mut self, f: impl FnMut(&SuperviseEvent) + Send + 'static) -> Self {
        self.on_event = Some(Box::new(f));
        self
    }

    /// Calls `f(restart, how_the_last_child_ended)` before each relaunch; what it returns is
    /// added after the resume and dp arguments (another batch shape for a smaller dp, a
    /// different checkpoint to resume from, ...).
    pub fn restart_args_with(
        mut self,
        f: impl FnMut(usize, &ChildExit) -> Vec<OsString> + Send + 'static,
    ) -> Self {
        self.extra_args = Some(Box::new(f));
        self
    }

    /// Runs the command to its end, restarting it as configured. Errors are the supervisor's
    /// own (the program cannot be started, the events file cannot be written; a running
    /// child is killed first); how the command ended is the outcome.
    pub fn run(&mut self) -> Result<SuperviseOutcome> {
        let file = match &self.cfg.events {
            None => None,
            Some(p) => Some(File::create(p).map_err(|e| LaunchError::Env {
                variable: format!("events file {}", p.display()),
                message: format!("cannot create: {e}"),
            })?),
        };
        let mut log = Log {
            file,
            path: self.cfg.events.clone(),
            hook: self.on_event.as_mut(),
        };
        let cfg = &self.cfg;
        let mut watcher = cfg.progress.as_ref().map(ProgressWatcher::new);
        let mut attempts: Vec<Attempt> = Vec::new();
        let mut args = cfg.args.clone();
        let mut crashed: Option<Instant> = None;
        loop {
            let attempt = attempts.len();
            if let Some(w) = watcher.as_mut() {
                w.skip_to_end();
            }
            let mut child = Command::new(&cfg.program)
                .args(&args)
                .spawn()
                .map_err(|e| LaunchError::Env {
                    variable: format!("program {}", cfg.program.to_string_lossy()),
                    message: format!("cannot start it: {e}"),
                })?;
            let pid = child.id();
            let started = Instant::now();
            let mut seen = Seen {
                attempt,
                any_line: false,
                steps: None,
                up_s: None,
                recovery_s: None,
            };
            let watched = (|| {
                let mut command = vec![cfg.program.to_string_lossy().into_owned()];
                command.extend(args.iter().map(|a| a.to_string_lossy().into_owned()));
                log.emit(SuperviseEvent::Start {
                    attempt,
                    pid,
                    command,
                })?;
                watch(
                    cfg,
                    &mut child,
                    watcher.as_mut(),
                    &mut seen,
                    crashed,
                    &mut log,
                )
            })();
            let exit = match watched {
                Ok(exit) => exit,
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(e);
                }
            };
            let ended = Instant::now();
            let uptime_s = ended.duration_since(started).as_secs_f64();
            log.emit(SuperviseEvent::Exit {
                attempt,
                pid,
                exit,
                uptime_s,
                last_step: seen.steps.map(|(_, last)| last),
            })?;
            attempts.push(Attempt {
                pid,
                args: args.clone(),
                exit,
                uptime_s,
                steps: seen.steps,
                up_s: seen.up_s,
                recovery_s: seen.recovery_s,
            });
            let restarts = attempt;
            let end = match cfg.decide(exit, watcher.as_ref().map(|_| seen.any_line)) {
                RestartDecision::Done => {
                    log.emit(SuperviseEvent::Done { restarts })?;
                    SuperviseEnd::Succeeded
                }
                RestartDecision::GiveUp(reason) => {
                    log.emit(SuperviseEvent::GaveUp {
                        restarts,
                        exit,
                        reason: reason.clone(),
                    })?;
                    SuperviseEnd::Failed(reason)
                }
                RestartDecision::Restart if restarts >= cfg.max_restarts => {
                    let reason = format!(
                        "the run ended with {exit} and all {} restart(s) are spent \
                         (--max-restarts {}): giving up",
                        cfg.max_restarts, cfg.max_restarts
                    );
                    log.emit(SuperviseEvent::GaveUp {
                        restarts,
                        exit,
                        reason: reason.clone(),
                    })?;
                    SuperviseEnd::Exhausted(reason)
                }
                RestartDecision::Restart => {
                    let restart = restarts + 1;
                    crashed = Some(ended);
                    let mut added = cfg.restart_args(restart);
                    if let Some(h) = self.extra_args.as_mut() {
                        added.extend(h(restart, &exit));
                    }
                    log.emit(SuperviseEvent::Restart {
                        restart,
                        max_restarts: cfg.max_restarts,
                        after: exit,
                        dp: cfg.dp_for(restart),
                        added: added
                            .iter()
                            .map(|a| a.to_string_lossy().into_owned())
                            .collect(),
                    })?;
                    args = cfg.args.clone();
                    args.extend(added);
                    std::thread::sleep(cfg.restart_delay);
                    continue;
                }
            };
            return Ok(SuperviseOutcome { attempts, end });
        }
    }
}

/// Polls the child and the progress file until the child ends.
fn watch(
    cfg: &SupervisorConfig,
    child: &mut Child,
    mut watcher: Option<&mut ProgressWatcher>,
    seen: &mut Seen,
    crashed: Option<Instant>,
    log: &mut Log<'_>,
) -> Result<ChildExit> {
    let pid = child.id();
    loop {
        // read the progress first, so that lines written just before an exit are seen
        let status = child.try_wait().map_err(|e| LaunchError::Env {
            variable: format!("child {pid}"),
            message: format!("cannot wait for it: {e}"),
        })?;
        if let Some(w) = watcher.as_deref_mut() {
            let lines = w.poll();
            observe(&lines, seen, crashed, log, pid)?;
        }
        if let Some(s) = status {
            return Ok(ChildExit::from_status(s));
        }
        std::thread::sleep(cfg.poll);
    }
}

/// Notes the progress lines of the running attempt; the first line and the first step record
/// after a crash are the `up` and `recovered` events.
fn observe(
    lines: &[ProgressLine],
    seen: &mut Seen,
    crashed: Option<Instant>,
    log: &mut Log<'_>,
    pid: u32,
) -> Result<()> {
    for l in lines {
        if !seen.any_line {
            seen.any_line = true;
            if let Some(c) = crashed {
                let since_crash_s = c.elapsed().as_secs_f64();
                seen.up_s = Some(since_crash_s);
                log.emit(SuperviseEvent::Up {
                    attempt: seen.attempt,
                    pid,
                    since_crash_s,
                })?;
            }
        }
        if let Some(step) = l.record_step() {
            let first = seen.steps.map_or(step, |(f, _)| f);
            if seen.steps.is_none() {
                if let Some(c) = crashed {
                    let recovery_s = c.elapsed().as_secs_f64();
                    seen.recovery_s = Some(recovery_s);
                    log.emit(SuperviseEvent::Recovered {
                        attempt: seen.attempt,
                        pid,
                        step,
                        recovery_s,
                    })?;
                }
            }
            seen.steps = Some((first, step));
        }
    }
    Ok(())
}
