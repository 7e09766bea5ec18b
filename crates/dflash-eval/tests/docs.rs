//! The documentation: docs/BENCHMARKS.md is the page the benchmark records generate.

use std::path::PathBuf;

fn repo_root() -> PathBuf {
    dflash_testkit::repo_root()
}

/// docs/BENCHMARKS.md is the page of docs/bench (`DFLASH_BLESS=1` rewrites it).
#[test]
fn bench_doc_is_current() {
    let root = repo_root();
    let page = dflash_eval::bench_doc::generate(&root).unwrap();
    let path = root.join("docs/BENCHMARKS.md");
    if dflash_core::env::BLESS.is_set() {
        std::fs::write(&path, &page).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == page,
        "docs/BENCHMARKS.md is out of date: DFLASH_BLESS=1 cargo test -p dflash-eval bench_doc"
    );
}
