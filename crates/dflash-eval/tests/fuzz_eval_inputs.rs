//! The evaluation side's readers under mutation: evaluation sets (a JSONL file of prompts or
//! messages; GSM8K's, MT-Bench's and MATH-500's files in an asset cache, seeded with their
//! first items) and a canary dump of another stack (`canary.json` by JSON-aware mutations,
//! `canary.safetensors` by mutations of its header and bytes), read and checked by
//! `doctor --against` against the tiny target and drafter. Every case ends in `Ok` or a clear
//! error ([`dflash_testkit::fuzz`]); the long run is `-- --ignored fuzz_eval_inputs_long`.

use std::path::Path;

use candle_core::DType;
use dflash_eval::doctor::{doctor_against, Tolerances};
use dflash_testkit::fuzz::{
    fuzz, mutate_json, mutate_jsonl, mutate_safetensors, small_u64s, Counting, Counts,
};
use rand::Rng;

#[global_allocator]
static ALLOC: Counting = Counting;

/// The first `n` lines of a cached dataset file, or (MATH-500's JSON list) its first items.
fn head(rel: &str, n: usize) -> Vec<u8> {
    let p = dflash_testkit::asset(rel, "datasets");
    let text = std::fs::read_to_string(p).unwrap();
    if rel.ends_with(".json") {
        let all: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        return serde_json::to_vec(&all[..n.min(all.len())]).unwrap();
    }
    text.lines()
        .take(n)
        .flat_map(|l| [l, "\n"])
        .collect::<String>()
        .into_bytes()
}

/// Evaluation sets: the case's first byte names the set (0 a JSONL file, 1 GSM8K, 2 MT-Bench,
/// 3 MATH-500), the rest is its file.
fn fuzz_datasets(cases: usize, rng_seed: u64) -> Counts {
    let jsonl = concat!(
        "{\"prompt\": \"What is 2 + 2?\", \"id\": \"a\"}\n",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Say hi.\"}]}\n"
    )
    .as_bytes()
    .to_vec();
    let sets = [
        ("custom.jsonl", jsonl, ""),
        (
            "datasets/gsm8k/test.jsonl",
            head("datasets/gsm8k/test.jsonl", 3),
            "gsm8k",
        ),
        (
            "datasets/mt-bench/question.jsonl",
            head("datasets/mt-bench/question.jsonl", 3),
            "mt-bench",
        ),
        (
            "datasets/math500/en.json",
            head("datasets/math500/en.json", 3),
            "math500",
        ),
    ];
    let home = dflash_testkit::tmp(&format!("fuzz-datasets-{rng_seed}"));
    for (rel, body, _) in &sets {
        std::fs::create_dir_all(home.join(rel).parent().unwrap()).unwrap();
        std::fs::write(home.join(rel), body).unwrap();
    }
    let seed = [&[0u8][..], &sets[0].1].concat();
    fuzz(
        "evaluation sets",
        &seed,
        cases,
        rng_seed,
        |_, rng| {
            let which = rng.random_range(0..sets.len());
            let body = match which {
                3 => mutate_json(&sets[3].1, rng),
                w => mutate_jsonl(&sets[w].1, rng),
            };
            [&[which as u8][..], &body].concat()
        },
        |case| {
            let (rel, body, name) = &sets[case[0] as usize];
            std::fs::write(home.join(rel), &case[1..])?;
            let p = home.join(rel);
            let spec = match name.is_empty() {
                true => p.to_str().unwrap(),
                false => name,
            };
            let r = dflash_eval::datasets::load(spec, &home, Some(8)).map(drop);
            std::fs::write(home.join(rel), body)?;
            r
        },
    )
}

/// Canary dumps of z-lab's package for the tiny target, checked by `doctor --against`.
fn fuzz_canary(cases: usize, rng_seed: u64) -> Counts {
    let fx = dflash_testkit::fixtures();
    let lt = dflash_testkit::load(&fx.join("qwen3-tiny"), DType::F32);
    let src = fx.join("canary/qwen3-tiny-zlab");
    let files = ["canary.json", "canary.safetensors"];
    let seeds: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(src.join(f)).unwrap())
        .collect();
    let fields = small_u64s(&seeds[1][..seeds[1].len().min(4096)]);
    let dir = dflash_testkit::tmp(&format!("fuzz-canary-{rng_seed}"));
    for (f, b) in files.iter().zip(&seeds) {
        std::fs::write(dir.join(f), b).unwrap();
    }
    let drafter = fx.join("dflash-tiny/full");
    fuzz(
        "canary dump",
        &[&[0u8][..], &seeds[0]].concat(),
        cases,
        rng_seed,
        |_, rng| match rng.random_range(0..2u8) {
            0 => [&[0u8][..], &mutate_json(&seeds[0], rng)].concat(),
            _ => [&[1u8][..], &mutate_safetensors(&seeds[1], &fields, rng)].concat(),
        },
        |case| {
            let which = case[0] as usize;
            std::fs::write(dir.join(files[which]), &case[1..])?;
            let r =
                doctor_against(&lt, &drafter, Path::new(&dir), &Tolerances::default()).map(drop);
            std::fs::write(dir.join(files[which]), &seeds[which])?;
            r
        },
    )
}

#[test]
fn fuzz_eval_inputs_seeded() {
    for (name, c) in [
        ("datasets", fuzz_datasets(2_000, 1)),
        ("canary", fuzz_canary(600, 2)),
    ] {
        eprintln!("{name}: {c:?}");
        assert!(c.ok > 0 && c.errors > 0, "{name}: {c:?}");
    }
}

/// The long run: 100,000 cases per reader; prints one JSON object per reader
/// (docs/bench/fuzz-eval-inputs-*).
#[test]
#[ignore]
fn fuzz_eval_inputs_long() {
    for (reader, c) in [
        ("evaluation sets", fuzz_datasets(100_000, 7)),
        ("canary dump", fuzz_canary(100_000, 8)),
    ] {
        println!("{}", serde_json::json!({"reader": reader, "counts": c}));
    }
}
