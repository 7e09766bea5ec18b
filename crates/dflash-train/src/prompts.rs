//! Prompt sources for data regeneration: ShareGPT V3 (first human turns, or every human turn
//! with the conversation before it), the OpenAI evals
//! registry (chat-format `input`, capped per file, deduplicated), or any JSONL with `prompt`
//! or `messages`. Known evaluation sets are refused: training on them would make every
//! evaluation number meaningless.

use std::collections::HashSet;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use dflash_model::io::tokenizer::ChatMessage;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub messages: Vec<ChatMessage>,
}

/// Files that are evaluation sets (GSM8K test, HumanEval, MT-Bench, MATH-500 / mmath).
pub fn is_evaluation_file(p: &Path) -> Option<&'static str> {
    let s = p.to_string_lossy().to_lowercase();
    if s.contains("gsm8k") && s.contains("test") {
        Some("GSM8K test")
    } else if s.contains("humaneval") {
        Some("HumanEval")
    } else if s.contains("mt_bench") || s.contains("mt-bench") {
        Some("MT-Bench")
    } else if s.contains("math500") || s.contains("math-500") || s.contains("mmath") {
        Some("MATH-500")
    } else {
        None
    }
}

/// An error naming the first of `files` that is an evaluation set ([`is_evaluation_file`]).
fn refuse_evaluation_files(files: &[PathBuf]) -> Result<()> {
    match files
        .iter()
        .find_map(|f| is_evaluation_file(f).map(|n| (n, f)))
    {
        Some((name, f)) => bail!(
            "refusing to train on an evaluation set ({name}): {}",
            f.display()
        ),
        None => Ok(()),
    }
}

/// A one-turn prompt: the user's `content`.
pub(crate) fn user(content: String) -> Prompt {
    Prompt {
        messages: vec![ChatMessage {
            role: "user".into(),
            content,
        }],
    }
}

/// Where a template (`data prompts --template`) puts the prompt's text.
pub const TEMPLATE_SLOT: &str = "{prompt}";

/// The last user turn of `p` wrapped in `template`, every [`TEMPLATE_SLOT`] replaced by the
/// turn. Example: "Reverse a list." with "{prompt}\nWrite the solution in Python." → "Reverse a
/// list.\nWrite the solution in Python."; a prompt without a user turn is left as it is.
pub fn apply_template(p: &mut Prompt, template: &str) {
    if let Some(m) = p.messages.iter_mut().rev().find(|m| m.role == "user") {
        m.content = template.replace(TEMPLATE_SLOT, &m.content);
    }
}

/// A template as typed on a command line: `\n`, `\t` and `\\` stand for a newline, a tab and a
/// backslash (a shell passes `"{prompt}\nWrite …"` with the two characters `\` `n`). Example:
/// `{prompt}\nUse Python.` → "{prompt}", a newline, "Use Python.".
pub fn unescape_template(t: &str) -> String {
    let mut out = String::with_capacity(t.len());
    let mut chars = t.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

pub use crate::sharegpt::{sharegpt, Turns};

/// Each non-empty line of a JSONL file, parsed, to `f` with its 1-based number, until `f`
/// returns `Ok(false)`. A malformed line is an error naming it, unless `lenient` (skipped).
/// Example: lines `{"a": 1}`, ``, `{"a": 2}` → `f(1, {"a": 1})`, then `f(3, {"a": 2})`.
fn json_lines(
    path: &Path,
    lenient: bool,
    mut f: impl FnMut(usize, Value) -> Result<bool>,
) -> Result<()> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{} line {}", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(_) if lenient => continue,
            Err(e) => bail!("{} line {}: {e}", path.display(), i + 1),
        };
        if !f(i + 1, v)? {
            break;
        }
    }
    Ok(())
}

