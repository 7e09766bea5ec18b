//! The real prompt sources the asset script fetches: the truncated ShareGPT V3 file and the
//! evals registry.

use std::path::PathBuf;

fn home() -> PathBuf {
    dflash_model::io::loader::dflash_home()
}

#[test]
fn sharegpt_v3_first_human_turns() {
    let p = home().join("datasets/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-assets.sh sharegpt",
        p.display()
    );
    let prompts = dflash_train::prompts::load(&format!("sharegpt:{}", p.display()), 0).unwrap();
    // ~17.7k complete records, ~11k distinct non-empty first human turns
    assert!(
        (10_000..12_500).contains(&prompts.len()),
        "{} prompts",
        prompts.len()
    );
    assert!(prompts
        .iter()
        .all(|p| p.messages.len() == 1 && p.messages[0].role == "user"));
}

#[test]
fn evals_registry_is_capped_and_deduplicated() {
    let d = home().join("datasets/evals-registry/evals/registry/data");
    assert!(
        d.exists(),
        "{} is missing: run scripts/fetch-assets.sh evals",
        d.display()
    );
    let capped = dflash_train::prompts::load(&format!("evals:{}", d.display()), 5).unwrap();
    let files = walk(&d);
    assert!(
        capped.len() <= files * 5,
        "{} prompts from {files} files",
        capped.len()
    );
    assert!(capped.len() > 1000, "{} prompts", capped.len());
    let mut seen = std::collections::HashSet::new();
    assert!(capped
        .iter()
        .all(|p| seen.insert(serde_json::to_string(&p.messages).unwrap())));
}

fn walk(d: &std::path::Path) -> usize {
    std::fs::read_dir(d)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p)
            } else {
                (p.extension().is_some_and(|x| x == "jsonl")) as usize
            }
        })
        .sum()
}
