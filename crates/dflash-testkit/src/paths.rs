//! Where test inputs are: the committed fixtures, the asset cache, private temporary folders.

use std::path::PathBuf;

/// `tests/fixtures/` of the repository (what `tests/reference/` wrote).
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// An empty temporary folder of this process for `name` (removed and made again).
pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dflash-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A cached asset under `$DFLASH_HOME`, or a panic that says how to fetch it
/// (`scripts/fetch-assets.sh FETCH`).
pub fn asset(rel: &str, fetch: &str) -> PathBuf {
    let p = dflash_model::io::loader::dflash_home().join(rel);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-assets.sh {fetch}",
        p.display()
    );
    p
}

/// SmolLM2-135M-Instruct's Q4_1 GGUF in the asset cache.
pub fn smollm2_gguf() -> PathBuf {
    asset(
        "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2",
    )
}
