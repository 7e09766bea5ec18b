//! The environment is read in one registry (`dflash_core::env`), and docs/ENVIRONMENT.md is its
//! page.

use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// A `DFLASH_` variable named in a string literal outside the registry is a read (or a write)
/// that bypasses it: every file of every crate (sources, tests, examples) names variables
/// through `dflash_core::env`'s declarations. Example: `std::env::var("DFLASH_GEMV")` in
/// `ops/gemv.rs` fails here.
#[test]
fn no_variable_is_named_outside_the_registry() {
    let mut files = Vec::new();
    rust_files(&repo_root().join("crates"), &mut files);
    assert!(files.len() > 100, "the crates' sources were not found");
    let mut found = Vec::new();
    for f in &files {
        if f.ends_with("dflash-core/src/env.rs") || f.ends_with("dflash-core/tests/registry.rs") {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in named_lines(&text) {
            found.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
        }
    }
    assert!(
        found.is_empty(),
        "DFLASH_ variables named outside dflash_core::env:\n{}",
        found.join("\n")
    );
    // the search finds a literal where there is one, and no mention in prose
    let sample = "/// `DFLASH_GEMV` in a doc\nlet v = std::env::var(\"DFLASH_GEMV\");\n";
    assert_eq!(named_lines(sample).len(), 1);
    assert_eq!(named_lines(sample)[0].0, 1);
}

/// The lines (0-based) of `text` with a string literal that starts with a `DFLASH_` name.
fn named_lines(text: &str) -> Vec<(usize, &str)> {
    let quote = ['"', 'D', 'F', 'L', 'A', 'S', 'H', '_'];
    let needle: String = quote.iter().collect();
    text.lines()
        .enumerate()
        .filter(|(_, l)| l.contains(&needle))
        .collect()
}

/// docs/ENVIRONMENT.md is the registry's page (`DFLASH_BLESS=1` rewrites it).
#[test]
fn environment_doc_is_current() {
    let path = repo_root().join("docs/ENVIRONMENT.md");
    let page = dflash_core::env::markdown();
    if dflash_core::env::BLESS.is_set() {
        std::fs::write(&path, &page).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == page,
        "docs/ENVIRONMENT.md is out of date: DFLASH_BLESS=1 cargo test -p dflash-core environment_doc"
    );
}
