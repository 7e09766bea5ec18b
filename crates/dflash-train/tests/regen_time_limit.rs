//! `data generate --time-limit`: a run stopped by its limit keeps every response it finished
//! (the shards complete so far, the rest in `pending.jsonl`), so repeated runs always advance
//! and end with the shards of one uninterrupted run, byte for byte, one at a time or batched;
//! a line cut by a kill is decoded again; a pending file of other prompts is refused by name.

use std::time::Duration;

use candle_core::DType;
use dflash_core::sampling::SamplingParams;
use dflash_testkit::*;
use dflash_train::prompts::Prompt;
use dflash_train::regen::{regenerate, RegenOptions};

fn prompts(name: &str, n: usize, offset: usize) -> Vec<Prompt> {
    let text: String = (0..n)
        .map(|i| {
            format!(
                "{{\"prompt\": \"t{} t{} t{}\"}}\n",
                3 + i + offset,
                40 + 7 * i,
                200 - i
            )
        })
        .collect();
    let f = tmp(name).join("p.jsonl");
    std::fs::write(&f, text).unwrap();
    dflash_train::prompts::load(f.to_str().unwrap(), 100).unwrap()
}

fn opts(batch_size: usize, limit: Option<Duration>) -> RegenOptions {
    RegenOptions {
        max_new_tokens: 8,
        loop_window: 0,
        sampling: SamplingParams::new(0.8, 1.0, 0, 5).unwrap(),
        prompts_per_shard: 3,
        batch_size,
        cuda_graphs: false,
        time_limit: limit,
        source: "p.jsonl".into(),
        target_name: "tiny".into(),
    }
}

#[test]
fn time_limited_runs_always_advance_to_the_uninterrupted_shards() {
    let lt = load(&tiny_target_dir("regen-limit"), DType::F32);
    let ps = prompts("regen-limit-prompts", 10, 0);
    let whole = tmp("regen-limit-whole");
    regenerate(&lt, &ps, &whole, &opts(1, None)).unwrap();
    let want = shard_files(&whole);
    assert_eq!(want.len(), 4);
    assert!(!whole.join("pending.jsonl").exists());
    for batch in [1, 4] {
        let out = tmp(&format!("regen-limit-{batch}"));
        let mut runs = 0;
        loop {
            let m = regenerate(&lt, &ps, &out, &opts(batch, Some(Duration::ZERO))).unwrap();
            runs += 1;
            if m.shards.len() == 4 {
                break;
            }
            assert!(runs < 20, "batch {batch}: runs stopped advancing");
            if runs == 2 {
                // a kill while a line was being appended: that prompt is decoded again
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(out.join("pending.jsonl"))
                    .unwrap();
                f.write_all(b"{\"index\": 9, \"sequence\": {\"ids\": [1, 2")
                    .unwrap();
            }
        }
        // a limit of zero stops at the first prompt finished: each run kept at least that one
        assert!(runs >= 3, "batch {batch}: {runs} runs");
        assert_eq!(shard_files(&out), want, "batch {batch}");
        assert!(!out.join("pending.jsonl").exists());
    }
}

#[test]
fn pending_responses_of_other_prompts_are_refused() {
    let lt = load(&tiny_target_dir("regen-pending-other"), DType::F32);
    let out = tmp("regen-pending-other");
    let ps = prompts("regen-pending-a", 10, 0);
    regenerate(&lt, &ps, &out, &opts(1, Some(Duration::ZERO))).unwrap();
    let pending = std::fs::read_to_string(out.join("pending.jsonl")).unwrap();
    assert_eq!(pending.lines().count(), 1, "{pending}");
    let other = prompts("regen-pending-b", 10, 50);
    let e = regenerate(&lt, &other, &out, &opts(1, None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("pending.jsonl") && e.contains("prompt 0"), "{e}");
}
