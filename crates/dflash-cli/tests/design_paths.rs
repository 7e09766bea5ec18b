//! Every code path `docs/DESIGN.md` names exists, so the design document cannot describe a
//! layout the code left: a `dflash_*::module::Item` path resolves through the crate's module
//! files to a file that defines or re-exports the item (a module of a directory: its `mod.rs`
//! or a file under it, where the items it re-exports live); a named source file exists under
//! `crates/`; a named test (a backticked snake_case name of three or more words) is a `fn`
//! somewhere in the crates.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    dflash_testkit::repo_root()
}

/// Every file under `dir` whose name ends with `ext`.
fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, ext, out);
        } else if p.to_string_lossy().ends_with(ext) {
            out.push(p);
        }
    }
}

/// Whether `src` defines or re-exports `name` (an item, a method, a field or a variant).
fn defines(src: &str, name: &str) -> bool {
    let word = |s: &str, at: usize| {
        let end = at + name.len();
        s[end..]
            .chars()
            .next()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
    };
    src.match_indices(name).any(|(at, _)| {
        let before = src[..at].trim_end();
        word(src, at)
            && [
                "fn", "struct", "enum", "trait", "type", "const", "static", "mod", "pub", "{", ",",
                "::", "(", "|",
            ]
            .iter()
            .any(|k| before.ends_with(k))
    })
}

/// The source of the module in `file`: the file, and for a `mod.rs` every file under its
/// directory too (the private submodules whose items it re-exports).
fn module_source(file: &Path) -> String {
    let mut src = std::fs::read_to_string(file).unwrap();
    if file.ends_with("mod.rs") {
        let mut subs = Vec::new();
        files(file.parent().unwrap(), ".rs", &mut subs);
        for p in subs.iter().filter(|p| p.as_path() != file) {
            src.push_str(&std::fs::read_to_string(p).unwrap());
        }
    }
    src
}

/// Resolve `dflash_x::a::b::C::m` through `crates/dflash-x/src`: the error, if it does not.
fn resolve(path: &str) -> Result<(), String> {
    let mut segs = path.split("::");
    let krate = segs.next().unwrap().replace('_', "-");
    let mut dir = root().join("crates").join(&krate).join("src");
    if !dir.is_dir() {
        return Err(format!("no crate {krate}"));
    }
    let mut file = dir.join("lib.rs");
    for seg in segs {
        let (as_file, as_dir) = (dir.join(format!("{seg}.rs")), dir.join(seg).join("mod.rs"));
        if as_file.is_file() {
            file = as_file;
            dir = dir.join(seg);
        } else if as_dir.is_file() {
            file = as_dir;
            dir = dir.join(seg);
        } else {
            if !defines(&module_source(&file), seg) {
                return Err(format!("{} has no `{seg}`", file.display()));
            }
        }
    }
    Ok(())
}

#[test]
fn every_code_path_in_design_md_exists() {
    let design = std::fs::read_to_string(root().join("docs/DESIGN.md")).unwrap();
    let mut sources = Vec::new();
    files(&root().join("crates"), ".rs", &mut sources);
    let all_rs: String = sources
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    let mut checked = 0;
    let mut missing = Vec::new();
    for (i, quoted) in design.split('`').enumerate() {
        if i % 2 == 0 {
            continue;
        }
        let q = quoted.trim_end_matches("()");
        let result = if q.starts_with("dflash_") && q.contains("::") {
            resolve(q)
        } else if q.ends_with(".rs") || q.ends_with(".cu") {
            let found = q.starts_with("crates/") && root().join(q).is_file()
                || sources.iter().any(|p| p.ends_with(q))
                || q.ends_with(".cu") && root().join(q).is_file();
            found.then_some(()).ok_or_else(|| "no such file".into())
        } else if q.split('_').count() >= 3
            && q.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            all_rs
                .contains(&format!("fn {q}("))
                .then_some(())
                .ok_or_else(|| "no such fn".into())
        } else {
            continue;
        };
        checked += 1;
        if let Err(e) = result {
            missing.push(format!("`{q}`: {e}"));
        }
    }
    assert!(checked >= 30, "only {checked} paths found in DESIGN.md");
    assert!(
        missing.is_empty(),
        "docs/DESIGN.md names what does not exist:\n{}",
        missing.join("\n")
    );
}
