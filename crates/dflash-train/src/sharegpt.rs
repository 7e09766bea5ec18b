//! ShareGPT V3 as prompts: each record's first human turn, or every human turn with the
//! conversation before it ([`Turns`]), read record by record from a file that may be cut off.

use std::path::Path;

use anyhow::{Context, Result};
use dflash_model::io::tokenizer::ChatMessage;
use serde_json::Value;

use crate::prompts::Prompt;

/// Which human turns of a ShareGPT record become prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turns {
    /// The first human turn alone (`sharegpt:PATH`).
    First,
    /// Every human turn, after the conversation before it (`sharegpt-turns:PATH`). Example: a
    /// record human "a", gpt "b", human "c" gives the prompts [user a] and [user a, assistant
    /// b, user c]; the target then answers "c" in the context the person wrote it in.
    Every,
}

/// ShareGPT's JSON array, record by record; the shipped file is cut off mid-string, so
/// parsing stops at the first incomplete record and keeps the complete ones, saying so on
/// stderr (how many records, where the file breaks off). Records that do
/// not open with a human turn, and turns of another speaker than human, gpt or system, end
/// what a record gives (a conversation is kept only up to where it is well formed).
pub fn sharegpt(path: &Path, turns: Turns) -> Result<Vec<Prompt>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut rest = text
        .trim_start()
        .strip_prefix('[')
        .context("ShareGPT file is not a JSON array")?;
    let (mut out, mut records) = (Vec::new(), 0usize);
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ',');
        if rest.is_empty() || rest.starts_with(']') {
            break;
        }
        let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        match it.next() {
            Some(Ok(rec)) => {
                let used = it.byte_offset();
                rest = &rest[used..];
                records += 1;
                out.extend(sharegpt_record(&rec, turns));
            }
            _ => {
                eprintln!(
                    "note: {} breaks off in record {} (byte {} of {}): the {records} complete \
                     records before it are read",
                    path.display(),
                    records + 1,
                    text.len() - rest.len(),
                    text.len()
                );
                break;
            }
        }
    }
    Ok(out)
}

/// The prompts of one ShareGPT record (see [`sharegpt`]).
fn sharegpt_record(rec: &Value, turns: Turns) -> Vec<Prompt> {
    let conv = rec
        .get("conversations")
        .and_then(|c| c.as_array())
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    // records that start mid-conversation (a "gpt" turn first) are continuation splits whose
    // first human turn lacks its context: only records that open with a human turn count
    if conv
        .first()
        .and_then(|t| t.get("from"))
        .and_then(|f| f.as_str())
        != Some("human")
    {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut so_far: Vec<ChatMessage> = Vec::new();
    for t in conv {
        let role = match t.get("from").and_then(|f| f.as_str()) {
            Some("human") => "user",
            Some("gpt") => "assistant",
            Some("system") => "system",
            _ => break,
        };
        let Some(text) = t.get("value").and_then(|v| v.as_str()) else {
            break;
        };
        so_far.push(ChatMessage {
            role: role.into(),
            content: text.to_string(),
        });
        if role == "user" && !text.trim().is_empty() {
            out.push(Prompt {
                messages: so_far.clone(),
            });
            if turns == Turns::First {
                break;
            }
        } else if role == "user" && turns == Turns::First {
            break;
        }
    }
    out
}
