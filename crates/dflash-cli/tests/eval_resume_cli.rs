//! `eval` interrupted by its time limit continues with the same command: each run adds an
//! item (the report covers 1, 2, then 3 of 3), other settings are refused naming the journal,
//! and `--force` starts over.

use std::process::Command;

fn eval(out: &std::path::Path, max_new: &str, extra: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
        .args([
            "eval",
            "--target",
            "smollm2-135m",
            "--dataset",
            "gsm8k",
            "--limit",
            "3",
        ])
        .args([
            "--modes",
            "ar",
            "--warmup-tokens",
            "0",
            "--max-new-tokens",
            max_new,
            "--out",
        ])
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn items_done(out: &std::path::Path) -> u64 {
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    r["items_done"].as_u64().unwrap()
}

#[test]
fn a_time_limited_eval_continues_with_the_same_command() {
    let out = dflash_testkit::tmp("eval-resume-cli").join("out");
    for n in 1..=3 {
        let (ok, err) = eval(&out, "8", &["--time-limit", "0"]);
        assert!(ok, "{err}");
        assert_eq!(items_done(&out), n);
        if n > 1 {
            assert!(
                err.contains(&format!("resuming: {} of 3 items", n - 1)),
                "{err}"
            );
        }
    }
    let (ok, err) = eval(&out, "9", &[]);
    assert!(
        !ok && err.contains("runs.jsonl") && err.contains("another evaluation"),
        "{err}"
    );
    let (ok, err) = eval(&out, "9", &["--force", "--time-limit", "0"]);
    assert!(ok, "{err}");
    assert_eq!(items_done(&out), 1, "--force starts over");
}
