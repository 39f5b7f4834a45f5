//! The console: a progress bar on a terminal, plain lines otherwise.

use crate::event::Event;
use crate::metrics::StepMetrics;
use crate::sink::MetricSink;
use crate::{MonitorError, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::fmt::Write as _;
use std::io::{IsTerminal, Write};

enum Mode {
    Bar(ProgressBar),
    Lines(Box<dyn Write + Send>),
}

/// Progress for a person watching: on a terminal an `indicatif` bar with the step, loss,
/// tokens/s and learning rate (redrawn at most 10 times a second); elsewhere (a log file, CI)
/// one plain line every `every` steps. Events are always printed, one line each.
///
/// ```
/// use kiln_monitor::{ConsoleSink, StepMetrics};
/// let m = StepMetrics { step: 100, loss: Some(2.34567), tokens_per_s: Some(3612.4), ..StepMetrics::default() };
/// assert_eq!(ConsoleSink::format_line(&m), "step 100 | loss 2.3457 | 3612 tok/s");
/// ```
pub struct ConsoleSink {
    mode: Mode,
    every: u64,
    msg: String,
    closed: bool,
}

impl ConsoleSink {
    /// A bar on stderr when it is a terminal, plain lines on stderr every `every` steps
    /// otherwise. `total_steps` sizes the bar (a spinner without it).
    pub fn new(total_steps: Option<u64>, every: u64) -> Self {
        if std::io::stderr().is_terminal() {
            let bar = match total_steps {
                Some(n) => ProgressBar::new(n),
                None => ProgressBar::new_spinner(),
            };
            bar.set_draw_target(ProgressDrawTarget::stderr_with_hz(10));
            Self::with_bar(bar, every)
        } else {
            Self::lines(std::io::stderr(), every)
        }
    }

    /// Plain lines to `out` every `every` steps (0 is taken as 1).
    pub fn lines(out: impl Write + Send + 'static, every: u64) -> Self {
        ConsoleSink {
            mode: Mode::Lines(Box::new(out)),
            every: every.max(1),
            msg: String::new(),
            closed: false,
        }
    }

    /// Drives a bar the caller made (a hidden one in benchmarks, one of a `MultiProgress`).
    pub fn with_bar(bar: ProgressBar, every: u64) -> Self {
        let template = "{elapsed_precise} [{wide_bar:.cyan/blue}] {pos}/{len} {msg}";
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        ConsoleSink {
            mode: Mode::Bar(bar),
            every: every.max(1),
            msg: String::new(),
            closed: false,
        }
    }

    /// True when it draws a progress bar.
    pub fn is_bar(&self) -> bool {
        matches!(self.mode, Mode::Bar(_))
    }

    /// The plain line for a record: the step, then whichever of loss, gradient norm, learning
    /// rate, loss scale, tokens/s, step time and MFU are set.
    pub fn format_line(m: &StepMetrics) -> String {
        let mut s = String::with_capacity(128);
        let _ = write!(s, "step {}", m.step);
        Self::push_fields(&mut s, m);
        s
    }

    fn push_fields(s: &mut String, m: &StepMetrics) {
        if let Some(v) = m.loss {
            let _ = write!(s, " | loss {v:.4}");
        }
        if let Some(v) = m.grad_norm {
            let _ = write!(s, " | grad_norm {v:.3}");
        }
        if let Some(v) = m.lr {
            let _ = write!(s, " | lr {v:.2e}");
        }
        if let Some(v) = m.loss_scale {
            let _ = write!(s, " | scale {v}");
        }
        if let Some(v) = m.tokens_per_s {
            let _ = write!(s, " | {v:.0} tok/s");
        }
        if let Some(v) = m.step_time_s {
            let _ = write!(s, " | {:.1} ms/step", v * 1e3);
        }
        if let Some(v) = m.mfu {
            let _ = write!(s, " | mfu {:.1}%", v * 100.0);
        }
    }

    fn check_open(&self) -> Result<()> {
        if self.closed {
            Err(MonitorError::Closed { sink: "console" })
        } else {
            Ok(())
        }
    }
}

impl MetricSink for ConsoleSink {
    fn record(&mut self, m: &StepMetrics) -> Result<()> {
        self.check_open()?;
        match &mut self.mode {
            Mode::Bar(bar) => {
                bar.set_position(m.step);
                self.msg.clear();
                if let Some(v) = m.loss {
                    let _ = write!(self.msg, "loss {v:.4}");
                }
                if let Some(v) = m.tokens_per_s {
                    let _ = write!(self.msg, " | {v:.0} tok/s");
                }
                if let Some(v) = m.lr {
                    let _ = write!(self.msg, " | lr {v:.2e}");
                }
                bar.set_message(self.msg.clone());
            }
            Mode::Lines(out) => {
                if m.step % self.every == 0 {
                    writeln!(out, "{}", Self::format_line(m))?;
                }
            }
        }
        Ok(())
    }

    fn event(&mut self, e: &Event) -> Result<()> {
        self.check_open()?;
        match &mut self.mode {
            Mode::Bar(bar) => bar.println(e.to_string()),
            Mode::Lines(out) => writeln!(out, "{e}")?,
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        match &mut self.mode {
            Mode::Bar(bar) => bar.tick(),
            Mode::Lines(out) => out.flush()?,
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.flush()?;
        if let Mode::Bar(bar) = &self.mode {
            bar.finish();
        }
        self.closed = true;
        Ok(())
    }
}

impl std::fmt::Debug for ConsoleSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleSink")
            .field("bar", &self.is_bar())
            .field("every", &self.every)
            .finish()
    }
}
