//! docs/BENCHMARKS.md, generated from the benchmark records in `docs/bench/*.json`.
//!
//! Each record carries, beside its measurement (`command`, `date`, `device`, `reference`,
//! `notes`, `rows`), where it goes on the page:
//! - `topic`: one of [`TOPICS`];
//! - `title`: the thing it measures. Records that share a title measure the same thing, and only
//!   the newest by `date` is current; a record may name the records it replaces in `supersedes`
//!   (file names), which settles two of one date and replaces a record of another title.
//!   Two current records may not share a title.
//!
//! Optional keys shape the section: `show` (`{"key": [values]}`: only the rows whose `key` is
//! one of the values; a missing key reads as `null`), `columns` (the row keys to print, in
//! order), `table` (the array that holds the rows, `rows` by default), `also` (other top-level
//! keys to print, e.g. a series of runs) and `order` (a number: a topic's sections in ascending
//! order, 50 by default, then newest first).
//! The page prints the current record of each title by topic, with its command, date, device,
//! reference and settings, and its rows (the reference's rows among them) in a table.

mod json;
mod render;

pub use json::Json;

use anyhow::{anyhow, bail, Context, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// The topics of the page, in its order.
pub const TOPICS: &[&str] = &[
    "CPU decoding",
    "Serving",
    "GPU decoding",
    "DDTree and sampling",
    "Training",
    "Data regeneration",
    "Hybrid targets",
    "Kernels",
    "Fuzzing",
];

/// One benchmark record: `docs/bench/<file>`.
#[derive(Debug, Clone)]
pub struct Record {
    pub file: String,
    pub topic: String,
    pub title: String,
    pub date: String,
    pub supersedes: Vec<String>,
    pub value: Json,
}

impl Record {
    /// Reads the placement keys of `value`, the record named `file`.
    pub fn new(file: &str, value: Json) -> Result<Record> {
        let text = |key: &str| -> Result<String> {
            value
                .get(key)
                .and_then(Json::as_str)
                .map(str::to_string)
                .ok_or_else(|| anyhow!("{file}: no \"{key}\" string"))
        };
        for key in ["command", "device"] {
            text(key)?;
        }
        let topic = text("topic")?;
        if !TOPICS.contains(&topic.as_str()) {
            bail!("{file}: topic {topic:?} is none of {TOPICS:?}");
        }
        let supersedes = match value.get("supersedes") {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .and_then(|items| {
                    items
                        .iter()
                        .map(|i| i.as_str().map(str::to_string))
                        .collect()
                })
                .ok_or_else(|| anyhow!("{file}: \"supersedes\" is not a list of file names"))?,
        };
        Ok(Record {
            file: file.to_string(),
            topic,
            title: text("title")?,
            date: text("date")?,
            supersedes,
            value,
        })
    }

    /// Where the record's section goes within its topic (`order`, 50 by default).
    pub fn order(&self) -> f64 {
        match self.value.get("order") {
            Some(Json::Number(n)) => n.as_f64().unwrap_or(50.0),
            _ => 50.0,
        }
    }

    /// The record's string under `key`, if any.
    pub fn text(&self, key: &str) -> Option<&str> {
        self.value.get(key).and_then(Json::as_str)
    }
}

/// Every `*.json` record of `dir` (docs/bench), by file name.
pub fn load(dir: &Path) -> Result<Vec<Record>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {name}"))?;
            let value: Json =
                serde_json::from_str(&text).with_context(|| format!("parsing {name}"))?;
            Record::new(&name, value)
        })
        .collect()
}

/// Whether `newer` replaces `older`: it names it, or measures the same thing later.
fn replaces(newer: &Record, older: &Record) -> bool {
    newer.file != older.file
        && (newer.supersedes.contains(&older.file)
            || (newer.title == older.title && newer.date > older.date))
}

/// The current records: those no other record replaces. Fails on a `supersedes` that names no
/// record or a newer one, and on two current records of one title.
pub fn current(records: &[Record]) -> Result<Vec<&Record>> {
    for r in records {
        for s in &r.supersedes {
            let old = records
                .iter()
                .find(|o| &o.file == s)
                .ok_or_else(|| anyhow!("{}: supersedes {s}, which is not a record", r.file))?;
            if old.date > r.date {
                bail!("{}: supersedes {s}, a newer record", r.file);
            }
        }
    }
    let now: Vec<&Record> = records
        .iter()
        .filter(|r| !records.iter().any(|n| replaces(n, r)))
        .collect();
    let mut titles: BTreeMap<&str, &str> = BTreeMap::new();
    for r in &now {
        if let Some(other) = titles.insert(&r.title, &r.file) {
            bail!(
                "{} and {other} are both current for {:?}: give one a later date, \
                 another title, or name the other in \"supersedes\"",
                r.file,
                r.title
            );
        }
    }
    Ok(now)
}

const HEADER: &str = "# Benchmarks

Generated from the records in [`docs/bench/`](bench/README.md) by `crates/dflash-eval/src/bench_doc` \
(`DFLASH_BLESS=1 cargo test -p dflash-eval bench_doc` rewrites this page; a test fails when it is out \
of date). Each record names its `topic` and the thing it measures (`title`); of the records that \
measure one thing only the newest is shown (the rule: [bench/README.md](bench/README.md)), and \
older ones stay in the directory and in git. Each section gives the record, the command that \
produced it, the date, the device, the reference measured beside it, and its rows, the \
reference's rows among them. Absolute numbers vary between machines and between calls on the \
same kind of machine: compare figures measured together.
";

/// The page: every current record by topic, newest first within a topic.
pub fn markdown(records: &[Record]) -> Result<String> {
    let now = current(records)?;
    let mut out = String::from(HEADER);
    for topic in TOPICS {
        let mut these: Vec<&&Record> = now.iter().filter(|r| r.topic == *topic).collect();
        if these.is_empty() {
            continue;
        }
        these.sort_by(|a, b| {
            a.order()
                .total_cmp(&b.order())
                .then_with(|| b.date.cmp(&a.date))
                .then_with(|| a.title.cmp(&b.title))
        });
        out.push_str(&format!("\n## {topic}\n"));
        for r in these {
            out.push_str(&render::section(r)?);
        }
    }
    let older = records.len() - now.len();
    out.push_str(&format!(
        "\n---\n\n{} records, {} of them current; the other {older} are replaced by a newer \
         record of the same thing.\n",
        records.len(),
        now.len()
    ));
    Ok(out)
}

/// The page generated from the records of `repo_root/docs/bench`.
pub fn generate(repo_root: &Path) -> Result<String> {
    markdown(&load(&repo_root.join("docs/bench"))?)
}

#[cfg(test)]
mod tests;
