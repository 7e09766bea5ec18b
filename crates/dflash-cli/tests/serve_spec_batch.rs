//! `dflash-rs serve --batch-speculation on` over real sockets: requests decoding together draft
//! their chains and are verified in one forward per round; at T = 0 every response equals AR's
//! at concurrency 4 (both CPU products modes) and 16 (integer products), with the chain every
//! round (`--mode dflash`) and with the policy choosing per round (`--mode auto`).

use dflash_testkit::http::{metric, ServerProcess};
use dflash_testkit::serve::{ar_reference, assert_responses, responses};

const BIN: &str = env!("CARGO_BIN_EXE_dflash-rs");

fn metric_with(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name_and_labels} not in\n{text}"))
}

fn assert_lossless(products: &str, mode: &str, concurrencies: &[usize]) {
    let n = 32;
    let want = ar_reference(n, products == "q8");
    let args = [
        "serve",
        "--target",
        "smollm2-135m",
        "--port",
        "0",
        "--cpu-products",
        products,
        "--max-batch",
        "16",
        "--batch-speculation",
        "on",
        "--mode",
        mode,
    ];
    let s = ServerProcess::start(BIN, &args);
    for &concurrency in concurrencies {
        let what = format!("{products} products, {mode}, concurrency {concurrency}");
        assert_responses(&responses(&s, n, concurrency), &want, &what);
    }
    let m = s.request("GET", "/metrics", None).body;
    let drafted = metric_with(
        &m,
        "dflash:batch_rounds_total{model_name=\"smollm2-135m\",kind=\"draft\"}",
    );
    assert!(drafted > 0.0, "no batch round drafted:\n{m}");
    assert_eq!(metric(&m, "vllm:num_requests_running"), 0.0);
}

#[test]
fn t0_batched_chains_equal_ar_with_exact_products() {
    // f32 products on two cores: one concurrency keeps the test short
    assert_lossless("exact", "dflash", &[4]);
}

#[test]
fn t0_batch_rounds_the_policy_chooses_equal_ar_with_integer_products() {
    assert_lossless("q8", "auto", &[4, 16]);
}

#[test]
fn a_hybrid_target_is_refused_by_name() {
    let dir = dflash_testkit::fixtures().join("qwen35-tiny");
    let drafter = dflash_testkit::fixtures().join("dflash-tiny/hybrid");
    let out = std::process::Command::new(BIN)
        .args(["serve", "--target", dir.to_str().unwrap(), "--drafter"])
        .arg(&drafter)
        .args(["--port", "0", "--batch-speculation", "on"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("attention-only"), "{err}");
}
