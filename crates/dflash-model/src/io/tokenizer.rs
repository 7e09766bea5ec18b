//! Tokenizer, chat template and stop tokens of a target.
//!
//! From an HF directory: `tokenizer.json` + `tokenizer_config.json` (chat template, eos).
//! From a GGUF: the byte-level BPE it embeds (`tokenizer.ggml.*`), rebuilt as a
//! `tokenizers` BPE with the pre-tokenizer its `tokenizer.ggml.pre` names; control tokens
//! become special added tokens, user-defined tokens plain added tokens (as transformers'
//! GGUF loader does). The chat template is rendered with minijinja.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::io::gguf::GgufTokenizerData;

pub struct TextTokenizer {
    pub inner: Tokenizer,
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Generation stops at any of these.
    pub stop_ids: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// GPT-2's byte → printable-char map.
fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap();
    }
    table
}

const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn pre_tokenizer_for(pre: Option<&str>) -> Value {
    let split = |re: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]})
    };
    match pre {
        Some("qwen2") | Some("deepseek-r1-qwen") => split(QWEN2_SPLIT),
        Some("llama3") | Some("llama-bpe") | Some("smaug-bpe") => split(LLAMA3_SPLIT),
        // SmolLM2's own tokenizer.json: digits split one by one, then GPT-2 byte level.
        Some("smollm") => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]}),
        _ => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
        }
    }
}

impl TextTokenizer {
    pub fn from_gguf(t: &GgufTokenizerData) -> Result<Self> {
        if t.model != "gpt2" {
            bail!(
                "GGUF tokenizer model '{}' is not supported (only byte-level BPE 'gpt2')",
                t.model
            );
        }
        if t.tokens.is_empty() {
            bail!("the GGUF has no tokenizer (tokenizer.ggml.tokens is missing)");
        }
        let spell = bytes_to_unicode();
        let alphabet: BTreeSet<char> = spell.iter().copied().collect();
        let respell = |tok: &str| -> String {
            if tok.chars().all(|c| alphabet.contains(&c)) {
                tok.to_string()
            } else {
                tok.bytes().map(|b| spell[b as usize]).collect()
            }
        };
        let mut vocab = serde_json::Map::new();
        for (i, tok) in t.tokens.iter().enumerate() {
            vocab.insert(respell(tok), json!(i));
        }
        let mut added = Vec::new();
        for (i, (tok, ty)) in t.tokens.iter().zip(t.token_types.iter()).enumerate() {
            let special = *ty == 3 && tok.chars().all(|c| alphabet.contains(&c));
            if special || *ty == 4 {
                added.push(
                    json!({"id": i, "content": tok, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": special}),
                );
            }
        }
        let tj = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer_for(t.pre.as_deref()),
            "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": t.merges}
        });
        let inner = Tokenizer::from_bytes(serde_json::to_vec(&tj)?)
            .map_err(|e| anyhow!("building the GGUF tokenizer: {e}"))?;
        let name = |id: Option<u32>| id.and_then(|i| t.tokens.get(i as usize).cloned());
        let mut tk = Self {
            inner,
            chat_template: t.chat_template.clone(),
            bos_token: name(t.bos_id),
            eos_token: name(t.eos_id),
            stop_ids: t.eos_id.into_iter().collect(),
        };
        tk.add_chat_stop_tokens();
        Ok(tk)
    }

    /// `tokenizer.json` and (optionally) `tokenizer_config.json` from an HF directory.
    pub fn from_dir(dir: &Path, eos_ids: &[u32]) -> Result<Self> {
        let tj = dir.join("tokenizer.json");
        if !tj.exists() {
            bail!("missing tokenizer: {} does not exist", tj.display());
        }
        let inner =
            Tokenizer::from_file(&tj).map_err(|e| anyhow!("reading {}: {e}", tj.display()))?;
        let cfg: Value = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            Ok(s) => serde_json::from_str(&s).context("parsing tokenizer_config.json")?,
            Err(_) => json!({}),
        };
        let tok_str = |v: &Value| -> Option<String> {
            v.as_str().map(str::to_string).or_else(|| {
                v.get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string)
            })
        };
        let chat_template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        let mut tk = Self {
            chat_template,
            bos_token: cfg.get("bos_token").and_then(tok_str),
            eos_token: cfg.get("eos_token").and_then(tok_str),
            stop_ids: eos_ids.to_vec(),
            inner,
        };
        if let Some(id) = tk
            .eos_token
            .as_deref()
            .and_then(|e| tk.inner.token_to_id(e))
        {
            tk.stop_ids.push(id);
        }
        tk.add_chat_stop_tokens();
        Ok(tk)
    }

    /// ChatML models end a turn with `<|im_end|>`; `<|endoftext|>` ends a document.
    fn add_chat_stop_tokens(&mut self) {
        for s in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = self.inner.token_to_id(s) {
                if !self.stop_ids.contains(&id) {
                    self.stop_ids.push(id);
                }
            }
        }
        self.stop_ids.sort_unstable();
        self.stop_ids.dedup();
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| anyhow!("tokenizing: {e}"))?
            .get_ids()
            .to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow!("decoding: {e}"))
    }

    /// Render the chat template (`add_generation_prompt` = true).
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        let tpl = self
            .chat_template
            .as_deref()
            .context("this model has no chat template (tokenizer_config.json chat_template or GGUF tokenizer.chat_template)")?;
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", tpl)
            .map_err(|e| anyhow!("chat template does not parse: {e}"))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
            enable_thinking => false,
        };
        env.get_template("chat")?
            .render(ctx)
            .map_err(|e| anyhow!("rendering the chat template: {e}"))
    }

    /// Prompt token ids: chat-templated (`chat`) or raw text.
    pub fn prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        if chat {
            let text = self.apply_chat_template(&[ChatMessage {
                role: "user".into(),
                content: prompt.into(),
            }])?;
            self.encode(&text, false)
        } else {
            self.encode(prompt, true)
        }
    }
}
