//! A drafter directory under mutation: its `config.json` and `draft_vocab.json` by JSON-aware
//! mutations (numbers set to 0, −1, huge or fractional values, values replaced by null, strings,
//! arrays or deep nests, keys removed, the text cut or made invalid UTF-8), its
//! `model.safetensors` by mutations of its JSON header (shapes, offsets, dtypes) and of its
//! bytes. Seed: z-lab's random drafter for the tiny target (tests/fixtures/dflash-tiny/quiet)
//! with a draft vocabulary. Every case must end in `Ok` or a clear error
//! ([`dflash_testkit::fuzz`]); the long run is `-- --ignored fuzz_drafter_long`.

use std::path::Path;

use dflash_model::models::drafter::Drafter;
use dflash_model::Target;
use dflash_testkit::fuzz::{fuzz, mutate_json, mutate_safetensors, small_u64s, Counting, Counts};
use rand::Rng;

#[global_allocator]
static ALLOC: Counting = Counting;

const FILES: [&str; 3] = ["config.json", "model.safetensors", "draft_vocab.json"];

/// The seed drafter's three files.
fn seed_files() -> [Vec<u8>; 3] {
    let dir = dflash_testkit::fixtures().join("dflash-tiny/quiet");
    let vocab = serde_json::json!({
        "token_ids": (0..256u32).filter(|t| t % 3 != 0).collect::<Vec<_>>(),
        "source": "every token not a multiple of 3",
    });
    [
        std::fs::read(dir.join(FILES[0])).unwrap(),
        std::fs::read(dir.join(FILES[1])).unwrap(),
        serde_json::to_vec(&vocab).unwrap(),
    ]
}

/// `cases` drafter directories, one file mutated in each (its index the case's first byte),
/// each loaded against the tiny target.
fn fuzz_drafter(cases: usize, rng_seed: u64) -> Counts {
    let target: Target = dflash_testkit::tiny();
    let files = seed_files();
    let fields = small_u64s(&files[1][..files[1].len().min(4096)]);
    let dir = dflash_testkit::tmp(&format!("fuzz-drafter-{rng_seed}"));
    for (f, b) in FILES.iter().zip(&files) {
        std::fs::write(dir.join(f), b).unwrap();
    }
    // the seed case: the config, unchanged
    let seed = [&[0u8][..], &files[0]].concat();
    fuzz(
        "drafter directory",
        &seed,
        cases,
        rng_seed,
        |_, rng| {
            let which = rng.random_range(0..3usize);
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
            let r = Drafter::load_dir(&dir, &target).map(drop);
            std::fs::write(&path, &files[which])?;
            r
        },
    )
}

#[test]
fn fuzz_drafter_seeded() {
    let c = fuzz_drafter(3_000, 1);
    eprintln!("drafter directory: {c:?}");
    assert!(c.ok > 0 && c.errors > 0, "{c:?}");
}

/// The long run: 100,000 cases; prints one JSON object (docs/bench/fuzz-drafter-*).
#[test]
#[ignore]
fn fuzz_drafter_long() {
    let c = fuzz_drafter(100_000, 7);
    println!(
        "{}",
        serde_json::json!({"reader": "drafter directory", "seed": "dflash-tiny/quiet", "counts": c})
    );
}

#[test]
fn the_seed_loads() {
    let target = dflash_testkit::tiny();
    let dir = dflash_testkit::tmp("fuzz-drafter-seed");
    for (f, b) in FILES.iter().zip(seed_files()) {
        std::fs::write(dir.join(f), b).unwrap();
    }
    let d = Drafter::load_dir(Path::new(&dir), &target).unwrap();
    assert_eq!(d.draft_vocab.as_ref().unwrap().token_ids.len(), 170);
}
