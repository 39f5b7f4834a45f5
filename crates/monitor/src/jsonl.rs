//! The canonical log: one JSON object per line.

use crate::event::Event;
use crate::metrics::StepMetrics;
use crate::sink::MetricSink;
use crate::{MonitorError, Result};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

/// Writes every record as one JSON line (the [`StepMetrics`] schema) and every event as one
/// line with an `"event"` key (the [`Event`] schema). Every line is handed to the file when
/// written (one `write` per step), so a process killed at any point leaves the record of every
/// step it finished, and a supervisor watching the file sees each step as it ends;
/// [`JsonlSink::buffered`] keeps records in a 64 KiB buffer instead (events still flush it).
///
/// ```
/// use kiln_monitor::{JsonlSink, MetricSink, StepMetrics};
/// let mut sink = JsonlSink::from_writer(Vec::new());
/// sink.record(&StepMetrics { loss: Some(2.5), ..StepMetrics::default() })?;
/// assert_eq!(sink.into_inner(), b"{\"step\":0,\"loss\":2.5}\n");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct JsonlSink<W: Write + Send = BufWriter<File>> {
    out: W,
    path: Option<PathBuf>,
    line: Vec<u8>,
    closed: bool,
    buffered: bool,
}

impl JsonlSink<BufWriter<File>> {
    /// Creates (truncates) `path`, creating its parent directories.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        Self::open(path.as_ref(), false)
    }

    /// Appends to `path` (a resumed run continues its log), creating it if needed.
    pub fn append(path: impl AsRef<Path>) -> Result<Self> {
        Self::open(path.as_ref(), true)
    }

    fn open(path: &Path, append: bool) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(MonitorError::file("create directory", dir))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(MonitorError::file("create", path))?;
        Ok(JsonlSink {
            out: BufWriter::with_capacity(64 * 1024, file),
            path: Some(path.to_path_buf()),
            line: Vec::with_capacity(1024),
            closed: false,
            buffered: false,
        })
    }
}

impl<W: Write + Send> JsonlSink<W> {
    /// Writes to any writer (no path in error messages).
    pub fn from_writer(out: W) -> Self {
        JsonlSink {
            out,
            path: None,
            line: Vec::with_capacity(1024),
            closed: false,
            buffered: false,
        }
    }

    /// Keeps records in the buffer until an event, a flush or the close (for logs written
    /// millions of times a second; a kill loses the buffered records).
    pub fn buffered(mut self) -> Self {
        self.buffered = true;
        self
    }

    /// The file written, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Returns the writer (after flushing what the sink holds; a flush error is ignored).
    pub fn into_inner(mut self) -> W {
        let _ = self.out.flush();
        self.out
    }

    fn io(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> MonitorError + '_ {
        move |e| match &self.path {
            Some(p) => MonitorError::File {
                op,
                path: p.clone(),
                source: e,
            },
            None => MonitorError::Io(e),
        }
    }

    fn write_line(&mut self) -> Result<()> {
        if self.closed {
            return Err(MonitorError::Closed { sink: "jsonl" });
        }
        self.line.push(b'\n');
        let r = self.out.write_all(&self.line);
        r.map_err(self.io("write"))
    }
}

impl<W: Write + Send> MetricSink for JsonlSink<W> {
    fn record(&mut self, m: &StepMetrics) -> Result<()> {
        self.line.clear();
        serde_json::to_writer(&mut self.line, m)?;
        self.write_line()?;
        if self.buffered {
            Ok(())
        } else {
            self.flush()
        }
    }

    fn event(&mut self, e: &Event) -> Result<()> {
        self.line.clear();
        serde_json::to_writer(&mut self.line, e)?;
        self.write_line()?;
        self.flush()
    }

    fn flush(&mut self) -> Result<()> {
        let r = self.out.flush();
        r.map_err(self.io("flush"))
    }

    fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.flush()?;
        self.closed = true;
        Ok(())
    }
}

/// One parsed line of a JSONL log.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // parsed once per line when reading a log back
pub enum JsonlLine {
    /// A step record.
    Step(StepMetrics),
    /// An event (the line has an `"event"` key).
    Event(Event),
}

impl JsonlLine {
    /// Parses one line.
    pub fn parse(line: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(line)?;
        if v.get("event").is_some() {
            Ok(JsonlLine::Event(serde_json::from_value(v)?))
        } else {
            Ok(JsonlLine::Step(serde_json::from_value(v)?))
        }
    }
}

/// Reads a JSONL log back: its step records and its events, each in file order. Blank lines
/// are skipped.
pub fn read_jsonl(path: impl AsRef<Path>) -> Result<(Vec<StepMetrics>, Vec<Event>)> {
    let path = path.as_ref();
    let file = File::open(path).map_err(MonitorError::file("open", path))?;
    let mut steps = Vec::new();
    let mut events = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line.map_err(MonitorError::file("read", path))?;
        if line.trim().is_empty() {
            continue;
        }
        match JsonlLine::parse(&line)? {
            JsonlLine::Step(m) => steps.push(m),
            JsonlLine::Event(e) => events.push(e),
        }
    }
    Ok((steps, events))
}
