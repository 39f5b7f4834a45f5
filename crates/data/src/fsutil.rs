//! Atomic file writes: write a temporary file beside the target, fsync it, rename it into place,
//! fsync the directory. A reader sees the old file or the whole new one, never a partial write.

use crate::error::{DataError, Result};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The temporary path a file is written to before its rename.
pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}", std::process::id()));
    path.with_file_name(name)
}

/// Writes through `fill` into a temporary file, then renames it to `path`.
pub(crate) fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut std::io::BufWriter<&File>) -> std::io::Result<()>,
) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| DataError::file("create", dir, e))?;
    }
    let tmp = tmp_path(path);
    let file = File::create(&tmp).map_err(|e| DataError::file("create", &tmp, e))?;
    let res = (|| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, &file);
        fill(&mut w)?;
        w.flush()?;
        drop(w);
        file.sync_all()
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(DataError::file("write", &tmp, e));
    }
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        DataError::file("rename", path, e)
    })?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // Best effort: make the rename durable. Some filesystems refuse to open a directory.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}
