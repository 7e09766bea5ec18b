//! Responses finished in shards that are not complete yet, kept across runs in
//! `OUT/pending.jsonl`, so that a run stopped by its time limit (or killed) loses none of them
//! and the next run decodes only the prompts still missing. One line per finished prompt:
//! `{"index": 5, "sequence": {"ids": [...], "loss_mask": [...]}, "looped": false}` (`sequence`
//! null: the prompt could not be rendered). Lines are appended as prompts finish; a line cut
//! by a kill is ignored, as are lines of shards written since. Example, 4 prompts per shard: a
//! run stops after prompts 0–3 (shard 0 written) and 5, 6 → pending holds 5 and 6; the next
//! run decodes 4 and 7 and writes shard 1.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::data::Sequence;

pub const PENDING: &str = "pending.jsonl";

#[derive(Serialize, Deserialize)]
struct Line {
    index: usize,
    sequence: Option<Sequence>,
    looped: bool,
}

/// A finished prompt: its sequence (`None`: skipped) and whether it ended at a loop.
pub(crate) type Finished = (usize, Option<(Sequence, bool)>);

/// The pending responses of prompts `from..to` (later lines win; a torn line is skipped).
pub(crate) fn load(out: &Path, from: usize, to: usize) -> Result<Vec<Finished>> {
    let p = out.join(PENDING);
    let Ok(text) = std::fs::read_to_string(&p) else {
        return Ok(Vec::new());
    };
    let mut by_index = std::collections::BTreeMap::new();
    for l in text.lines() {
        // a line cut by a kill (the last one) does not parse: that prompt is decoded again
        let Ok(l) = serde_json::from_str::<Line>(l) else {
            continue;
        };
        if (from..to).contains(&l.index) {
            by_index.insert(l.index, l.sequence.map(|s| (s, l.looped)));
        }
    }
    Ok(by_index.into_iter().collect())
}

/// `OUT/pending.jsonl` for appending, rewritten first with `keep` alone.
pub(crate) struct Pending {
    file: std::fs::File,
}

impl Pending {
    pub(crate) fn open(out: &Path, keep: &[Finished]) -> Result<Self> {
        let p = out.join(PENDING);
        let mut text = String::new();
        for (index, s) in keep {
            text += &line(*index, s.as_ref().map(|(s, l)| (s, *l)))?;
        }
        dflash_model::io::atomic::write_file(&p, text.as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .with_context(|| format!("opening {}", p.display()))?;
        Ok(Pending { file })
    }

    /// Record prompt `index` as finished.
    pub(crate) fn push(&mut self, index: usize, seq: Option<(&Sequence, bool)>) -> Result<()> {
        self.file
            .write_all(line(index, seq)?.as_bytes())
            .with_context(|| format!("appending to {PENDING}"))
    }
}

fn line(index: usize, seq: Option<(&Sequence, bool)>) -> Result<String> {
    #[derive(Serialize)]
    struct Out<'a> {
        index: usize,
        sequence: Option<&'a Sequence>,
        looped: bool,
    }
    let o = Out {
        index,
        sequence: seq.map(|s| s.0),
        looped: seq.is_some_and(|s| s.1),
    };
    Ok(serde_json::to_string(&o)? + "\n")
}

/// Every shard is written: nothing is pending.
pub(crate) fn remove(out: &Path) -> Result<()> {
    match std::fs::remove_file(out.join(PENDING)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
        _ => Ok(()),
    }
}
