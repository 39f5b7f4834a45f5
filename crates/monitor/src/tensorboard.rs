//! TensorBoard event files, written without TensorFlow or a protobuf library.
//!
//! A file `events.out.tfevents.<unix seconds>.<host>` is a sequence of TFRecords:
//!
//! ```text
//! u64 length (little endian) | u32 masked crc32c(length bytes) | data | u32 masked crc32c(data)
//! ```
//!
//! where `masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8`. Each record's data is a serialised
//! `tensorflow.Event` protobuf: `wall_time` (double, field 1), `step` (int64, field 2), then
//! either `file_version` (string, field 3, `"brain.Event:2"`, in the first record) or `summary`
//! (field 5), a `Summary` whose repeated `value` (field 1) messages hold a `tag` (string, field
//! 1) and a `simple_value` (float, field 2). The encoding below writes exactly those fields.

use crate::event::Event;
use crate::metrics::{unix_now, StepMetrics};
use crate::sink::MetricSink;
use crate::{MonitorError, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

const fn crc32c_table() -> [u32; 256] {
    // reflected Castagnoli polynomial
    const POLY: u32 = 0x82f6_3b78;
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

static CRC32C: [u32; 256] = crc32c_table();

/// CRC-32C (Castagnoli), as TFRecord framing uses.
///
/// ```
/// assert_eq!(kiln_monitor::crc32c(b"123456789"), 0xe306_9283);
/// ```
pub fn crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c = CRC32C[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// The TFRecord mask of a CRC.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Serialises a `tensorflow.Event` with `wall_time`, `step` and a `file_version`.
fn encode_file_version(out: &mut Vec<u8>, wall_time: f64) {
    out.clear();
    put_key(out, 1, 1);
    out.extend_from_slice(&wall_time.to_le_bytes());
    put_key(out, 2, 0);
    put_varint(out, 0);
    put_bytes(out, 3, b"brain.Event:2");
}

/// Serialises a `tensorflow.Event` with `wall_time`, `step` and a summary of scalars.
fn encode_scalars<'a>(
    out: &mut Vec<u8>,
    value: &mut Vec<u8>,
    summary: &mut Vec<u8>,
    wall_time: f64,
    step: u64,
    scalars: impl Iterator<Item = (&'a str, f32)>,
) {
    summary.clear();
    for (tag, v) in scalars {
        value.clear();
        put_bytes(value, 1, tag.as_bytes());
        put_key(value, 2, 5);
        value.extend_from_slice(&v.to_le_bytes());
        put_bytes(summary, 1, value);
    }
    out.clear();
    put_key(out, 1, 1);
    out.extend_from_slice(&wall_time.to_le_bytes());
    put_key(out, 2, 0);
    // int64 is encoded as the two's complement u64 varint
    put_varint(out, step);
    put_bytes(out, 5, summary);
}

/// Frames `data` as one TFRecord.
fn write_record(w: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    w.write_all(&len)?;
    w.write_all(&masked_crc32c(&len).to_le_bytes())?;
    w.write_all(data)?;
    w.write_all(&masked_crc32c(data).to_le_bytes())
}

fn hostname() -> String {
    let from_proc = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string());
    from_proc
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .filter(|h| !h.is_empty())
        .map(|h| {
            h.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        })
        .unwrap_or_else(|| "localhost".to_string())
}

/// Scalars for TensorBoard: one event file per sink in a log directory.
///
/// Every numeric field of a record becomes a scalar tagged with its JSONL name (`loss`,
/// `grad_norm`, `tokens_per_s`, ...; per-source losses as `source_loss/<name>`, extras as
/// `extra/<name>`), written as float32. An [`Event`] becomes the scalar `events/<kind>` = 1 at
/// its step, so alerts and rollbacks show up on the same step axis. Point TensorBoard at the
/// directory: `tensorboard --logdir <dir>`.
pub struct TensorBoardSink {
    out: BufWriter<File>,
    path: PathBuf,
    data: Vec<u8>,
    value: Vec<u8>,
    summary: Vec<u8>,
    tags: Vec<(String, f32)>,
    used: usize,
    closed: bool,
}

impl TensorBoardSink {
    /// Creates `dir` if needed and a new event file in it.
    pub fn create(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(MonitorError::file("create directory", dir))?;
        let now = unix_now();
        let mut path = dir.join(format!("events.out.tfevents.{}.{}", now as u64, hostname()));
        // a second sink in the same second and directory gets its own file
        let mut n = 1;
        while path.exists() {
            path = dir.join(format!(
                "events.out.tfevents.{}.{}.{n}",
                now as u64,
                hostname()
            ));
            n += 1;
        }
        let file = File::create(&path).map_err(MonitorError::file("create", &path))?;
        let mut sink = TensorBoardSink {
            out: BufWriter::with_capacity(64 * 1024, file),
            path,
            data: Vec::with_capacity(4096),
            value: Vec::with_capacity(64),
            summary: Vec::with_capacity(4096),
            tags: Vec::new(),
            used: 0,
            closed: false,
        };
        encode_file_version(&mut sink.data, now);
        sink.write()?;
        sink.flush()?;
        Ok(sink)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self) -> Result<()> {
        if self.closed {
            return Err(MonitorError::Closed {
                sink: "tensorboard",
            });
        }
        write_record(&mut self.out, &self.data).map_err(MonitorError::file("write", &self.path))
    }

    fn emit(&mut self, step: u64, wall_time: f64) -> Result<()> {
        let tags = &self.tags[..self.used];
        encode_scalars(
            &mut self.data,
            &mut self.value,
            &mut self.summary,
            wall_time,
            step,
            tags.iter().map(|(t, v)| (t.as_str(), *v)),
        );
        self.write()
    }
}

impl MetricSink for TensorBoardSink {
    fn record(&mut self, m: &StepMetrics) -> Result<()> {
        // reuse the tag strings between records: no allocation once the set of tags is stable
        let tags = &mut self.tags;
        let mut used = 0;
        m.for_each_scalar(|prefix, name, v| {
            if used == tags.len() {
                tags.push((String::new(), 0.0));
            }
            let slot = &mut tags[used];
            if slot.0.len() != prefix.len() + name.len()
                || !slot.0.starts_with(prefix)
                || !slot.0.ends_with(name)
            {
                slot.0.clear();
                slot.0.push_str(prefix);
                slot.0.push_str(name);
            }
            slot.1 = v as f32;
            used += 1;
        });
        self.used = used;
        let wall = m.time.unwrap_or_else(unix_now);
        self.emit(m.step, wall)
    }

    fn event(&mut self, e: &Event) -> Result<()> {
        if self.tags.is_empty() {
            self.tags.push((String::new(), 0.0));
        }
        self.tags[0].0.clear();
        self.tags[0].0.push_str("events/");
        self.tags[0].0.push_str(e.kind.name());
        self.tags[0].1 = 1.0;
        self.used = 1;
        let wall = e.time.unwrap_or_else(unix_now);
        self.emit(e.step, wall)?;
        self.flush()
    }

    fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .map_err(MonitorError::file("flush", &self.path))
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

impl std::fmt::Debug for TensorBoardSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorBoardSink")
            .field("path", &self.path)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vectors() {
        // RFC 3720 appendix B.4 test vectors
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let inc: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&inc), 0x46dd_794e);
        let dec: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c(&dec), 0x113f_db5c);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn varints() {
        let enc = |v| {
            let mut o = Vec::new();
            put_varint(&mut o, v);
            o
        };
        assert_eq!(enc(0), [0]);
        assert_eq!(enc(1), [1]);
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(
            enc(u64::MAX),
            [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
    }

    #[test]
    fn event_bytes_by_hand() {
        // Event { wall_time: 1.5, step: 300, summary { value { tag: "a", simple_value: 2.0 } } }
        let (mut out, mut v, mut s) = (Vec::new(), Vec::new(), Vec::new());
        encode_scalars(
            &mut out,
            &mut v,
            &mut s,
            1.5,
            300,
            [("a", 2.0f32)].into_iter(),
        );
        let mut expected = vec![0x09];
        expected.extend_from_slice(&1.5f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 0xac, 0x02]);
        // summary: field 5, len 10; value: field 1, len 8; tag: 0x0a 1 'a'; float: 0x15 + 4 bytes
        expected.extend_from_slice(&[0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15]);
        expected.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(out, expected);
    }
}
