//! Where checkpoints live: the [`Storage`] trait (a small set of operations with stated
//! durability) and [`LocalFs`], its local filesystem implementation.
//!
//! Paths are relative, `/`-separated (`step-00000010/rank-00003.safetensors`); `""` is the
//! root. An object store (S3, GCS, Azure) fits the same trait: `create` maps to a multipart
//! upload, `rename` of a directory to copy-then-delete with the manifest written last, and
//! `sync_dir` to nothing.

use crate::error::{CkptError, Result};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A file being written; its content becomes durable when [`StorageWriter::finish`] returns.
pub trait StorageWriter: Send {
    /// Appends bytes.
    fn write(&mut self, buf: &[u8]) -> Result<()>;
    /// Flushes and makes the content durable (fsync for a local file).
    fn finish(self: Box<Self>) -> Result<()>;
}

/// A file being read sequentially.
pub trait StorageReader: Send {
    /// Total size of the file in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from the current position; fewer bytes left than `buf.len()` is an
    /// error.
    fn read_exact(&mut self, buf: &mut [u8]) -> Result<()>;
}

/// The operations a checkpoint needs from its storage.
///
/// Durability contract (what [`crate::Checkpointer`] relies on for atomic commits):
/// - a file written through [`Storage::create`] is durable once its writer's `finish`
///   returns; its directory entry is durable once [`Storage::sync_dir`] of its directory
///   returns;
/// - [`Storage::rename`] is atomic (readers see the old name or the new one, never a mix)
///   and durable when it returns;
/// - [`Storage::list`] sees every committed rename.
pub trait Storage: Send + Sync {
    /// Starts writing the file at `path`, replacing any file there and creating missing
    /// parent directories.
    fn create(&self, path: &str) -> Result<Box<dyn StorageWriter>>;

    /// Opens a file for sequential reading; a missing file is [`CkptError::NotFound`].
    fn open(&self, path: &str) -> Result<Box<dyn StorageReader>>;

    /// Reads a whole file; a missing file is [`CkptError::NotFound`].
    fn get(&self, path: &str) -> Result<Vec<u8>> {
        let mut r = self.open(path)?;
        let n = usize::try_from(r.size()).map_err(|_| CkptError::File {
            op: "read",
            path: path.to_string(),
            source: io::Error::other("file too large for memory"),
        })?;
        let mut buf = vec![0u8; n];
        r.read_exact(&mut buf)?;
        Ok(buf)
    }

    /// Size of a file in bytes; a missing file is [`CkptError::NotFound`].
    fn size(&self, path: &str) -> Result<u64>;

    /// Names of the entries directly under directory `dir`, sorted; empty when `dir` does
    /// not exist.
    fn list(&self, dir: &str) -> Result<Vec<String>>;

    /// True if a file or directory exists at `path`.
    fn exists(&self, path: &str) -> Result<bool>;

    /// Atomically renames a file or directory; `to` must not exist as a non-empty directory.
    /// Durable when it returns.
    fn rename(&self, from: &str, to: &str) -> Result<()>;

    /// Removes a file or a directory with everything below it; a missing path is not an
    /// error.
    fn remove(&self, path: &str) -> Result<()>;

    /// Makes the entries of directory `dir` (files created, renamed or removed in it)
    /// durable.
    fn sync_dir(&self, dir: &str) -> Result<()>;

    /// Writes a whole file and makes it durable.
    fn put(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let mut w = self.create(path)?;
        w.write(bytes)?;
        w.finish()
    }
}

/// A [`Storage`] on the local filesystem under a root directory, with fsync of files and
/// directories.
#[derive(Debug, Clone)]
pub struct LocalFs {
    root: PathBuf,
}

fn io_err(op: &'static str, path: &str, e: io::Error) -> CkptError {
    if e.kind() == io::ErrorKind::NotFound {
        CkptError::NotFound {
            path: path.to_string(),
        }
    } else {
        CkptError::File {
            op,
            path: path.to_string(),
            source: e,
        }
    }
}

/// The parent of a relative storage path (`""` for a top-level entry).
pub(crate) fn parent(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(p, _)| p)
}

impl LocalFs {
    /// Storage rooted at `root`, which is created if missing.
    pub fn new(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        fs::create_dir_all(&root).map_err(|e| CkptError::File {
            op: "create directory",
            path: root.display().to_string(),
            source: e,
        })?;
        Ok(LocalFs { root })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The local path of a storage path; rejects absolute paths, `.`/`..` and empty
    /// components.
    pub fn resolve(&self, path: &str) -> Result<PathBuf> {
        let mut p = self.root.clone();
        if path.is_empty() {
            return Ok(p);
        }
        for c in path.split('/') {
            if c.is_empty() || c == "." || c == ".." || c.contains('\\') || c.contains('\0') {
                return Err(CkptError::BadPath {
                    path: path.to_string(),
                });
            }
            p.push(c);
        }
        Ok(p)
    }

    fn fsync_dir(&self, dir: &str) -> Result<()> {
        let p = self.resolve(dir)?;
        File::open(&p)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_err("fsync directory", dir, e))
    }
}

