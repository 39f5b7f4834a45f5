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
}

impl StorageWriter for LocalWriter {
    fn write(&mut self, buf: &[u8]) -> Result<()> {
        self.file
            .write_all(buf)
            .map_err(|e| io_err("write", &self.path, e))
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
        let res = match fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => fs::remove_dir_all(&p),
            Ok(_) => fs::remove_file(&p),
            Err(e) => Err(e),
        };
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
}
