//! What a [`super::Supervisor`] reports: how a child ended ([`ChildExit`]) and the events of a
//! supervised run ([`SuperviseEvent`]), one JSON line each in the events file.

use std::fmt;
use std::process::ExitStatus;
use std::time::{SystemTime, UNIX_EPOCH};

/// How a child process ended: its exit code, or the signal that killed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChildExit {
    /// The exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
}

impl ChildExit {
    /// From a process's status.
    pub fn from_status(status: ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        ChildExit {
            code: status.code(),
            signal: status.signal(),
        }
    }

    /// True for exit code 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// The status a shell reports for it: the exit code, or 128 + the signal.
    ///
    /// ```
    /// use kiln_launch::ChildExit;
    /// let killed = ChildExit { code: None, signal: Some(9) };
    /// assert_eq!((killed.shell_code(), killed.to_string()), (137, "signal 9 (SIGKILL)".into()));
    /// assert_eq!(ChildExit { code: Some(3), signal: None }.shell_code(), 3);
    /// ```
    pub fn shell_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => 1,
        }
    }
}

/// The usual name of a POSIX signal on Linux.
fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => return None,
    })
}

impl fmt::Display for ChildExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.code, self.signal) {
            (Some(c), _) => write!(f, "exit code {c}"),
            (None, Some(s)) => match signal_name(s) {
                Some(n) => write!(f, "signal {s} ({n})"),
                None => write!(f, "signal {s}"),
            },
            (None, None) => f.write_str("an unknown status"),
        }
    }
}

/// One event of a supervised run. The supervisor hands each to its callback
/// ([`super::Supervisor::on_event`]) and writes it as one JSON line to the events file
/// ([`SuperviseEvent::to_json`]); `Display` is the line a person reads.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum SuperviseEvent {
    /// A child was started (attempt 0 is the first launch, attempt `k` the `k`-th restart).
    Start {
        /// The attempt.
        attempt: usize,
        /// The child's process id.
        pid: u32,
        /// The program and its arguments.
        command: Vec<String>,
    },
    /// A child ended.
    Exit {
        /// The attempt.
        attempt: usize,
        /// The child's process id.
        pid: u32,
        /// How it ended.
        exit: ChildExit,
        /// Seconds it ran.
        uptime_s: f64,
        /// The last step record it wrote to the progress file, if any.
        last_step: Option<u64>,
    },
    /// The supervisor is relaunching the run.
    Restart {
        /// This restart's number, from 1.
        restart: usize,
        /// The most restarts allowed.
        max_restarts: usize,
        /// How the previous child ended.
        after: ChildExit,
        /// The data-parallel degree of the relaunch, when it asks for one.
        dp: Option<usize>,
        /// The arguments added to the run's own.
        added: Vec<String>,
    },
    /// The restarted child wrote its first line to the progress file (kiln's trainer writes
    /// its header once the checkpoint is loaded): seconds since the crash was seen.
    Up {
        /// The attempt.
        attempt: usize,
        /// The child's process id.
        pid: u32,
        /// Seconds from the crash to this line.
        since_crash_s: f64,
    },
    /// The restarted child wrote its first step record: the run trains again.
    Recovered {
        /// The attempt.
        attempt: usize,
        /// The child's process id.
        pid: u32,
        /// The step of that record (the resume point + 1 for kiln's trainer).
        step: u64,
        /// Seconds from the crash to this record: the recovery time.
        recovery_s: f64,
    },
    /// The child succeeded; the supervisor exits with its status.
    Done {
        /// Restarts it took.
        restarts: usize,
    },
    /// The supervisor gave up: a failure a restart cannot fix, or the restarts are spent.
    GaveUp {
        /// Restarts made.
        restarts: usize,
        /// How the last child ended.
        exit: ChildExit,
        /// Why, for a person.
        reason: String,
    },
}

