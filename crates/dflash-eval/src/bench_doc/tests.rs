use super::*;

fn record(file: &str, title: &str, date: &str, extra: &str) -> Record {
    let text = format!(
        r#"{{"topic": "Kernels", "title": "{title}", "command": "c", "date": "{date}",
            "device": "d", "reference": null {extra}}}"#
    );
    Record::new(file, serde_json::from_str(&text).unwrap()).unwrap()
}

fn files<'a>(records: &'a [&'a Record]) -> Vec<&'a str> {
    records.iter().map(|r| r.file.as_str()).collect()
}

#[test]
fn the_newest_record_of_a_title_is_current() {
    let rs = vec![
        record("a.json", "x", "2026-12-01", ""),
        record("b.json", "x", "2026-12-03", ""),
        record("c.json", "y", "2026-12-02", ""),
    ];
    assert_eq!(files(&current(&rs).unwrap()), ["b.json", "c.json"]);
}

#[test]
fn supersedes_settles_a_tie_and_reaches_across_titles() {
    let tie = vec![
        record("a.json", "x", "2026-12-01", ""),
        record("b.json", "x", "2026-12-01", ""),
    ];
    let err = current(&tie).unwrap_err().to_string();
    assert!(err.contains("both current"), "{err}");
    let settled = vec![
        record("a.json", "x", "2026-12-01", ""),
        record("b.json", "x", "2026-12-01", r#", "supersedes": ["a.json"]"#),
        record("c.json", "z", "2026-11-30", ""),
        record("d.json", "y", "2026-12-02", r#", "supersedes": ["c.json"]"#),
    ];
    assert_eq!(files(&current(&settled).unwrap()), ["b.json", "d.json"]);
}

#[test]
fn a_record_cannot_supersede_a_missing_or_newer_one() {
    let missing = vec![record(
        "a.json",
        "x",
        "2026-12-01",
        r#", "supersedes": ["z.json"]"#,
    )];
    assert!(current(&missing).is_err());
    let newer = vec![
        record("a.json", "x", "2026-12-01", r#", "supersedes": ["b.json"]"#),
        record("b.json", "y", "2026-12-02", ""),
    ];
    assert!(current(&newer).is_err());
}

#[test]
fn a_record_needs_a_known_topic_and_a_title() {
    let no_title = r#"{"topic": "Kernels", "command": "c", "date": "d", "device": "d"}"#;
    assert!(Record::new("a.json", serde_json::from_str(no_title).unwrap()).is_err());
    let topic = r#"{"topic": "Other", "title": "t", "command": "c", "date": "d", "device": "d"}"#;
    assert!(Record::new("a.json", serde_json::from_str(topic).unwrap()).is_err());
}

#[test]
fn a_section_shows_the_filtered_rows_and_what_they_share() {
    let r = record(
        "a.json",
        "The thing",
        "2026-12-01",
        r#", "show": {"mode": ["dflash", null]},
           "rows": [{"impl": "dflash-rs", "mode": "dflash", "tau": 2.123456, "commit": "abc1234"},
                    {"impl": "dflash-rs", "mode": "ar", "tau": 1.0},
                    {"impl": "transformers", "tau": 0.5}]"#,
    );
    let text = render::section(&r).unwrap();
    assert!(text.starts_with("### The thing\n[a.json](bench/a.json) · 2026-12-01 · d."));
    assert!(text.contains("No reference."));
    assert!(
        text.contains("| impl | mode | tau |\n|---|---|---|\n"),
        "{text}"
    );
    assert!(
        text.contains("| dflash-rs | dflash | 2.123 |\n| transformers |  | 0.5 |\n"),
        "{text}"
    );
    assert!(text.contains("2 of the record's 3 rows."), "{text}");
    assert!(!text.contains("abc1234"));
}

#[test]
fn nested_rows_expand_and_numbers_round_for_reading() {
    let r = record(
        "a.json",
        "t",
        "2026-12-01",
        r#", "rows": [{"rule": "r", "modes": [{"mode": "ar", "x": 1}, {"mode": "dflash", "x": 2}]}]"#,
    );
    let text = render::section(&r).unwrap();
    assert!(text.contains("Every row: rule r."), "{text}");
    assert!(text.contains("| ar | 1 |\n| dflash | 2 |\n"), "{text}");
    let n = |s: &str| render::number(&serde_json::from_str(s).unwrap());
    assert_eq!(n("1.0"), "1.0");
    assert_eq!(n("2.13"), "2.13");
    assert_eq!(n("1.078346773541437"), "1.078");
    assert_eq!(n("0.0052123"), "0.005212");
    assert_eq!(n("22263"), "22263");
    assert_eq!(n("1234.56789"), "1234.6");
}