struct LocalWriter {
    file: File,
    path: String,
    /// Bytes written so far.
    written: u64,
    /// Bytes whose writeback has been started.
    kicked: u64,
}

/// How many bytes a [`LocalWriter`] lets accumulate before starting their writeback.
const WRITEBACK_KICK: u64 = 32 << 20;

/// Starts writing `len` bytes at `offset` of `file` to the device without waiting for them
/// (Linux `sync_file_range` with `SYNC_FILE_RANGE_WRITE`), so the disk works while the
/// caller produces the next bytes and the final fsync has less left to do. A hint: it makes
/// nothing durable and its failure is ignored (the fsync reports real errors).
#[cfg(target_os = "linux")]
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (
        libc::off64_t::try_from(offset),
        libc::off64_t::try_from(len),
    ) else {
        return;
    };
    // SAFETY: `sync_file_range` only reads its integer arguments; the descriptor belongs to
    // `file`, which is open for the duration of the call.
    let _ = unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE)
    };
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_file: &File, _offset: u64, _len: u64) {}

impl StorageWriter for LocalWriter {
    fn write(&mut self, buf: &[u8]) -> Result<()> {
        self.file
            .write_all(buf)
            .map_err(|e| io_err("write", &self.path, e))?;
        self.written += buf.len() as u64;
        if self.written - self.kicked >= WRITEBACK_KICK {
            start_writeback(&self.file, self.kicked, self.written - self.kicked);
            self.kicked = self.written;
        }
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<()> {
        self.file
            .sync_all()
            .map_err(|e| io_err("fsync", &self.path, e))
    }
}

struct LocalReader {
    file: File,
    size: u64,
    path: String,
}

impl StorageReader for LocalReader {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        io::Read::read_exact(&mut self.file, buf).map_err(|e| io_err("read", &self.path, e))
    }
}

/// Files at least this large are freed on a background thread when removed.
const DEFERRED_FREE_BYTES: u64 = 1 << 20;

/// Opens every regular file of at least [`DEFERRED_FREE_BYTES`] below `dir` (best effort:
/// a file that cannot be opened is freed by the removal itself).
fn hold_large_files(dir: &Path, held: &mut Vec<File>) {
    let Ok(rd) = fs::read_dir(dir) else {
        return;
    };
    for entry in rd.flatten() {
        let Ok(ty) = entry.file_type() else {
            continue;
        };
        let path = entry.path();
        if ty.is_dir() {
            hold_large_files(&path, held);
        } else if ty.is_file()
            && entry
                .metadata()
                .is_ok_and(|m| m.len() >= DEFERRED_FREE_BYTES)
        {
            held.extend(File::open(&path).ok());
        }
    }
}

/// Closes files whose names were removed on a background thread. Unlinking a name is quick,
/// but freeing a large file's blocks and cached pages (tens of milliseconds per hundred MB)
/// happens when its last descriptor closes: holding one across the removal moves that cost
/// off the caller's thread. Names are gone when `remove` returns; only the space comes back
/// a little later (or at process exit, or, after a crash, at the filesystem's orphan
/// cleanup).
fn release_in_background(held: Vec<File>) {
    if held.is_empty() {
        return;
    }
    let slot = std::sync::Arc::new(std::sync::Mutex::new(Some(held)));
    let theirs = std::sync::Arc::clone(&slot);
    let spawned = std::thread::Builder::new()
        .name("kiln-ckpt-free".to_string())
        .spawn(move || drop(take_files(&theirs)));
    if spawned.is_err() {
        drop(take_files(&slot));
    }
}

fn take_files(slot: &std::sync::Mutex<Option<Vec<File>>>) -> Option<Vec<File>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}

impl Storage for LocalFs {
    fn open(&self, path: &str) -> Result<Box<dyn StorageReader>> {
        let file = File::open(self.resolve(path)?).map_err(|e| io_err("open", path, e))?;
        let size = file.metadata().map_err(|e| io_err("stat", path, e))?.len();
        Ok(Box::new(LocalReader {
            file,
            size,
            path: path.to_string(),
        }))
    }