impl SuperviseEvent {
    /// The `"event"` name in the events file.
    pub fn name(&self) -> &'static str {
        match self {
            SuperviseEvent::Start { .. } => "start",
            SuperviseEvent::Exit { .. } => "exit",
            SuperviseEvent::Restart { .. } => "restart",
            SuperviseEvent::Up { .. } => "up",
            SuperviseEvent::Recovered { .. } => "recovered",
            SuperviseEvent::Done { .. } => "done",
            SuperviseEvent::GaveUp { .. } => "gave_up",
        }
    }

    /// One JSON object: `"event"`, `"time"` (seconds since the Unix epoch, now) and the
    /// event's fields; an exit as `"code"` and `"signal"` (one of them null).
    ///
    /// ```
    /// use kiln_launch::{ChildExit, SuperviseEvent};
    /// let e = SuperviseEvent::Recovered { attempt: 1, pid: 42, step: 11, recovery_s: 2.5 };
    /// let json = e.to_json();
    /// assert!(json.starts_with(r#"{"event":"recovered","time":"#), "{json}");
    /// assert!(json.ends_with(r#","attempt":1,"pid":42,"step":11,"recovery_s":2.500000}"#), "{json}");
    /// ```
    pub fn to_json(&self) -> String {
        let time = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut o = format!("{{\"event\":\"{}\",\"time\":{time:.6}", self.name());
        let exit = |o: &mut String, e: &ChildExit| {
            o.push_str(&format!(
                ",\"code\":{},\"signal\":{}",
                opt(e.code),
                opt(e.signal)
            ));
        };
        match self {
            SuperviseEvent::Start {
                attempt,
                pid,
                command,
            } => {
                o.push_str(&format!(
                    ",\"attempt\":{attempt},\"pid\":{pid},\"command\":{}",
                    strings(command)
                ));
            }
            SuperviseEvent::Exit {
                attempt,
                pid,
                exit: e,
                uptime_s,
                last_step,
            } => {
                o.push_str(&format!(",\"attempt\":{attempt},\"pid\":{pid}"));
                exit(&mut o, e);
                o.push_str(&format!(
                    ",\"uptime_s\":{uptime_s:.6},\"last_step\":{}",
                    opt(*last_step)
                ));
            }
            SuperviseEvent::Restart {
                restart,
                max_restarts,
                after,
                dp,
                added,
            } => {
                o.push_str(&format!(
                    ",\"restart\":{restart},\"max_restarts\":{max_restarts}"
                ));
                exit(&mut o, after);
                o.push_str(&format!(",\"dp\":{},\"added\":{}", opt(*dp), strings(added)));
            }
            SuperviseEvent::Up {
                attempt,
                pid,
                since_crash_s,
            } => o.push_str(&format!(
                ",\"attempt\":{attempt},\"pid\":{pid},\"since_crash_s\":{since_crash_s:.6}"
            )),
            SuperviseEvent::Recovered {
                attempt,
                pid,
                step,
                recovery_s,
            } => o.push_str(&format!(
                ",\"attempt\":{attempt},\"pid\":{pid},\"step\":{step},\"recovery_s\":{recovery_s:.6}"
            )),
            SuperviseEvent::Done { restarts } => o.push_str(&format!(",\"restarts\":{restarts}")),
            SuperviseEvent::GaveUp {
                restarts,
                exit: e,
                reason,
            } => {
                o.push_str(&format!(",\"restarts\":{restarts}"));
                exit(&mut o, e);
                o.push_str(&format!(",\"reason\":{}", string(reason)));
            }
        }
        o.push('}');
        o
    }
}

impl fmt::Display for SuperviseEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SuperviseEvent::Start {
                attempt,
                pid,
                command,
            } => write!(
                f,
                "attempt {attempt}: started pid {pid}: {}",
                command.join(" ")
            ),
            SuperviseEvent::Exit {
                pid,
                exit,
                uptime_s,
                last_step,
                ..
            } => {
                write!(f, "pid {pid} ended with {exit} after {uptime_s:.1} s")?;
                match last_step {
                    Some(s) => write!(f, " (last step record: {s})"),
                    None => Ok(()),
                }
            }
            SuperviseEvent::Restart {
                restart,
                max_restarts,
                after,
                dp,
                added,
            } => {
                write!(
                    f,
                    "restart {restart} of {max_restarts} after {after}, adding `{}`",
                    added.join(" ")
                )?;
                match dp {
                    Some(d) => write!(f, " (data parallel {d}: the checkpoint reshards on load)"),
                    None => Ok(()),
                }
            }
            SuperviseEvent::Up {
                pid, since_crash_s, ..
            } => write!(
                f,
                "pid {pid} is up {since_crash_s:.2} s after the crash (its first progress line)"
            ),
            SuperviseEvent::Recovered {
                pid,
                step,
                recovery_s,
                ..
            } => write!(
                f,
                "recovered: pid {pid} recorded step {step} {recovery_s:.2} s after the crash"
            ),
            SuperviseEvent::Done { restarts } => {
                write!(f, "the run succeeded after {restarts} restart(s)")
            }
            SuperviseEvent::GaveUp { reason, .. } => f.write_str(reason),
        }
    }
}

fn opt<T: fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "null".to_string(), |v| v.to_string())
}

/// A JSON string literal.
fn string(s: &str) -> String {
    // serializing a str cannot fail
    serde_json::to_string(s).unwrap_or_default()
}

/// A JSON array of string literals.
fn strings(v: &[String]) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_escape_and_name_the_exit() {
        let e = SuperviseEvent::GaveUp {
            restarts: 2,
            exit: ChildExit {
                code: None,
                signal: Some(9),
            },
            reason: "said \"no\"\n\tthen\u{1}".into(),
        };
        let j = e.to_json();
        assert!(
            j.ends_with(
                r#","restarts":2,"code":null,"signal":9,"reason":"said \"no\"\n\tthen\u0001"}"#
            ),
            "{j}"
        );
        let s = SuperviseEvent::Start {
            attempt: 0,
            pid: 7,
            command: vec!["a b".into(), "--x".into()],
        };
        assert!(s.to_json().ends_with(r#""pid":7,"command":["a b","--x"]}"#));
        assert_eq!(s.to_string(), "attempt 0: started pid 7: a b --x");
        let x = ChildExit {
            code: None,
            signal: Some(64),
        };
        assert_eq!((x.to_string(), x.shell_code()), ("signal 64".into(), 192));
    }
}
