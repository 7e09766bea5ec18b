//! `data generate --batch-size N` with a hybrid target (the random tiny Qwen3.5, Gated DeltaNet
//! and gated attention layers): the shards of a batched run equal those of one sequence at a
//! time, byte for byte, greedy and sampled, with fewer slots than prompts.

use candle_core::DType;
use dflash_core::sampling::SamplingParams;
use dflash_testkit::*;
use dflash_train::prompts::Prompt;
use dflash_train::regen::{regenerate, RegenOptions};

fn prompts(n: usize) -> Vec<Prompt> {
    let text: String = (0..n)
        .map(|i| {
            let words: Vec<String> = (0..3 + 5 * (i % 4))
                .map(|j| format!("t{}", (7 * i + 13 * j) % 250))
                .collect();
            format!("{{\"prompt\": \"{}\"}}\n", words.join(" "))
        })
        .collect();
    let f = tmp("regen-hybrid-prompts").join("p.jsonl");
    std::fs::write(&f, text).unwrap();
    dflash_train::prompts::load(f.to_str().unwrap(), 100).unwrap()
}

fn opts(batch_size: usize, sampling: SamplingParams) -> RegenOptions {
    RegenOptions {
        max_new_tokens: 12,
        loop_window: 0,
        sampling,
        prompts_per_shard: 4,
        batch_size,
        cuda_graphs: false,
        time_limit: None,
        source: "p.jsonl".into(),
        target_name: "qwen35-tiny".into(),
    }
}

#[test]
fn batched_regeneration_of_a_hybrid_target_equals_one_at_a_time() {
    let lt = load(&fixtures().join("qwen35-tiny"), DType::F32);
    assert!(lt.target.is_hybrid());
    let ps = prompts(10);
    for (name, sampling) in [
        ("greedy", SamplingParams::default()),
        ("sampled", SamplingParams::new(0.8, 0.95, 0, 11).unwrap()),
    ] {
        let one = tmp(&format!("regen-hybrid-{name}-1"));
        regenerate(&lt, &ps, &one, &opts(1, sampling)).unwrap();
        let want = shard_files(&one);
        assert_eq!(want.len(), 3, "{name}");
        for batch in [3, 16] {
            let out = tmp(&format!("regen-hybrid-{name}-{batch}"));
            regenerate(&lt, &ps, &out, &opts(batch, sampling)).unwrap();
            assert_eq!(shard_files(&out), want, "{name}, batch {batch}");
        }
    }
}
