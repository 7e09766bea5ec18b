//! `dflash-rs serve` over real sockets: bad requests get OpenAI's error bodies (status, message,
//! type, code and the offending `param`), a streamed bad request is refused before it streams,
//! `/metrics` counts the refusals, and the server goes on answering.

use dflash_testkit::fixtures;
use dflash_testkit::http::{chat_body, metric, token_ids, ServerProcess};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_dflash-rs");

/// The messages of a valid chat body, to splice into the bad ones.
const M: &str = r#""messages":[{"role":"user","content":"hi"}]"#;

/// A bad request: its path, its body, the status it must get and the `param` the error names.
type Case = (&'static str, String, u16, Option<&'static str>);

/// A server on the tiny Qwen3 fixture, defaults otherwise.
fn tiny_server() -> ServerProcess {
    let dir = fixtures().join("qwen3-tiny");
    ServerProcess::start(
        BIN,
        &["serve", "--target", dir.to_str().unwrap(), "--port", "0"],
    )
}

/// Bad chat-completion bodies: broken JSON, a missing field, and each out-of-range field.
fn bad_chat_requests() -> Vec<Case> {
    let chat = "/v1/chat/completions";
    vec![
        (chat, format!("{{{M},"), 400, None),
        (chat, r#"{"max_tokens":5}"#.into(), 400, Some("messages")),
        (
            chat,
            format!(r#"{{{M},"max_tokens":"many"}}"#),
            400,
            Some("max_tokens"),
        ),
        (
            chat,
            format!(r#"{{{M},"max_tokens":0}}"#),
            400,
            Some("max_tokens"),
        ),
        (
            chat,
            format!(r#"{{{M},"max_tokens":-4}}"#),
            400,
            Some("max_tokens"),
        ),
        (
            chat,
            format!(r#"{{{M},"temperature":-0.1}}"#),
            400,
            Some("temperature"),
        ),
        (chat, format!(r#"{{{M},"top_p":1.5}}"#), 400, Some("top_p")),
        (chat, format!(r#"{{{M},"top_p":0}}"#), 400, Some("top_p")),
        (chat, format!(r#"{{{M},"n":3}}"#), 400, Some("n")),
        (
            chat,
            format!(r#"{{{M},"max_tokens":100000}}"#),
            400,
            Some("max_tokens"),
        ),
    ]
}

/// Every bad request: the chat ones, then a prompt too long and one not text, a model the
/// server does not serve, and an endpoint that does not exist.
fn bad_requests() -> Vec<Case> {
    let long = "word ".repeat(600);
    let mut cases = bad_chat_requests();
    cases.extend([
        (
            "/v1/completions",
            json!({"prompt": long}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            r#"{"prompt":7}"#.into(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/chat/completions",
            format!(r#"{{{M},"model":"gpt-9"}}"#),
            404,
            Some("model"),
        ),
        ("/v1/nothing", "{}".into(), 404, None),
    ]);
    cases
}

/// `case` is answered with its status and OpenAI's error body naming its `param`.
fn assert_refused(s: &ServerProcess, (path, body, status, param): &Case) {
    let r = s.request("POST", path, Some(body));
    assert_eq!(r.status, *status, "{path} {body}: {}", r.body);
    let e = &r.json()["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{}",
        r.body
    );
    assert!(
        e["type"].is_string() && e.get("code").is_some(),
        "{}",
        r.body
    );
    if let Some(p) = param {
        assert_eq!(e["param"], json!(p), "{body}: {}", r.body);
    }
}

/// A good request is answered whole: its token ids are its usage's completion tokens.
fn assert_answers(s: &ServerProcess) {
    let ok = s.request(
        "POST",
        "/v1/chat/completions",
        Some(&chat_body("hi", 8, json!({}))),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(
        token_ids(&ok.json()).len(),
        ok.json()["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
}

/// Each bad request gets its status and OpenAI's error body, a streamed bad request is refused
/// before it streams, the server then still answers, and `/metrics` counts the refusals.
#[test]
fn bad_requests_get_openai_errors_and_the_server_goes_on() {
    let s = tiny_server();
    let cases = bad_requests();
    for case in &cases {
        assert_refused(&s, case);
    }
    // and a streamed bad request is refused before it streams
    let bad = s.stream(
        "/v1/chat/completions",
        &format!(r#"{{{M},"stream":true,"top_p":2}}"#),
    );
    assert_eq!(bad.status, 400);
    assert_answers(&s);
    let text = s.request("GET", "/metrics", None).body;
    // every case but the unknown endpoint's went through a completion handler, and the
    // streamed one too
    assert_eq!(
        metric(&text, "dflash:request_refused_total"),
        cases.len() as f64
    );
}
