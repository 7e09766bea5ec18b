//! Request bodies under mutation: JSON-aware mutations (numbers set to 0, −1, huge or
//! fractional values, values replaced by null, strings, arrays or deep nests, keys removed,
//! the text cut or made invalid UTF-8) of a chat request and of a completion request carrying
//! every field the server reads. Every case must end in a request or an `ApiError` (a 4xx with
//! OpenAI's body), never a panic ([`dflash_testkit::fuzz`]); the long run is
//! `-- --ignored fuzz_requests_long`. The same mutations sent over a socket to a running
//! server: `crates/dflash-cli/tests/serve.rs`.

use dflash_serve::api::parse;
use dflash_testkit::fuzz::{fuzz, mutate_json, Counting, Counts};

#[global_allocator]
static ALLOC: Counting = Counting;

/// The seeds: a chat body and a completion body with every field.
pub fn seeds() -> [Vec<u8>; 2] {
    let chat = serde_json::json!({
        "model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
        ],
        "max_tokens": 16, "max_completion_tokens": 16, "temperature": 0.7, "top_p": 0.9,
        "top_k": 20, "seed": 3, "stop": ["\n\n", "END"], "stream": true, "n": 1,
        "stream_options": {"include_usage": true}, "return_token_ids": true
    });
    let completion = serde_json::json!({
        "model": "m", "prompt": ["Once upon a time"], "max_tokens": 8, "temperature": 0,
        "stop": "\n", "stream": false, "seed": 1
    });
    [
        serde_json::to_vec(&chat).unwrap(),
        serde_json::to_vec(&completion).unwrap(),
    ]
}

fn fuzz_requests(cases: usize, rng_seed: u64) -> [Counts; 2] {
    let [chat, completion] = seeds();
    let run = |chat: bool| {
        move |b: &[u8]| match parse(b, chat) {
            Ok(_) => Ok(()),
            Err(e) => {
                // a failure of the harness, not an error: a refusal must be a 4xx that says why
                assert!(
                    e.status.is_client_error(),
                    "a refusal that is no 4xx: {e:?}"
                );
                assert!(!e.message.is_empty(), "a refusal without a message");
                Err(anyhow::anyhow!(e.message))
            }
        }
    };
    [
        fuzz(
            "chat request",
            &chat,
            cases,
            rng_seed,
            mutate_json,
            run(true),
        ),
        fuzz(
            "completion request",
            &completion,
            cases,
            rng_seed + 1,
            mutate_json,
            run(false),
        ),
    ]
}

#[test]
fn fuzz_requests_seeded() {
    for c in fuzz_requests(3_000, 1) {
        eprintln!("{c:?}");
        assert!(c.ok > 0 && c.errors > 0, "{c:?}");
    }
}

/// The long run: 100,000 cases per endpoint; prints one JSON object per endpoint
/// (docs/bench/fuzz-requests-*).
#[test]
#[ignore]
fn fuzz_requests_long() {
    let [chat, completion] = fuzz_requests(100_000, 7);
    for (reader, c) in [("chat request", chat), ("completion request", completion)] {
        println!("{}", serde_json::json!({"reader": reader, "counts": c}));
    }
}
