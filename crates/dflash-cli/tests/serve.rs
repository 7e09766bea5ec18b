//! `dflash-rs serve` over real sockets: T = 0 responses equal AR's alone and in batches of 4
//! and 16 in both CPU products modes, seeded sampling reproducible, a bounded queue, clients
//! that go away, SIGTERM, a bounded load counted by `/metrics`, a soak, mutated bodies, and the
//! official `openai` Python client (OpenAI's errors for bad requests: serve_errors.rs).

use std::thread;
use std::time::{Duration, Instant};

use dflash_testkit::fixtures;
use dflash_testkit::http::{chat_body, metric, token_ids, ServerProcess};
use dflash_testkit::serve::{ar_reference, assert_responses, responses, PROMPTS};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_dflash-rs");

fn smollm2_server(extra: &[&str]) -> ServerProcess {
    let mut args = vec!["serve", "--target", "smollm2-135m", "--port", "0"];
    args.extend_from_slice(extra);
    ServerProcess::start(BIN, &args)
}

fn tiny_server(extra: &[&str]) -> ServerProcess {
    let dir = fixtures().join("qwen3-tiny");
    let mut args = vec!["serve", "--target", dir.to_str().unwrap(), "--port", "0"];
    args.extend_from_slice(extra);
    ServerProcess::start(BIN, &args)
}

fn assert_lossless(products: &str) {
    let n = 40;
    let want = ar_reference(n, products == "q8");
    let s = smollm2_server(&["--cpu-products", products, "--max-batch", "16"]);
    for concurrency in [1, 4, 16] {
        let what = format!("{products} products, concurrency {concurrency}");
        assert_responses(&responses(&s, n, concurrency), &want, &what);
    }
    let m = s.request("GET", "/metrics", None).body;
    // 16 of the 48 requests ran alone, speculatively
    assert!(metric(&m, "vllm:spec_decode_num_drafts") > 0.0, "{m}");
    assert_eq!(metric(&m, "vllm:num_requests_running"), 0.0);
}

#[test]
fn t0_responses_equal_ar_alone_and_in_batches_with_exact_products() {
    assert_lossless("exact");
}

#[test]
fn t0_responses_equal_ar_alone_and_in_batches_with_integer_products() {
    assert_lossless("q8");
}

