//! Watching a run's progress from outside: [`ProgressWatcher`] follows a JSONL file that a
//! training process appends to (kiln's `metrics.jsonl`: one step record per line, events as
//! lines with an `"event"` key) and reports the lines added since it last looked, so a
//! supervisor can tell when a restarted run has trained its first step.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// One complete line appended to the progress file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgressLine {
    /// The line's top-level `"step"`, when it has a whole number there.
    pub step: Option<u64>,
    /// True for an event line (a top-level `"event"` key); a step record has none.
    pub is_event: bool,
}

impl ProgressLine {
    /// The step of a step record (a line with a `"step"` and no `"event"`).
    pub fn record_step(&self) -> Option<u64> {
        self.step.filter(|_| !self.is_event)
    }

    /// Reads the top-level `"step"` and whether there is an `"event"` key from one JSON object
    /// line, without a JSON library. Nested objects and strings are skipped.
    ///
    /// ```
    /// use kiln_launch::ProgressLine;
    /// let l = ProgressLine::parse(r#"{"step":12,"loss":2.5,"extra":{"step":3}}"#);
    /// assert_eq!(l.record_step(), Some(12));
    /// let e = ProgressLine::parse(r#"{"event":"info","step":10,"message":"a \"step\": 4"}"#);
    /// assert_eq!((e.step, e.is_event, e.record_step()), (Some(10), true, None));
    /// ```
    pub fn parse(line: &str) -> ProgressLine {
        let b = line.as_bytes();
        let mut out = ProgressLine {
            step: None,
            is_event: false,
        };
        let (mut depth, mut i) = (0usize, 0usize);
        // the key of the top-level value that follows, once its ':' is seen
        let mut key: Option<(usize, usize)> = None;
        let mut expect_key = false;
        while i < b.len() {
            match b[i] {
                b'"' => {
                    let start = i + 1;
                    i = start;
                    while i < b.len() && b[i] != b'"' {
                        i += if b[i] == b'\\' { 2 } else { 1 };
                    }
                    if depth == 1 && expect_key {
                        key = Some((start, i.min(b.len())));
                        expect_key = false;
                    }
                }
                b'{' | b'[' => {
                    depth += 1;
                    expect_key = depth == 1 && b[i] == b'{';
                }
                b'}' | b']' => depth = depth.saturating_sub(1),
                b',' if depth == 1 => expect_key = true,
                b':' if depth == 1 => {
                    if let Some((s, e)) = key.take() {
                        match &line[s..e] {
                            "event" => out.is_event = true,
                            "step" => {
                                let rest = line[i + 1..].trim_start();
                                let digits: &str = rest
                                    .find(|c: char| !c.is_ascii_digit())
                                    .map_or(rest, |n| &rest[..n]);
                                out.step = digits.parse().ok();
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
            i += 1;
        }
        out
    }
}

/// Follows a file that another process appends lines to.
///
/// [`ProgressWatcher::poll`] returns the complete lines added since the last call (a partial
/// last line waits for its newline). [`ProgressWatcher::skip_to_end`] forgets everything
/// written so far, so that after a restart only the new process's lines count (and a line
/// the killed process left unfinished is never read). A file that shrank was recreated: it is
/// read again from its start. A missing file is no lines.
///
/// ```
/// use kiln_launch::ProgressWatcher;
/// use std::io::Write;
/// let path = std::env::temp_dir().join(format!("kiln-progress-doc-{}.jsonl", std::process::id()));
/// std::fs::write(&path, "{\"step\":1}\n")?;
/// let mut w = ProgressWatcher::new(&path);
/// w.skip_to_end();
/// let mut f = std::fs::OpenOptions::new().append(true).open(&path)?;
/// write!(f, "{{\"event\":\"info\",\"step\":1}}\n{{\"step\":2}}\n{{\"ste")?;
/// let lines = w.poll();
/// assert_eq!(lines.iter().map(|l| l.record_step()).collect::<Vec<_>>(), [None, Some(2)]);
/// std::fs::remove_file(&path)?;
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ProgressWatcher {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl ProgressWatcher {
    /// Watches `path` from its start.
    pub fn new(path: impl AsRef<Path>) -> Self {
        ProgressWatcher {
            path: path.as_ref().to_path_buf(),
            offset: 0,
            partial: Vec::new(),
        }
    }

    /// The file watched.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Ignores everything the file holds now, an unfinished last line included.
    pub fn skip_to_end(&mut self) {
        self.offset = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        self.partial.clear();
    }

    /// The complete lines appended since the last call. Read errors (the file is being
    /// replaced, or does not exist yet) are no lines: the next call tries again.
    pub fn poll(&mut self) -> Vec<ProgressLine> {
        let Ok(mut f) = File::open(&self.path) else {
            return Vec::new();
        };
        let len = f.metadata().map_or(0, |m| m.len());
        if len < self.offset {
            self.offset = 0;
            self.partial.clear();
        }
        if len == self.offset || f.seek(SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut buf = Vec::new();
        let Ok(n) = f.take(len - self.offset).read_to_end(&mut buf) else {
            return Vec::new();
        };
        self.offset += n as u64;
        self.partial.extend_from_slice(&buf);
        let Some(last_nl) = self.partial.iter().rposition(|&c| c == b'\n') else {
            return Vec::new();
        };
        let rest = self.partial.split_off(last_nl + 1);
        let done = std::mem::replace(&mut self.partial, rest);
        String::from_utf8_lossy(&done)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(ProgressLine::parse)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_records_and_events() {
        let cases = [
            (r#"{"step":7}"#, Some(7), false),
            (
                r#"{ "loss": 1.0, "step" : 42 , "x":[1,{"step":9}]}"#,
                Some(42),
                false,
            ),
            (r#"{"nested":{"step":3},"loss":2}"#, None, false),
            (r#"{"event":"checkpoint","step":10}"#, Some(10), true),
            (r#"{"msg":"{\"step\":5}","step":6}"#, Some(6), false),
            (r#"{"step":-1}"#, None, false),
            ("not json", None, false),
            ("", None, false),
        ];
        for (line, step, event) in cases {
            let p = ProgressLine::parse(line);
            assert_eq!((p.step, p.is_event), (step, event), "{line}");
        }
    }

    #[test]
    fn follows_appends_truncation_and_partial_lines() {
        use std::io::Write;
        let path = std::env::temp_dir().join(format!(
            "kiln-progress-test-{}-{:?}.jsonl",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_file(&path);
        let mut w = ProgressWatcher::new(&path);
        assert!(w.poll().is_empty(), "a missing file is no lines");
        std::fs::write(&path, "{\"step\":1}\n{\"step\":2}\n{\"st").unwrap();
        let got: Vec<_> = w.poll().iter().map(|l| l.step).collect();
        assert_eq!(got, [Some(1), Some(2)]);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        writeln!(f, "ep\":3}}").unwrap();
        let got: Vec<_> = w.poll().iter().map(|l| l.step).collect();
        assert_eq!(got, [Some(3)], "the partial line completed");
        // a killed writer's unfinished line is skipped; the next writer's lines count
        write!(f, "{{\"step\":4,\"lo").unwrap();
        w.skip_to_end();
        writeln!(f, "{{\"step\":3}}").unwrap();
        let got: Vec<_> = w.poll().iter().map(|l| l.step).collect();
        assert_eq!(got, [Some(3)]);
        // recreated (shorter): read from the start again
        std::fs::write(&path, "{\"step\":1}\n").unwrap();
        let got: Vec<_> = w.poll().iter().map(|l| l.step).collect();
        assert_eq!(got, [Some(1)]);
        let _ = std::fs::remove_file(&path);
    }
}
