//! `dflash-rs data prompts`: a prompt quoting an evaluation item is counted, and dropped with
//! `--drop-eval-overlap`; `fields:` sources and their errors. Uses the pinned evaluation sets
//! in the asset cache (scripts/fetch-assets.sh datasets).

use dflash_testkit::tmp;
use std::process::Command;

fn data_prompts(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
        .args(["data", "prompts"])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!err.contains("panicked"), "{err}");
    (out.status.success(), err)
}

fn lines(p: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A JSONL of `{"q": …}` records, one per text, in `d`; returns its `fields:q:PATH` source.
fn q_source(d: &std::path::Path, texts: &[&str]) -> String {
    let src = d.join("q.jsonl");
    let lines: String = texts
        .iter()
        .map(|t| serde_json::json!({ "q": t }).to_string() + "\n")
        .collect();
    std::fs::write(&src, lines).unwrap();
    format!("fields:q:{}", src.display())
}

#[test]
fn a_prompt_quoting_a_gsm8k_item_is_counted_and_dropped_on_request() {
    let d = tmp("data-prompts-overlap");
    // GSM8K's first test question (the pinned test.jsonl), reworded around a 13-word run of it
    let spec = q_source(
        &d,
        &[
            "Homework: Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning. Solve it.",
            "Ducks lay eggs. How many eggs does a duck lay per week?",
        ],
    );
    let out = d.join("kept.jsonl");
    let (ok, err) = data_prompts(&["--prompts", &spec, "--out", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(
        err.contains("1 of 2 prompts quote an evaluation item: kept"),
        "{err}"
    );
    assert_eq!(lines(&out).len(), 2);
    let out = d.join("dropped.jsonl");
    let (ok, err) = data_prompts(&[
        "--prompts",
        &spec,
        "--drop-eval-overlap",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let kept = lines(&out);
    assert_eq!(kept.len(), 1, "{err}");
    assert_eq!(
        kept[0]["messages"][0]["content"],
        "Ducks lay eggs. How many eggs does a duck lay per week?"
    );
}

/// `data prompts --prompts SOURCE --out OUT` must fail naming `needle`.
fn source_fails(source: &str, out: &std::path::Path, needle: &str) {
    let (ok, err) = data_prompts(&["--prompts", source, "--out", out.to_str().unwrap()]);
    assert!(
        !ok && err.contains(needle),
        "{needle:?} for {source}: {err}"
    );
}

#[test]
fn fields_sources_name_what_is_wrong() {
    let d = tmp("data-prompts-fields");
    let src = d.join("p.jsonl");
    std::fs::write(&src, "{\"q\": \"a\"}\n{\"r\": \"b\"}\n").unwrap();
    let out = d.join("o.jsonl");
    let spec = |f: &str, p: &std::path::Path| format!("fields:{f}:{}", p.display());
    source_fails(&spec("q", &src), &out, "record 2: no string field 'q'");
    source_fails("fields:q", &out, "expected fields:SPEC:PATH");
    source_fails("fields:q:/nonexistent/p.jsonl", &out, "does not exist");
    // an evaluation file is refused by its name, as for every source
    let ev = d.join("gsm8k").join("test.jsonl");
    std::fs::create_dir_all(ev.parent().unwrap()).unwrap();
    std::fs::write(&ev, "{\"question\": \"x\"}\n").unwrap();
    source_fails(
        &spec("question", &ev),
        &out,
        "refusing to train on an evaluation set (GSM8K test)",
    );
    assert!(!out.exists());
}

#[test]
fn templates_wrap_each_source_and_a_template_without_its_slot_is_refused() {
    let d = tmp("data-prompts-template");
    let spec = q_source(&d, &["Reverse a list.", "Sort a list."]);
    let out = d.join("o.jsonl");
    let o = out.to_str().unwrap();
    // the same source twice: as it is, and wrapped
    let (ok, err) = data_prompts(&[
        "--prompts",
        &spec,
        "--prompts",
        &spec,
        "--template",
        "{prompt}",
        "--template",
        "{prompt}\nWrite the solution in Python.",
        "--out",
        o,
    ]);
    assert!(ok, "{err}");
    let mut texts: Vec<String> = lines(&out)
        .iter()
        .map(|v| v["messages"][0]["content"].as_str().unwrap().to_string())
        .collect();
    texts.sort();
    assert_eq!(
        texts,
        [
            "Reverse a list.",
            "Reverse a list.\nWrite the solution in Python.",
            "Sort a list.",
            "Sort a list.\nWrite the solution in Python."
        ]
    );
    let (ok, err) = data_prompts(&["--prompts", &spec, "--template", "Solve it.", "--out", o]);
    assert!(!ok && err.contains("has no {prompt}"), "{err}");
    let (ok, err) = data_prompts(&[
        "--prompts",
        &spec,
        "--prompts",
        &spec,
        "--prompts",
        &spec,
        "--template",
        "{prompt}",
        "--template",
        "{prompt}!",
        "--out",
        o,
    ]);
    assert!(
        !ok && err.contains("2 --template values for 3 --prompts sources"),
        "{err}"
    );
}