    fn create(&self, path: &str) -> Result<Box<dyn StorageWriter>> {
        if path.is_empty() {
            return Err(CkptError::BadPath {
                path: path.to_string(),
            });
        }
        let p = self.resolve(path)?;
        if let Some(dir) = p.parent() {
            fs::create_dir_all(dir).map_err(|e| io_err("create directory", parent(path), e))?;
        }
        let file = File::create(&p).map_err(|e| io_err("create", path, e))?;
        Ok(Box::new(LocalWriter {
            file,
            path: path.to_string(),
            written: 0,
            kicked: 0,
        }))
    }

    fn size(&self, path: &str) -> Result<u64> {
        fs::metadata(self.resolve(path)?)
            .map(|m| m.len())
            .map_err(|e| io_err("stat", path, e))
    }

    fn list(&self, dir: &str) -> Result<Vec<String>> {
        let rd = match fs::read_dir(self.resolve(dir)?) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("list", dir, e)),
        };
        let mut names = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| io_err("list", dir, e))?;
            if let Ok(name) = entry.file_name().into_string() {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    fn exists(&self, path: &str) -> Result<bool> {
        match fs::symlink_metadata(self.resolve(path)?) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err("stat", path, e)),
        }
    }

    fn rename(&self, from: &str, to: &str) -> Result<()> {
        fs::rename(self.resolve(from)?, self.resolve(to)?)
            .map_err(|e| io_err("rename", &format!("{from} -> {to}"), e))?;
        self.fsync_dir(parent(to))?;
        if parent(from) != parent(to) {
            self.fsync_dir(parent(from))?;
        }
        Ok(())
    }

    fn remove(&self, path: &str) -> Result<()> {
        let p = self.resolve(path)?;
        if path.is_empty() {
            return Err(CkptError::BadPath {
                path: path.to_string(),
            });
        }
        let mut held = Vec::new();
        let res = match fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => {
                hold_large_files(&p, &mut held);
                fs::remove_dir_all(&p)
            }
            Ok(m) => {
                if m.is_file() && m.len() >= DEFERRED_FREE_BYTES {
                    held.extend(File::open(&p).ok());
                }
                fs::remove_file(&p)
            }
            Err(e) => Err(e),
        };
        release_in_background(held);
        match res {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("remove", path, e)),
        }
    }

    fn sync_dir(&self, dir: &str) -> Result<()> {
        self.fsync_dir(dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("kiln-ckpt-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        p
    }

    #[test]
    fn local_fs_operations() {
        let root = tmp("storage");
        let s = LocalFs::new(&root).unwrap();
        s.put("a/b/c.bin", b"hello").unwrap();
        assert_eq!(s.get("a/b/c.bin").unwrap(), b"hello");
        assert_eq!(s.size("a/b/c.bin").unwrap(), 5);
        let mut w = s.create("a/d.bin").unwrap();
        w.write(b"12").unwrap();
        w.write(b"345").unwrap();
        w.finish().unwrap();
        assert_eq!(s.get("a/d.bin").unwrap(), b"12345");
        assert_eq!(s.list("a").unwrap(), ["b", "d.bin"]);
        assert_eq!(s.list("nope").unwrap(), Vec::<String>::new());
        s.rename("a", "z").unwrap();
        assert!(!s.exists("a").unwrap());
        assert_eq!(s.get("z/b/c.bin").unwrap(), b"hello");
        assert!(matches!(
            s.get("a/b/c.bin"),
            Err(CkptError::NotFound { .. })
        ));
        s.remove("z").unwrap();
        s.remove("z").unwrap();
        assert_eq!(s.list("").unwrap(), Vec::<String>::new());
        for bad in ["/etc/passwd", "../x", "a//b", "a/./b", ""] {
            assert!(
                matches!(s.put(bad, b""), Err(CkptError::BadPath { .. })),
                "{bad}"
            );
        }
        assert!(s.remove("").is_err());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn large_files_are_gone_when_remove_returns_and_writes_round_trip() {
        let root = tmp("storage-large");
        let s = LocalFs::new(&root).unwrap();
        let big: Vec<u8> = (0..(3 * WRITEBACK_KICK as usize / 2 + 5))
            .map(|i| (i % 251) as u8)
            .collect();
        let mut w = s.create("d/big.bin").unwrap();
        for piece in big.chunks(1 << 20) {
            w.write(piece).unwrap();
        }
        w.finish().unwrap();
        assert_eq!(s.get("d/big.bin").unwrap(), big);
        s.put("d/nested/big2.bin", &big[..(2 << 20)]).unwrap();
        s.put("alone.bin", &big[..(2 << 20)]).unwrap();
        s.remove("d").unwrap();
        s.remove("alone.bin").unwrap();
        assert!(!s.exists("d").unwrap());
        assert_eq!(s.list("").unwrap(), Vec::<String>::new());
        fs::remove_dir_all(&root).unwrap();
    }
}
