//! What the server tests share: sixteen everyday chat prompts, their responses from a
//! running server at a concurrency, and AR's tokens for them in-process.

use std::thread;

use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, Mode};
use dflash_model::io::loader::LoadedTarget;
use serde_json::json;

use crate::http::{chat_body, token_ids, ServerProcess};
use crate::{req, smollm2};

/// Everyday chat prompts (writing, facts, code, math, advice).
pub const PROMPTS: [&str; 16] = [
    "Write the opening paragraph of a short story about a lighthouse keeper.",
    "Give me five bullet points about the history of the printing press.",
    "What is the difference between TCP and UDP?",
    "Write a haiku about autumn rain.",
    "Explain what a hash table is to someone who has never programmed.",
    "Write a polite email asking my landlord to fix a leaking kitchen faucet.",
    "Why do leaves change color in the fall?",
    "Suggest a three-day itinerary for a first visit to Rome.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
    "Write a SQL query that lists the ten customers with the most orders.",
    "Convert 72 degrees Fahrenheit to Celsius and show the steps.",
    "What are three tips for sleeping better?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is 17 times 23?",
    "Name four planets of the solar system and one fact about each.",
];

/// The 16 prompts' responses at `concurrency` clients, each sending its share in turn.
pub fn responses(s: &ServerProcess, n: usize, concurrency: usize) -> Vec<Vec<u32>> {
    responses_to(s, &PROMPTS, n, concurrency)
}

/// `prompts`' responses (chat, T = 0, `n` tokens: their token ids) at `concurrency` clients,
/// each sending its share in turn (client c sends prompts c, c + concurrency, …).
pub fn responses_to<P: AsRef<str> + Sync>(
    s: &ServerProcess,
    prompts: &[P],
    n: usize,
    concurrency: usize,
) -> Vec<Vec<u32>> {
    let addr = s.addr.clone();
    let mut out = vec![Vec::new(); prompts.len()];
    thread::scope(|scope| {
        let handles: Vec<_> = (0..concurrency)
            .map(|c| {
                let addr = addr.clone();
                scope.spawn(move || {
                    (c..prompts.len())
                        .step_by(concurrency)
                        .map(|i| {
                            let r = crate::http::request(
                                &addr,
                                "POST",
                                "/v1/chat/completions",
                                Some(&chat_body(prompts[i].as_ref(), n, json!({}))),
                            );
                            assert_eq!(r.status, 200, "{}", r.body);
                            (i, token_ids(&r.json()))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            for (i, ids) in h.join().unwrap() {
                out[i] = ids;
            }
        }
    });
    out
}

/// AR's tokens for `prompts` through the chat template, in-process, `n` tokens each.
pub fn ar_tokens<P: AsRef<str>>(lt: &LoadedTarget, prompts: &[P], n: usize) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|p| {
            let ids = lt.tokenizer.prompt_ids(p.as_ref(), true).unwrap();
            let r = req(&ids, n, SamplingParams::default(), &lt.tokenizer.stop_ids);
            let g = generate(&lt.target, None, Mode::Ar, &r, Default::default(), None);
            g.unwrap().new_tokens
        })
        .collect()
}

/// AR's tokens for the 16 prompts, in-process (`q8`: integer products).
pub fn ar_reference(n: usize, q8: bool) -> Vec<Vec<u32>> {
    let lt = dflash_model::cpu::q8::with_choice(q8, smollm2);
    let products = match q8 {
        true => dflash_core::runtime::CpuProducts::Q8,
        false => dflash_core::runtime::CpuProducts::Exact,
    };
    let config = dflash_core::runtime::RuntimeConfig {
        cpu_products: products,
        ..dflash_core::runtime::installed()
    };
    dflash_core::runtime::with_config(config, || ar_tokens(&lt, &PROMPTS, n))
}

/// Every response equals its reference, token for token; `what` names the run in a failure.
pub fn assert_responses(got: &[Vec<u32>], want: &[Vec<u32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: responses");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "{what}, prompt {i}");
    }
}
