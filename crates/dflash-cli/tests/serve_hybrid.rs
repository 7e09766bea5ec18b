//! `dflash-rs serve` with a hybrid target (the random tiny Qwen3.5 with its random DFlash
//! drafter) over real sockets: at T = 0 every response equals AR's alone in-process, whether it
//! decoded alone (speculatively) or in a batch whose slots keep their Gated DeltaNet states
//! (concurrency 1, 3 and 8 over 4 slots).

use candle_core::DType;
use dflash_testkit::http::ServerProcess;
use dflash_testkit::serve::{ar_tokens, assert_responses, responses_to};
use dflash_testkit::{fixtures, load};

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
#[test]
fn hybrid_responses_equal_ar_alone_and_in_batches() {
    let target = fixtures().join("qwen35-tiny");
    let drafter = fixtures().join("dflash-tiny/hybrid");
    let lt = load(&target, DType::F32);
    let n = 64;
    let want = ar_tokens(&lt, &prompts(), n);
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
        let got = responses_to(&s, &prompts(), n, concurrency);
        assert_responses(&got, &want, &format!("concurrency {concurrency}"));
    }
}
