//! Atomic writes: a file, or a whole directory, replaced so that at every moment its path holds
//! either the old content or the new one complete — never neither, never a half. Checkpoints,
//! `best/`, `latest`, drafter exports, data shards, manifests and reports all write through
//! here.
//!
//! A file: written beside its destination under a temporary name, synced, renamed over it
//! (`rename(2)` replaces a file atomically), the directory synced.
//!
//! A directory cannot be renamed over a non-empty one, so [`replace_dir`] builds the new one
//! beside it, syncs it, and on Linux **exchanges** the two names in one step
//! (`renameat2(RENAME_EXCHANGE)`); the old content, now under the temporary name, is removed
//! after. Example: `best/` holds step 200; step 400 is built in `.best.tmp-4711/`, the names
//! are swapped (`best/` = step 400, `.best.tmp-4711/` = step 200), then `.best.tmp-4711/` is
//! removed. A crash before the swap leaves `best/` at step 200 (and a leftover temporary that
//! the next replace removes), after it `best/` at step 400. Where the exchange is not
//! available (another OS, a filesystem without it) the old directory is renamed aside and the
//! new one renamed in, two steps with a moment between them.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The steps of [`replace_dir`], in order (tests stop a process after each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The new directory is built under its temporary name.
    Built,
    /// Its files are synced to disk.
    Synced,
    /// It carries the destination's name (the old one is under the temporary name).
    Swapped,
    /// The old content is removed.
    Removed,
}

/// The parent directory of `path` (`.` for a bare name), created if missing.
fn parent_of(path: &Path) -> Result<PathBuf> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir.to_path_buf())
}

fn file_name(path: &Path) -> Result<String> {
    Ok(path
        .file_name()
        .with_context(|| format!("{} has no file name", path.display()))?
        .to_string_lossy()
        .into_owned())
}

/// Sync a directory's entry list (a rename into it is then durable).
fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", dir.display()))
}

/// Sync every file under `dir`, and `dir` itself.
fn sync_tree(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            sync_tree(&p)?;
        } else {
            std::fs::File::open(&p)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("syncing {}", p.display()))?;
        }
    }
    sync_dir(dir)
}

/// Replace the file at `path` by `bytes` atomically.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    write_file_with(path, |tmp| {
        let mut f = std::fs::File::create(tmp)?;
        f.write_all(bytes)?;
        Ok(())
    })
}

/// Replace the file at `path` by the one `write` creates at the path it is given (a temporary
/// sibling), atomically: synced, then renamed over `path`. A `write` error leaves `path` as it
/// was and removes the temporary file.
pub fn write_file_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = parent_of(path)?;
    let tmp = dir.join(format!(".{}.tmp-{}", file_name(path)?, std::process::id()));
    let written = write(&tmp).and_then(|()| {
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(anyhow::Error::from)
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", tmp.display()));
    }
    std::fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
    sync_dir(&dir)
}

/// Replace the directory `dst` by one that `build` writes into the path it is given (a
/// temporary sibling), atomically (the module doc). A `build` error leaves `dst` as it was.
pub fn replace_dir(dst: &Path, build: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    replace_dir_observed(dst, build, &mut |_| {})
}

/// [`replace_dir`], calling `observe` after each [`Step`].
pub fn replace_dir_observed(
    dst: &Path,
    build: impl FnOnce(&Path) -> Result<()>,
    observe: &mut dyn FnMut(Step),
) -> Result<()> {
    let parent = parent_of(dst)?;
    let name = file_name(dst)?;
    // leftovers of an earlier process that stopped between the steps
    let stale = format!(".{name}.tmp-");
    for e in std::fs::read_dir(&parent)?.flatten() {
        if e.file_name().to_string_lossy().starts_with(&stale) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    let tmp = parent.join(format!("{stale}{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    if let Err(e) = build(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    observe(Step::Built);
    sync_tree(&tmp)?;
    observe(Step::Synced);
    if dst.exists() {
        swap(&tmp, dst)?;
    } else {
        std::fs::rename(&tmp, dst).with_context(|| format!("renaming into {}", dst.display()))?;
    }
    sync_dir(&parent)?;
    observe(Step::Swapped);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)
            .with_context(|| format!("removing the old content at {}", tmp.display()))?;
    }
    observe(Step::Removed);
    Ok(())
}

/// Exchange the names `a` and `b` (both exist).
fn swap(a: &Path, b: &Path) -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        if exchange(a, b).is_ok() {
            return Ok(());
        }
    }
    // two renames: `b` is missing between them
    let aside = a.with_extension("old");
    std::fs::rename(b, &aside).with_context(|| format!("moving {} aside", b.display()))?;
    std::fs::rename(a, b).with_context(|| format!("renaming into {}", b.display()))?;
    std::fs::rename(&aside, a).with_context(|| format!("renaming {}", aside.display()))
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two valid NUL-terminated paths, relative to the working directory
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("dflash-atomic-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_file_and_a_directory_are_replaced_and_a_failed_build_changes_nothing() {
        let d = tmp("unit");
        let f = d.join("latest");
        write_file(&f, b"step-1").unwrap();
        write_file(&f, b"step-2").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"step-2");
        let best = d.join("best");
        for v in ["old", "new"] {
            replace_dir(&best, |t| {
                std::fs::create_dir_all(t.join("sub"))?;
                Ok(std::fs::write(t.join("sub/w"), v)?)
            })
            .unwrap();
            assert_eq!(std::fs::read_to_string(best.join("sub/w")).unwrap(), v);
        }
        let err = replace_dir(&best, |_| anyhow::bail!("disk full")).unwrap_err();
        assert!(err.to_string().contains("disk full"));
        assert_eq!(std::fs::read_to_string(best.join("sub/w")).unwrap(), "new");
        // nothing left beside them but the two destinations
        let mut names: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["best", "latest"]);
    }
}