fn metric_with(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn a_seeded_sampled_request_alone_is_reproducible() {
    let s = smollm2_server(&[]);
    let body = chat_body(
        PROMPTS[3],
        32,
        json!({"temperature": 0.8, "top_p": 0.95, "seed": 7}),
    );
    let a = token_ids(
        &s.request("POST", "/v1/chat/completions", Some(&body))
            .json(),
    );
    let b = token_ids(
        &s.request("POST", "/v1/chat/completions", Some(&body))
            .json(),
    );
    assert_eq!(a, b);
    assert!(!a.is_empty());
}

/// Wait (≤ 20 s) until `/metrics` satisfies `ok`.
fn wait_metrics(s: &ServerProcess, ok: impl Fn(&str) -> bool) -> String {
    let t = Instant::now();
    loop {
        let m = s.request("GET", "/metrics", None).body;
        if ok(&m) {
            return m;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "metrics never got there:\n{m}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_full_queue_answers_503_with_retry_after_and_a_client_that_goes_away_frees_its_slot() {
    let s = smollm2_server(&["--max-batch", "1", "--max-queue", "1", "--mode", "ar"]);
    // a raw completion that counts on: no end of text before its length
    let long = |n: usize| {
        json!({"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": n, "temperature": 0,
               "stream": true})
        .to_string()
    };
    let mut a = s.stream("/v1/completions", &long(2000));
    assert_eq!(a.status, 200);
    a.next_data().expect("a first chunk");
    // B waits in the queue (its stream is open: it was accepted), C finds the queue full
    let mut b = s.stream("/v1/completions", &long(4));
    assert_eq!(b.status, 200);
    wait_metrics(&s, |m| metric(m, "vllm:num_requests_waiting") == 1.0);
    let c = s.request(
        "POST",
        "/v1/chat/completions",
        Some(&chat_body("hi", 4, json!({}))),
    );
    assert_eq!(c.status, 503, "{}", c.body);
    assert_eq!(c.header("retry-after"), Some("1"));
    // A goes away: its slot is freed and B runs to its end
    a.close();
    let (events, done) = b.rest();
    assert!(done && !events.is_empty(), "{events:?}");
    let m = wait_metrics(&s, |m| metric(m, "vllm:num_requests_running") == 0.0);
    assert_eq!(
        metric_with(
            &m,
            "vllm:request_success_total{model_name=\"smollm2-135m\",finished_reason=\"abort\"}"
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric_with(
            &m,
            "dflash:request_refused_total{model_name=\"smollm2-135m\",status=\"503\"}"
        ),
        1.0,
        "{m}"
    );
}

#[test]
fn sigterm_finishes_what_is_in_flight_and_exits_0() {
    let mut s = smollm2_server(&[]);
    let mut a = s.stream(
        "/v1/chat/completions",
        &chat_body(PROMPTS[0], 48, json!({"stream": true})),
    );
    a.next_data().expect("a first chunk");
    s.term();
    let (events, done) = a.rest();
    assert!(done, "the stream in flight was cut: {events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");
    let status = s.wait(60);
    assert!(status.success(), "exit {status:?}: {}", s.log());
}

#[test]
fn a_bounded_load_is_answered_whole_and_counted() {
    let s = tiny_server(&["--max-batch", "4", "--max-queue", "64"]);
    let (clients, per_client) = (8, 6);
    let total_tokens: u64 = thread::scope(|scope| {
        let hs: Vec<_> = (0..clients)
            .map(|c| {
                let s = &s;
                scope.spawn(move || {
                    let mut tokens = 0;
                    for i in 0..per_client {
                        let n = 5 + (c * 7 + i * 3) % 40;
                        let body = json!({"prompt": format!("request {c} {i}"), "max_tokens": n,
                                          "temperature": 0.7, "seed": i, "stream": i % 2 == 0,
                                          "stream_options": {"include_usage": true}});
                        if i % 2 == 0 {
                            let mut st = s.stream("/v1/completions", &body.to_string());
                            let (ev, done) = st.rest();
                            assert!(done);
                            let usage: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
                            tokens += usage["usage"]["completion_tokens"].as_u64().unwrap();
                        } else {
                            let r = s.request("POST", "/v1/completions", Some(&body.to_string()));
                            assert_eq!(r.status, 200, "{}", r.body);
                            tokens += r.json()["usage"]["completion_tokens"].as_u64().unwrap();
                        }
                    }
                    tokens
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    let m = wait_metrics(&s, |m| metric(m, "vllm:num_requests_running") == 0.0);
    assert_eq!(
        metric(&m, "vllm:request_success_total"),
        (clients * per_client) as f64,
        "{m}"
    );
    assert_eq!(
        metric(&m, "vllm:generation_tokens_total"),
        total_tokens as f64,
        "{m}"
    );
    assert_eq!(metric(&m, "vllm:num_requests_waiting"), 0.0);
    assert_eq!(
        metric(&m, "vllm:time_to_first_token_seconds_count"),
        (clients * per_client) as f64
    );
}

#[test]
fn the_official_openai_client_talks_to_it() {
    let py = dflash_testkit::asset("py/openai-3.63.0/openai/__init__.py", "openai");
    let site = py.parent().unwrap().parent().unwrap();
    let s = smollm2_server(&[]);
    let script = dflash_testkit::repo_root().join("tests/clients/openai_client.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}/v1", s.addr))
        .arg("smollm2-135m")
        .env("PYTHONPATH", site)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], json!(true));
}

/// A bounded soak: 1,000 requests from up to 10 clients at once (slots 4 + queue 6), a fifth of
/// them going away mid-stream and a tenth bad; at the end every good request was answered
/// whole, no request is left running or waiting, resident memory grew by less than 64 MiB over
/// a warmed-up server, and the server still answers.
#[test]
fn a_soak_with_disconnects_and_bad_requests_leaks_nothing() {
    use rand::{Rng, SeedableRng};
    let s = tiny_server(&["--max-batch", "4", "--max-queue", "64"]);
    let warm = json!({"prompt": "warm up", "max_tokens": 64, "temperature": 0});
    for _ in 0..8 {
        assert_eq!(
            s.request("POST", "/v1/completions", Some(&warm.to_string()))
                .status,
            200
        );
    }
    let rss0 = s.rss_kib();
    let (requests, clients) = (1000usize, 10usize);
    let (answered, gone, bad) = thread::scope(|scope| {
        let hs: Vec<_> = (0..clients)
            .map(|c| {
                let s = &s;
                scope.spawn(move || {
                    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(c as u64);
                    let (mut answered, mut gone, mut bad) = (0, 0, 0);
                    for i in (c..requests).step_by(clients) {
                        let n = rng.random_range(4..120);
                        let body = json!({"prompt": format!("soak {i}"), "max_tokens": n,
                                          "temperature": 0.5, "seed": i, "stream": true});
                        match rng.random_range(0..10) {
                            0 => {
                                let r =
                                    s.request("POST", "/v1/completions", Some(r#"{"prompt": 5}"#));
                                assert_eq!(r.status, 400);
                                bad += 1;
                            }
                            1 | 2 => {
                                let mut st = s.stream("/v1/completions", &body.to_string());
                                assert_eq!(st.status, 200);
                                st.next_data();
                                st.close();
                                gone += 1;
                            }
                            _ => {
                                let mut st = s.stream("/v1/completions", &body.to_string());
                                let (ev, done) = st.rest();
                                assert!(done && !ev.is_empty(), "request {i}: {ev:?}");
                                answered += 1;
                            }
                        }
                    }
                    (answered, gone, bad)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2))
    });
    assert_eq!(answered + gone + bad, requests);
    assert!(gone > 20 && bad > 10, "{gone} gone, {bad} bad");
    let m = wait_metrics(&s, |m| {
        metric(m, "vllm:num_requests_running") == 0.0
            && metric(m, "vllm:num_requests_waiting") == 0.0
    });
    // every accepted request (and the 8 warm-ups) ended once: finished (stop, length) or
    // aborted (gone)
    assert_eq!(
        metric(&m, "vllm:request_success_total"),
        (8 + answered + gone) as f64,
        "{m}"
    );
    if let (Some(a), Some(b)) = (rss0, s.rss_kib()) {
        assert!(
            b < a + 64 * 1024,
            "resident memory grew from {a} KiB to {b} KiB"
        );
    }
    assert_eq!(
        s.request("POST", "/v1/completions", Some(&warm.to_string()))
            .status,
        200
    );
}

/// Mutated request bodies over the socket (the JSON-aware mutations of
/// `dflash_testkit::fuzz::mutate_json` on a chat body with every field): each is answered
/// with 200 or a 4xx carrying OpenAI's error body, never a 5xx; the server then still answers.
#[test]
fn mutated_request_bodies_are_answered_or_refused() {
    use rand::SeedableRng;
    let s = tiny_server(&["--max-batch", "4"]);
    let seed = json!({
        "model": s_model(&s), "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3,
        "stop": ["\n\n"], "stream": false, "n": 1
    })
    .to_string();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let (mut ok, mut refused) = (0, 0);
    for i in 0..1000 {
        let body = dflash_testkit::fuzz::mutate_json(seed.as_bytes(), &mut rng);
        // the client sends bytes; a body that is not UTF-8 goes as its lossy text
        let body = String::from_utf8_lossy(&body).into_owned();
        let r = s.request("POST", "/v1/chat/completions", Some(&body));
        match r.status {
            200 => ok += 1,
            400..=499 => {
                let e = &r.json()["error"];
                assert!(e["message"].is_string(), "case {i}: {}", r.body);
                refused += 1;
            }
            s => panic!("case {i}: HTTP {s} for {body}: {}", r.body),
        }
    }
    assert!(ok > 10 && refused > 10, "{ok} answered, {refused} refused");
    let good = s.request("POST", "/v1/chat/completions", Some(&seed));
    assert_eq!(good.status, 200, "{}", good.body);
}

/// The one model a server serves.
fn s_model(s: &ServerProcess) -> String {
    s.request("GET", "/v1/models", None).json()["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_string()
}
