//! An evaluation's finished items on disk (`OUT/runs.jsonl`): each item's runs are appended
//! once every mode finished every turn of it, so an interrupted evaluation (Ctrl-C, a kill,
//! a crash, `--time-limit`) keeps them and the next one with the same settings decodes only
//! the items missing. The first line names the settings (`key`: target, drafters, modes,
//! sampling, lengths, the item list); a journal of other settings is refused by name. Example:
//! 8 GSM8K items, killed during item 5 → `runs.jsonl` holds the header and items 0–4; rerun
//! → items 5–7 decoded, the report covers all 8.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::harness::Run;

#[derive(Serialize, Deserialize)]
struct Header {
    journal: String,
    key: String,
}

#[derive(Serialize, Deserialize)]
struct Item {
    item: String,
    runs: Vec<Run>,
}

const FORMAT: &str = "dflash-rs eval runs v1";

/// The journal of one evaluation: the items it holds, and the file to append to.
pub struct Journal {
    path: PathBuf,
    file: std::fs::File,
    /// Runs of finished items, by item id.
    pub done: HashMap<String, Vec<Run>>,
}

impl Journal {
    /// Open `path` for the settings `key`: its items when it exists with that key (a line cut
    /// by a kill is dropped), a new journal otherwise.
    pub fn open(path: &Path, key: &str) -> Result<Self> {
        let mut done = HashMap::new();
        let mut kept = String::new();
        if let Ok(text) = std::fs::read_to_string(path) {
            let mut lines = text.lines();
            let header: Option<Header> = lines.next().and_then(|l| serde_json::from_str(l).ok());
            match header {
                Some(h) if h.journal == FORMAT && h.key == key => {}
                _ => bail!(
                    "{} holds the runs of another evaluation (other target, drafters, modes, \
                     sampling, lengths or items): pass --force to start over, or another --out",
                    path.display()
                ),
            }
            for l in lines {
                if let Ok(i) = serde_json::from_str::<Item>(l) {
                    kept += l;
                    kept.push('\n');
                    done.insert(i.item, i.runs);
                }
            }
        }
        let header = serde_json::to_string(&Header {
            journal: FORMAT.into(),
            key: key.into(),
        })?;
        // rewritten without a torn last line, then appended to
        dflash_model::io::atomic::write_file(path, format!("{header}\n{kept}").as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Journal {
            path: path.to_path_buf(),
            file,
            done,
        })
    }

    /// Record a finished item's runs.
    pub fn push(&mut self, item: &str, runs: &[Run]) -> Result<()> {
        let line = serde_json::to_string(&Item {
            item: item.into(),
            runs: runs.to_vec(),
        })?;
        self.file
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|_| self.file.flush())
            .with_context(|| format!("appending to {}", self.path.display()))
    }
}