/// A JSONL file: each line has `prompt` (a string) or `messages` (chat format); lines with
/// an `input` in chat format (the evals registry) count as `messages`. A malformed line, an
/// empty prompt, and a file without any prompt are errors naming the line or the keys found;
/// lines without a user turn are skipped with a warning that counts them. With `lenient` (the
/// evals registry has malformed lines) such lines are skipped silently.
/// Example: `{"prompt": ""}` on line 3 → "x.jsonl line 3: the prompt is empty".
pub fn jsonl(path: &Path, cap: Option<usize>, lenient: bool) -> Result<Vec<Prompt>> {
    let mut out = Vec::new();
    let (mut skipped, mut first_keys) = (Vec::new(), None);
    json_lines(path, lenient, |n, v| {
        first_keys.get_or_insert_with(|| match v.as_object() {
            Some(o) => {
                let mut keys: Vec<_> = o.keys().cloned().collect();
                keys.sort();
                keys.join(", ")
            }
            None => "none: not an object".to_string(),
        });
        let p = if let Some(s) = v.get("prompt").and_then(|p| p.as_str()) {
            Some(user(s.to_string()))
        } else {
            let msgs = v
                .get("messages")
                .or_else(|| v.get("input"))
                .and_then(|m| m.as_array());
            msgs.map(|m| Prompt {
                messages: m
                    .iter()
                    .filter_map(|t| {
                        Some(ChatMessage {
                            role: t.get("role")?.as_str()?.to_string(),
                            content: t.get("content")?.as_str()?.to_string(),
                        })
                    })
                    .collect(),
            })
            .filter(|p| p.messages.iter().any(|m| m.role == "user"))
        };
        match p {
            Some(p) if last_user_is_empty(&p) => {
                if !lenient {
                    bail!("{} line {n}: the prompt is empty", path.display());
                }
            }
            Some(p) => out.push(p),
            None => skipped.push(n),
        }
        Ok(cap.is_none_or(|c| out.len() < c))
    })?;
    if out.is_empty() && !lenient {
        bail!(
            "{}: no prompts: each line needs a string `prompt` or a `messages` list with a user \
             turn (the first line's keys: {})",
            path.display(),
            first_keys.unwrap_or_else(|| "none: the file is empty".into())
        );
    }
    if !skipped.is_empty() && !lenient {
        let shown: Vec<String> = skipped.iter().take(5).map(|n| n.to_string()).collect();
        eprintln!(
            "warning: {}: {} line(s) without a prompt or a user turn skipped (line {}{})",
            path.display(),
            skipped.len(),
            shown.join(", "),
            if skipped.len() > 5 { ", …" } else { "" }
        );
    }
    Ok(out)
}

/// Whether the last user turn of `p` is empty (or only whitespace).
fn last_user_is_empty(p: &Prompt) -> bool {
    p.messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .is_some_and(|m| m.content.trim().is_empty())
}

/// WritingBench's queries (`writingbench:PATH`, its `benchmark_all.jsonl`): each line's
/// `query` is one user prompt; a line without a string `query` is refused by its number.
/// Example: `{"index": 1, "domain1": "Academic & Engineering", "query": "Write an outline …"}`
/// → the prompt [user "Write an outline …"].
pub fn writingbench(path: &Path) -> Result<Vec<Prompt>> {
    let mut out = Vec::new();
    json_lines(path, false, |n, v| {
        match v.get("query").and_then(|q| q.as_str()) {
            Some(q) => {
                out.push(user(q.to_string()));
                Ok(true)
            }
            None => bail!(
                "{} line {n}: no string \"query\" (a WritingBench file has one per line)",
                path.display()
            ),
        }
    })?;
    Ok(out)
}

fn walk_jsonl(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            walk_jsonl(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "jsonl") {
            out.push(p);
        }
    }
    Ok(())
}

