//! `dflash-rs serve` with a hybrid target (the random tiny Qwen3.5 with its random DFlash
//! drafter) over real sockets: at T = 0 every response equals AR's alone in-process, whether it
//! decoded alone (speculatively) or in a batch whose slots keep their Gated DeltaNet states
//! (concurrency 1, 3 and 8 over 4 slots).

use std::thread;

use candle_core::DType;
use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, Mode};
use dflash_testkit::http::ServerProcess;
use dflash_testkit::{fixtures, load, req};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_dflash-rs");

/// Eight prompts of the fixture's word-level vocabulary, 3 to 24 words.
fn prompts() -> Vec<String> {
    (0..8)
        .map(|i| {
            (0..3 + 3 * i)
                .map(|j| format!("t{}", (11 * i + 29 * j + 5) % 250))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// Each prompt's response tokens at `concurrency` clients, each sending its share in turn.
fn responses(s: &ServerProcess, n: usize, concurrency: usize) -> Vec<Vec<u32>> {
    let ps = prompts();
    let mut out = vec![Vec::new(); ps.len()];
    thread::scope(|scope| {
        let hs: Vec<_> = (0..concurrency)
            .map(|c| {
                let (ps, addr) = (&ps, s.addr.clone());
                scope.spawn(move || {
                    (c..ps.len())
                        .step_by(concurrency)
                        .map(|i| {
                            let body = json!({"messages": [{"role": "user", "content": ps[i]}],
                                "max_tokens": n, "temperature": 0, "return_token_ids": true});
                            let r = dflash_testkit::http::request(
                                &addr,
                                "POST",
                                "/v1/chat/completions",
                                Some(&body.to_string()),
                            );
                            assert_eq!(r.status, 200, "{}", r.body);
                            let v: Value = r.json();
                            let ids = v["choices"][0]["token_ids"].as_array().unwrap().iter();
                            (i, ids.map(|x| x.as_u64().unwrap() as u32).collect())
                        })
                        .collect::<Vec<(usize, Vec<u32>)>>()
                })
            })
            .collect();
        for h in hs {
            for (i, ids) in h.join().unwrap() {
                out[i] = ids;
            }
        }
    });
    out
}

#[test]
fn hybrid_responses_equal_ar_alone_and_in_batches() {
    let target = fixtures().join("qwen35-tiny");
    let drafter = fixtures().join("dflash-tiny/hybrid");
    let lt = load(&target, DType::F32);
    let n = 64;
    let want: Vec<Vec<u32>> = prompts()
        .iter()
        .map(|p| {
            let ids = lt.tokenizer.prompt_ids(p, true).unwrap();
            let r = req(&ids, n, SamplingParams::default(), &lt.tokenizer.stop_ids);
            let g = generate(&lt.target, None, Mode::Ar, &r, Default::default(), None);
            g.unwrap().new_tokens
        })
        .collect();
    let s = ServerProcess::start(
        BIN,
        &[
            "serve",
            "--target",
            target.to_str().unwrap(),
            "--drafter",
            drafter.to_str().unwrap(),
            "--max-batch",
            "4",
            "--port",
            "0",
        ],
    );
    for concurrency in [1, 3, 8] {
        for (i, (g, w)) in responses(&s, n, concurrency).iter().zip(&want).enumerate() {
            assert_eq!(g, w, "concurrency {concurrency}, prompt {i}");
        }
    }
}
