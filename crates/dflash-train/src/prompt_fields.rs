//! Prompts from named fields of JSON records (`fields:SPEC:PATH`), for problem sets that are
//! neither chat nor `prompt` JSONL: each record's fields in SPEC (`+`-separated, dotted for a
//! nested object) joined by a newline become one user prompt.
//!
//! PATH is a JSONL file, a JSON array or object, or a directory of JSON files (each one record
//! or an array, read in name order); a `.gz` file is read decompressed. Examples:
//! - `fields:passage+question:ASDiv/test.jsonl`, the record `{"passage": "Seven red apples and two
//!   green apples are in the basket.", "question": "How many apples are in the basket?"}` → the
//!   prompt "Seven red apples and two green apples are in the basket.\nHow many apples are in
//!   the basket?";
//! - `fields:doc.text:requests.jsonl.gz`, `{"doc": {"text": "Write a python function …"}}` →
//!   "Write a python function …".
//!
//! A record without one of the fields (or with a non-string one) is an error naming the file,
//! the record and the field.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::prompts::{user, Prompt};

/// `v`'s string at the dotted `path`. Example: `doc.text` in `{"doc": {"text": "a"}}` → "a".
fn get<'a>(v: &'a Value, path: &str) -> Option<&'a str> {
    path.split('.').try_fold(v, |v, k| v.get(k))?.as_str()
}

/// A file's text, decompressed when its name ends in `.gz`.
fn read_text(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut s = String::new();
    if path.extension().is_some_and(|x| x == "gz") {
        flate2::read::GzDecoder::new(f)
            .read_to_string(&mut s)
            .with_context(|| format!("decompressing {}", path.display()))?;
    } else {
        f.read_to_string(&mut s)
            .with_context(|| format!("reading {}", path.display()))?;
    }
    Ok(s)
}

/// A file's records: a JSON array's elements, one JSON object (a pretty-printed file), or one
/// record per non-empty line.
fn records(path: &Path) -> Result<Vec<Value>> {
    let text = read_text(path)?;
    match serde_json::from_str(&text) {
        Ok(Value::Array(a)) => return Ok(a),
        Ok(v @ Value::Object(_)) => return Ok(vec![v]),
        Ok(_) => bail!("{}: neither records nor an array of them", path.display()),
        // JSONL: more than one value
        Err(_) => {}
    }
    crate::data::parse_jsonl(&text, path)
}

/// The files a PATH names: itself, or a directory's `.json` files in name order.
pub fn files(path: &Path) -> Result<Vec<PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut fs = Vec::new();
    for e in std::fs::read_dir(path).with_context(|| format!("reading {}", path.display()))? {
        let p = e?.path();
        if p.is_file() && p.extension().is_some_and(|x| x == "json") {
            fs.push(p);
        }
    }
    fs.sort();
    if fs.is_empty() {
        bail!("{}: no .json files", path.display());
    }
    Ok(fs)
}

/// The prompts of one file: for each record, the fields of `spec` joined by newlines.
pub fn read(spec: &str, file: &Path) -> Result<Vec<Prompt>> {
    let fields: Vec<&str> = spec.split('+').collect();
    if fields
        .iter()
        .any(|f| f.is_empty() || f.split('.').any(str::is_empty))
    {
        bail!("fields '{spec}': expected names joined by '+' (dotted for nested ones), e.g. passage+question or doc.text");
    }
    let mut out = Vec::new();
    for (i, v) in records(file)?.iter().enumerate() {
        let mut parts = Vec::with_capacity(fields.len());
        for f in &fields {
            match get(v, f) {
                Some(s) => parts.push(s),
                None => bail!("{} record {}: no string field '{f}'", file.display(), i + 1),
            }
        }
        out.push(user(parts.join("\n")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pf-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn text(p: &Prompt) -> &str {
        &p.messages[0].content
    }

    #[test]
    fn jsonl_array_gz_and_directory_records_give_their_fields_joined() {
        let d = dir("forms");
        let jl = d.join("a.jsonl");
        std::fs::write(
            &jl,
            "{\"passage\": \"Seven apples.\", \"question\": \"How many?\"}\n\n{\"passage\": \"P\", \"question\": \"Q\"}\n",
        )
        .unwrap();
        let v = read("passage+question", &jl).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(text(&v[0]), "Seven apples.\nHow many?");
        // a gzipped JSON array, a nested field
        let gz = d.join("b.jsonl.gz");
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(
            &mut e,
            b"[{\"doc\": {\"text\": \"Write f.\"}}, {\"doc\": {\"text\": \"Write g.\"}}]",
        )
        .unwrap();
        std::fs::write(&gz, e.finish().unwrap()).unwrap();
        let v = read("doc.text", &gz).unwrap();
        assert_eq!(
            v.iter().map(text).collect::<Vec<_>>(),
            ["Write f.", "Write g."]
        );
        // a directory: one record per .json file, in name order; other files are not read
        let dd = d.join("problems");
        std::fs::create_dir_all(&dd).unwrap();
        std::fs::write(dd.join("b.json"), "{\n  \"d\": \"second\"\n}\n").unwrap();
        std::fs::write(dd.join("a.json"), "{\"d\": \"first\"}").unwrap();
        std::fs::write(dd.join("notes.txt"), "x").unwrap();
        let fs = files(&dd).unwrap();
        assert_eq!(fs.len(), 2);
        let v: Vec<Prompt> = fs.iter().flat_map(|f| read("d", f).unwrap()).collect();
        assert_eq!(v.iter().map(text).collect::<Vec<_>>(), ["first", "second"]);
    }

    #[test]
    fn a_missing_field_a_bad_spec_and_a_bad_line_are_named() {
        let d = dir("bad");
        let f = d.join("c.jsonl");
        std::fs::write(
            &f,
            "{\"question\": \"Q\"}\n{\"passage\": 3, \"question\": \"Q\"}\n",
        )
        .unwrap();
        let e = read("question+passage", &f).unwrap_err().to_string();
        assert!(e.contains("record 1") && e.contains("'passage'"), "{e}");
        let e = read("question+", &f).unwrap_err().to_string();
        assert!(e.contains("expected names joined by '+'"), "{e}");
        std::fs::write(&f, "{\"question\": \"Q\"}\nnot json\n").unwrap();
        let e = format!("{:#}", read("question", &f).unwrap_err());
        assert!(e.contains("line 2"), "{e}");
        let e = files(&dir("empty")).unwrap_err().to_string();
        assert!(e.contains("no .json files"), "{e}");
    }
}