/// A frozen prompt file continued: `old`'s prompts first, in their order (so that a
/// regeneration of `old` resumes on the longer file: `data generate` checks the last shard's
/// prompts), then those of `new` that `old` lacks, in `new`'s order. Returns the list and how
/// many of `new` were left out as repeats.
/// Example: old `[a, b]`, new `[c, b, d]` → `[a, b, c, d]`, 1 already there.
pub fn extend(old: Vec<Prompt>, new: Vec<Prompt>) -> (Vec<Prompt>, usize) {
    // the key `load` deduplicates by
    let key = |p: &Prompt| serde_json::to_string(&p.messages).unwrap_or_default();
    let mut seen: HashSet<String> = old.iter().map(key).collect();
    let (mut out, mut already) = (old, 0);
    for p in new {
        if seen.insert(key(&p)) {
            out.push(p);
        } else {
            already += 1;
        }
    }
    (out, already)
}

/// Load prompts from `source`: `sharegpt:PATH` (first human turns), `sharegpt-turns:PATH`
/// (every human turn with the conversation before it), `evals:DIR` (capped per file),
/// `writingbench:PATH` (WritingBench's queries), `fields:SPEC:PATH` (named fields of JSON records:
/// [`crate::prompt_fields`]), a `.json` ShareGPT file, a `.jsonl` file, or a directory of `.jsonl`
/// files. Deduplicated, in order.
pub fn load(source: &str, cap_per_file: usize) -> Result<Vec<Prompt>> {
    let (kind, path) = match source.split_once(':') {
        Some((k @ ("sharegpt" | "sharegpt-turns" | "evals" | "writingbench" | "jsonl"), p)) => {
            (k, PathBuf::from(p))
        }
        Some(("fields", rest)) => {
            let Some((spec, p)) = rest.split_once(':') else {
                bail!("prompt source '{source}': expected fields:SPEC:PATH, e.g. fields:passage+question:test.jsonl");
            };
            return finish(source, load_fields(spec, Path::new(p))?);
        }
        _ => ("auto", PathBuf::from(source)),
    };
    if !path.exists() {
        bail!("prompt source {} does not exist", path.display());
    }
    let mut files = Vec::new();
    if path.is_dir() {
        walk_jsonl(&path, &mut files)?;
        files.sort();
    } else {
        files.push(path.clone());
    }
    refuse_evaluation_files(&files)?;
    let mut prompts = Vec::new();
    for f in &files {
        let is_json = f.extension().is_some_and(|x| x == "json");
        let mut p = if kind == "sharegpt-turns" {
            sharegpt(f, Turns::Every)?
        } else if kind == "writingbench" {
            writingbench(f)?
        } else if kind == "sharegpt" || (kind == "auto" && is_json) {
            sharegpt(f, Turns::First)?
        } else {
            let cap = (kind == "evals" || path.is_dir()).then_some(cap_per_file);
            jsonl(f, cap, kind == "evals")?
        };
        prompts.append(&mut p);
    }
    finish(source, prompts)
}

/// Deduplicated, in order; none is an error.
fn finish(source: &str, mut prompts: Vec<Prompt>) -> Result<Vec<Prompt>> {
    let mut seen = HashSet::new();
    prompts.retain(|p| seen.insert(serde_json::to_string(&p.messages).unwrap_or_default()));
    if prompts.is_empty() {
        bail!("no prompts found in {source}");
    }
    Ok(prompts)
}

