//! An HF target directory under mutation: its `config.json`, `tokenizer.json` and
//! `tokenizer_config.json` by JSON-aware mutations (numbers set to 0, −1, huge or fractional
//! values, values replaced by null, strings, arrays or deep nests, keys removed, the text cut
//! or made invalid UTF-8), its `model.safetensors` by mutations of its JSON header (shapes,
//! offsets, dtypes) and of its bytes; loaded as `--target DIR` loads it, then the chat
//! template rendered and a prompt tokenized. Seed: the tiny random Qwen3 of
//! tests/fixtures/qwen3-tiny. Every case must end in `Ok` or a clear error
//! ([`dflash_testkit::fuzz`]); the long run is `-- --ignored fuzz_target_dir_long`.

use candle_core::{DType, Device};
use dflash_model::io::loader::load_target;
use dflash_testkit::fuzz::{fuzz, mutate_json, mutate_safetensors, small_u64s, Counting, Counts};
use rand::Rng;

#[global_allocator]
static ALLOC: Counting = Counting;

const FILES: [&str; 4] = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

fn fuzz_target_dir(cases: usize, rng_seed: u64) -> Counts {
    let src = dflash_testkit::fixtures().join("qwen3-tiny");
    let files: Vec<Vec<u8>> = FILES
        .iter()
        .map(|f| std::fs::read(src.join(f)).unwrap())
        .collect();
    let fields = small_u64s(&files[1][..files[1].len().min(4096)]);
    let dir = dflash_testkit::tmp(&format!("fuzz-target-{rng_seed}"));
    for (f, b) in FILES.iter().zip(&files) {
        std::fs::write(dir.join(f), b).unwrap();
    }
    let seed = [&[0u8][..], &files[0]].concat();
    fuzz(
        "target directory",
        &seed,
        cases,
        rng_seed,
        |_, rng| {
            let which = rng.random_range(0..FILES.len());
            let body = match which {
                1 => mutate_safetensors(&files[1], &fields, rng),
                w => mutate_json(&files[w], rng),
            };
            [&[which as u8][..], &body].concat()
        },
        |case| {
            let which = case[0] as usize;
            let path = dir.join(FILES[which]);
            std::fs::write(&path, &case[1..])?;
            let r = load_target(dir.to_str().unwrap(), DType::F32, &Device::Cpu).and_then(|lt| {
                let ids = lt.tokenizer.prompt_ids("Hello there", true)?;
                lt.tokenizer.decode(&ids).map(drop)
            });
            std::fs::write(&path, &files[which])?;
            r
        },
    )
}

#[test]
fn fuzz_target_dir_seeded() {
    let c = fuzz_target_dir(2_000, 1);
    eprintln!("target directory: {c:?}");
    assert!(c.ok > 0 && c.errors > 0, "{c:?}");
}

/// The long run: 100,000 cases; prints one JSON object (docs/bench/fuzz-target-dir-*).
#[test]
#[ignore]
fn fuzz_target_dir_long() {
    let c = fuzz_target_dir(100_000, 7);
    println!(
        "{}",
        serde_json::json!({"reader": "target directory", "seed": "tests/fixtures/qwen3-tiny", "counts": c})
    );
}
