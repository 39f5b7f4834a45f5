//! The [`MetricSink`] trait and the [`MultiSink`] fan-out.

use crate::event::Event;
use crate::metrics::StepMetrics;
use crate::Result;

/// Somewhere step records and events go: a file, the console, TensorBoard, a plot.
///
/// Sinks are called on the training thread every step, so `record` must be cheap (buffered
/// writes, no syscalls per record where avoidable). `close` flushes and finalises (the plot is
/// drawn there); calling it twice is harmless, and using a sink after it is an error.
pub trait MetricSink: Send {
    /// Records one step.
    fn record(&mut self, m: &StepMetrics) -> Result<()>;
    /// Records an alert or a breaker action.
    fn event(&mut self, e: &Event) -> Result<()>;
    /// Pushes buffered data to its destination.
    fn flush(&mut self) -> Result<()>;
    /// Flushes and finalises.
    fn close(&mut self) -> Result<()>;
    /// Records several events (a [`crate::Decision`]'s), all of them even if one fails; returns
    /// the first error.
    fn events(&mut self, events: &[Event]) -> Result<()> {
        let mut first = Ok(());
        for e in events {
            let r = self.event(e);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl<S: MetricSink + ?Sized> MetricSink for Box<S> {
    fn record(&mut self, m: &StepMetrics) -> Result<()> {
        (**self).record(m)
    }
    fn event(&mut self, e: &Event) -> Result<()> {
        (**self).event(e)
    }
    fn flush(&mut self) -> Result<()> {
        (**self).flush()
    }
    fn close(&mut self) -> Result<()> {
        (**self).close()
    }
}

/// Sends everything to several sinks. Every sink is called even when an earlier one fails;
/// the first error is returned.
#[derive(Default)]
pub struct MultiSink {
    sinks: Vec<Box<dyn MetricSink>>,
}

impl MultiSink {
    /// An empty fan-out.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a sink.
    pub fn with(mut self, sink: impl MetricSink + 'static) -> Self {
        self.sinks.push(Box::new(sink));
        self
    }

    /// Adds a boxed sink.
    pub fn push(&mut self, sink: Box<dyn MetricSink>) {
        self.sinks.push(sink);
    }

    /// Number of sinks.
    pub fn len(&self) -> usize {
        self.sinks.len()
    }

    /// True when there is no sink.
    pub fn is_empty(&self) -> bool {
        self.sinks.is_empty()
    }

    fn each(&mut self, mut f: impl FnMut(&mut dyn MetricSink) -> Result<()>) -> Result<()> {
        let mut first = Ok(());
        for s in &mut self.sinks {
            let r = f(s.as_mut());
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl MetricSink for MultiSink {
    fn record(&mut self, m: &StepMetrics) -> Result<()> {
        self.each(|s| s.record(m))
    }
    fn event(&mut self, e: &Event) -> Result<()> {
        self.each(|s| s.event(e))
    }
    fn flush(&mut self) -> Result<()> {
        self.each(|s| s.flush())
    }
    fn close(&mut self) -> Result<()> {
        self.each(|s| s.close())
    }
}

impl std::fmt::Debug for MultiSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiSink")
            .field("sinks", &self.sinks.len())
            .finish()
    }
}
