//! Before a command writes: an output that already holds something the command did not write
//! is refused by name, so that nothing a user has is replaced or mixed in without being asked
//! (`--force` replaces a whole output where replacing makes sense). A command that continues
//! its own earlier run (`data generate`, `train`) names the files it writes as its own.
//!
//! Example: `drafter init --out runs/7/best` where `best/` holds a trained drafter → "--out
//! runs/7/best already holds config.json, model.safetensors, training.json: pass --force to
//! replace it, or name a new directory"; the same with `--force` writes the new drafter.

use std::path::Path;

use anyhow::{bail, Result};

/// What a command may find at its output.
#[derive(Clone, Copy)]
pub struct Output<'a> {
    /// The flag that names it, for the message (`--out`).
    pub flag: &'a str,
    /// The names of the entries the command writes there itself (a continued run's own files).
    pub own: &'a dyn Fn(&str) -> bool,
    /// Whether `--force` may replace it (else the message asks for a new path only).
    pub forceable: bool,
}

/// No entry is the command's own: anything already there is someone else's.
pub fn nothing_own(_: &str) -> bool {
    false
}

impl Output<'_> {
    /// Whether the command may write the directory `dir`: it is missing, empty, holds only the
    /// command's own entries, or `force` (where forceable). A file at `dir` is refused always.
    pub fn check_dir(&self, dir: &Path, force: bool) -> Result<()> {
        let flag = self.flag;
        if !dir.exists() {
            return Ok(());
        }
        if !dir.is_dir() {
            bail!(
                "{flag} {} is a file; this command writes a directory there: name a new directory",
                dir.display()
            );
        }
        let mut foreign: Vec<String> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !(self.own)(n))
            .collect();
        if foreign.is_empty() || (force && self.forceable) {
            return Ok(());
        }
        foreign.sort();
        let more = foreign.len().saturating_sub(4);
        foreign.truncate(4);
        let mut held = foreign.join(", ");
        if more > 0 {
            held += &format!(" and {more} more");
        }
        let how = if self.forceable {
            "pass --force to replace it, or name a new directory"
        } else {
            "name a new directory"
        };
        bail!("{flag} {} already holds {held}: {how}", dir.display())
    }

    /// Whether the command may write the file `file`: it is missing, or `force` (where
    /// forceable). A directory at `file` is refused always.
    pub fn check_file(&self, file: &Path, force: bool) -> Result<()> {
        let flag = self.flag;
        if file.is_dir() {
            bail!(
                "{flag} {} is a directory; this command writes a file there: name a file",
                file.display()
            );
        }
        if file.exists() && !(force && self.forceable) {
            let how = if self.forceable {
                "pass --force to replace it, or name a new file"
            } else {
                "name a new file"
            };
            bail!("{flag} {} already exists: {how}", file.display());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("dflash-outputs-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn an_occupied_directory_is_refused_by_name_unless_forced() {
        let d = tmp("dir");
        let out = Output {
            flag: "--out",
            own: &nothing_own,
            forceable: true,
        };
        out.check_dir(&d, false).unwrap();
        std::fs::create_dir_all(&d).unwrap();
        out.check_dir(&d, false).unwrap();
        for n in ["training.json", "model.safetensors", "a", "b", "c"] {
            std::fs::write(d.join(n), "x").unwrap();
        }
        let e = out.check_dir(&d, false).unwrap_err().to_string();
        assert!(
            e.contains("already holds a, b, c, model.safetensors and 1 more")
                && e.contains("--force"),
            "{e}"
        );
        out.check_dir(&d, true).unwrap();
        // a command's own entries are no obstacle; another's are, and force does not help
        // where the output cannot be replaced
        let own = |n: &str| n == "manifest.json" || n.starts_with("shard-");
        let data = Output {
            flag: "--out",
            own: &own,
            forceable: false,
        };
        let d2 = tmp("data");
        std::fs::create_dir_all(&d2).unwrap();
        std::fs::write(d2.join("manifest.json"), "{}").unwrap();
        std::fs::write(d2.join("shard-00000.jsonl"), "").unwrap();
        data.check_dir(&d2, false).unwrap();
        std::fs::write(d2.join("metrics.jsonl"), "").unwrap();
        let e = data.check_dir(&d2, true).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl") && !e.contains("--force"), "{e}");
        // a file where a directory goes, and the reverse
        let f = d2.join("metrics.jsonl");
        let e = data.check_dir(&f, true).unwrap_err().to_string();
        assert!(e.contains("is a file"), "{e}");
        let e = out.check_file(&d2, true).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = out.check_file(&f, false).unwrap_err().to_string();
        assert!(e.contains("already exists") && e.contains("--force"), "{e}");
        out.check_file(&f, true).unwrap();
        out.check_file(&d2.join("new.svg"), false).unwrap();
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&d2);
    }
}
