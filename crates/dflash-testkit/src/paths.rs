//! Where test inputs are: the committed fixtures, the asset cache, private temporary folders.

use std::path::PathBuf;

/// The root of the checkout under test: `CARGO_MANIFEST_DIR/../..`, read when the test runs
/// (cargo and nextest set it for the test process), not when it was compiled: a build
/// directory shared by several clones may hold a test binary compiled in another one. Example:
/// a test of `~/dflash-rs/crates/dflash-eval` → `~/dflash-rs/crates/dflash-eval/../..`.
pub fn repo_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join("../..")
}

/// `tests/fixtures/` of the repository (what `tests/reference/` wrote).
pub fn fixtures() -> PathBuf {
    repo_root().join("tests/fixtures")
}

/// An empty temporary folder of this process for `name` (removed and made again). The first
/// call of a process also removes the folders of test processes that have exited (Linux: no
/// `/proc/PID`), so repeated test runs do not fill the temporary directory.
pub fn tmp(name: &str) -> PathBuf {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(sweep_exited);
    let d = std::env::temp_dir().join(format!("dflash-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Remove `dflash-test-PID-*` folders whose process has exited. Example: `dflash-test-4242-data`
/// goes when `/proc/4242` does not exist; this process's own folders stay.
fn sweep_exited() {
    if !std::path::Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("dflash-test-")) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
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