/// `fields:SPEC:PATH` ([`crate::prompt_fields`]), each file checked against the evaluation
/// sets' names first.
fn load_fields(spec: &str, path: &Path) -> Result<Vec<Prompt>> {
    if !path.exists() {
        bail!("prompt source {} does not exist", path.display());
    }
    let files = crate::prompt_fields::files(path)?;
    refuse_evaluation_files(&files)?;
    let mut out = Vec::new();
    for f in &files {
        out.extend(crate::prompt_fields::read(spec, f)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` written to `name` (a relative path) in a per-process directory `dir` under the
    /// temp dir. Example: `temp_file("ev", "gsm8k/test.jsonl", …)` → `/tmp/ev-<pid>/gsm8k/test.jsonl`.
    fn temp_file(dir: &str, name: &str, text: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir()
            .join(format!("{dir}-{}", std::process::id()))
            .join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn a_template_wraps_the_last_user_turn_only() {
        let mut p = Prompt {
            messages: vec![
                ChatMessage {
                    role: "user".into(),
                    content: "first".into(),
                },
                ChatMessage {
                    role: "assistant".into(),
                    content: "answer".into(),
                },
                ChatMessage {
                    role: "user".into(),
                    content: "Reverse a list.".into(),
                },
            ],
        };
        apply_template(&mut p, "{prompt}\nWrite the solution in Python.");
        let c: Vec<&str> = p.messages.iter().map(|m| m.content.as_str()).collect();
        assert_eq!(
            c,
            [
                "first",
                "answer",
                "Reverse a list.\nWrite the solution in Python."
            ]
        );
        // the slot alone leaves it as it is
        let mut q = user("x".into());
        apply_template(&mut q, "{prompt}");
        assert_eq!(q, user("x".into()));
    }

    #[test]
    fn extend_keeps_the_old_order_and_adds_only_new_prompts() {
        let p = |t: &str| user(t.to_string());
        let (all, already) = extend(vec![p("a"), p("b")], vec![p("c"), p("b"), p("d")]);
        assert_eq!(all, vec![p("a"), p("b"), p("c"), p("d")]);
        assert_eq!(already, 1);
        // the same text under another role, or with a system turn, is another prompt
        let sys = Prompt {
            messages: vec![
                ChatMessage {
                    role: "system".into(),
                    content: "be brief".into(),
                },
                ChatMessage {
                    role: "user".into(),
                    content: "a".into(),
                },
            ],
        };
        let (all, already) = extend(vec![p("a")], vec![sys.clone()]);
        assert_eq!((all.len(), already), (2, 0));
        assert_eq!(all[1], sys);
    }

    #[test]
    fn truncated_sharegpt_keeps_complete_records() {
        let p = temp_file(
            "sg",
            "sg.json",
            r#"[{"id":"a","conversations":[{"from":"human","value":"hi there"},{"from":"gpt","value":"x"}]},
{"id":"b","conversations":[{"from":"gpt","value":"no human"}]},
{"id":"c","conversations":[{"from":"human","value":"second"}]}, {"id":"d","conversations":[{"from":"human","value":"cut of"#,
        );
        let v = sharegpt(&p, Turns::First).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].messages[0].content, "second");
    }

    /// Every human turn with the conversation before it (the doc's example), an empty human
    /// turn skipped but kept as context, and a record cut at an unknown speaker.
    #[test]
    fn sharegpt_turns_carry_the_conversation_so_far() {
        let p = temp_file(
            "sgt",
            "sg.json",
            r#"[{"id":"a","conversations":[{"from":"human","value":"a"},{"from":"gpt","value":"b"},{"from":"human","value":"c"},{"from":"gpt","value":"d"}]},
{"id":"b","conversations":[{"from":"gpt","value":"no human first"},{"from":"human","value":"x"}]},
{"id":"c","conversations":[{"from":"human","value":" "},{"from":"gpt","value":"e"},{"from":"human","value":"f"},{"from":"bing","value":"?"},{"from":"human","value":"g"}]}]"#,
        );
        let texts = |v: &[Prompt]| -> Vec<Vec<(String, String)>> {
            v.iter()
                .map(|p| {
                    p.messages
                        .iter()
                        .map(|m| (m.role.clone(), m.content.clone()))
                        .collect()
                })
                .collect()
        };
        let m = |r: &str, c: &str| (r.to_string(), c.to_string());
        let every = sharegpt(&p, Turns::Every).unwrap();
        assert_eq!(
            texts(&every),
            vec![
                vec![m("user", "a")],
                vec![m("user", "a"), m("assistant", "b"), m("user", "c")],
                vec![m("user", " "), m("assistant", "e"), m("user", "f")],
            ]
        );
        let first = sharegpt(&p, Turns::First).unwrap();
        assert_eq!(texts(&first), vec![vec![m("user", "a")]]);
        let loaded = load(&format!("sharegpt-turns:{}", p.display()), 0).unwrap();
        assert_eq!(loaded.len(), 3);
    }

    #[test]
    fn evaluation_sets_are_refused() {
        let p = temp_file("ev", "gsm8k/test.jsonl", "{\"prompt\": \"1+1\"}\n");
        let err = load(p.to_str().unwrap(), 10).unwrap_err().to_string();
        assert!(
            err.contains("refusing to train on an evaluation set (GSM8K test)"),
            "{err}"
        );
    }

    #[test]
    fn writingbench_queries_are_prompts_and_a_line_without_one_is_named() {
        let p = temp_file(
            "wb",
            "benchmark_all.jsonl",
            "{\"index\": 1, \"domain1\": \"Education\", \"query\": \"Write a lesson plan.\", \"checklist\": []}\n\n{\"index\": 2, \"query\": \"Draft a contract.\"}\n{\"index\": 3, \"query\": \"Write a lesson plan.\"}\n",
        );
        let v = load(&format!("writingbench:{}", p.display()), 0).unwrap();
        assert_eq!(
            v,
            vec![
                user("Write a lesson plan.".into()),
                user("Draft a contract.".into())
            ]
        );
        let bad = temp_file(
            "wb",
            "bad.jsonl",
            "{\"query\": \"a\"}\n{\"prompt\": \"b\"}\n",
        );
        let e = load(&format!("writingbench:{}", bad.display()), 0).unwrap_err();
        assert!(e.to_string().contains("line 2: no string \"query\""), "{e}");
    }

    #[test]
    fn jsonl_prompt_and_messages_and_dedup() {
        let p = temp_file("jl", "p.jsonl", "{\"prompt\": \"a\"}\n{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": \"b\"}]}\n{\"prompt\": \"a\"}\n");
        let v = load(p.to_str().unwrap(), 10).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].messages.len(), 2);
    }

    /// An empty prompt is refused by its line, a file without prompts names the keys it has,
    /// a line without a user turn is skipped (and counted), a non-UTF-8 line names the file.
    #[test]
    fn bad_prompt_files_are_named() {
        let e = |name: &str, text: &[u8]| {
            let p = temp_file("jl-bad", name, "");
            std::fs::write(&p, text).unwrap();
            format!("{:#}", load(p.to_str().unwrap(), 10).unwrap_err())
        };
        let err = e(
            "empty.jsonl",
            b"{\"prompt\": \"a\"}\n\n{\"prompt\": \"  \"}\n",
        );
        assert!(
            err.contains("empty.jsonl line 3: the prompt is empty"),
            "{err}"
        );
        let err = e(
            "turn.jsonl",
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\"}]}\n",
        );
        assert!(
            err.contains("turn.jsonl line 1: the prompt is empty"),
            "{err}"
        );
        let err = e("keys.jsonl", b"{\"question\": \"q\", \"answer\": \"a\"}\n");
        assert!(
            err.contains("keys.jsonl: no prompts") && err.contains("answer, question"),
            "{err}"
        );
        let err = e("latin1.jsonl", b"{\"prompt\": \"caf\xe9\"}\n");
        assert!(err.contains("latin1.jsonl line 1"), "{err}");
        let p = temp_file(
            "jl-bad",
            "skip.jsonl",
            "{\"messages\": []}\n{\"prompt\": \"b\"}\n",
        );
        assert_eq!(load(p.to_str().unwrap(), 10).unwrap().len(), 1);
    }

    #[test]
    fn a_typed_template_reads_its_escapes() {
        assert_eq!(
            unescape_template(r"{prompt}\nUse Python.\tOk \\n \q"),
            "{prompt}\nUse Python.\tOk \\n \\q"
        );
        assert_eq!(unescape_template("trailing \\"), "trailing \\");
    }
}
