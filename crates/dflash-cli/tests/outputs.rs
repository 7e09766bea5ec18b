//! Nothing a user already has is lost: a command refuses an output that holds something it did
//! not write (naming it; `--force` replaces where replacing makes sense), and what it refused
//! stays as it was.

use dflash_testkit::tmp;
use std::path::Path;
use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!err.contains("panicked"), "{err}");
    (out.status.success(), err)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn drafter_init_over_a_trained_drafter_is_refused_unless_forced() {
    let d = tmp("outputs-init");
    let out = d.join("best");
    let init = |force: bool| {
        let mut a = vec!["drafter", "init", "--layers", "1", "--out", s(&out)];
        if force {
            a.push("--force");
        }
        run(&a)
    };
    let (ok, err) = init(false);
    assert!(ok, "{err}");
    // the run's own records beside the weights
    std::fs::write(out.join("training.json"), "{\"steps\": 7000}").unwrap();
    let weights = std::fs::read(out.join("model.safetensors")).unwrap();
    let (ok, err) = init(false);
    assert!(!ok);
    assert!(
        err.contains("already holds config.json, model.safetensors, training.json")
            && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("training.json")).unwrap(),
        "{\"steps\": 7000}"
    );
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        weights
    );
    let (ok, err) = init(true);
    assert!(ok, "{err}");
    // an export into an occupied directory likewise
    let (ok, err) = run(&["drafter", "export", "--from", s(&out), "--out", s(&out)]);
    assert!(!ok && err.contains("already holds"), "{err}");
}

#[test]
fn data_generate_refuses_a_file_and_another_commands_directory() {
    let d = tmp("outputs-generate");
    let prompts = d.join("p.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"hi\"}\n").unwrap();
    let gen = |out: &Path| {
        run(&[
            "data",
            "generate",
            "--prompts",
            s(&prompts),
            "--max-new-tokens",
            "2",
            "--out",
            s(out),
        ])
    };
    let file = d.join("taken.jsonl");
    std::fs::write(&file, "mine").unwrap();
    let (ok, err) = gen(&file);
    assert!(!ok && err.contains("is a file"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
    let run_dir = d.join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::write(run_dir.join("metrics.jsonl"), "").unwrap();
    let (ok, err) = gen(&run_dir);
    assert!(!ok && err.contains("already holds metrics.jsonl"), "{err}");
    assert!(!run_dir.join("manifest.json").exists());
    // its own directory is continued
    let data = d.join("data");
    let (ok, err) = gen(&data);
    assert!(ok, "{err}");
    let (ok, err) = gen(&data);
    assert!(ok, "{err}");
}

#[test]
fn file_outputs_are_refused_unless_forced_and_a_typed_template_reads_its_escapes() {
    let d = tmp("outputs-prompts");
    let src = d.join("src.jsonl");
    std::fs::write(&src, "{\"prompt\": \"Reverse a list.\"}\n").unwrap();
    let out = d.join("prompts.jsonl");
    let prompts = |extra: &[&str]| {
        let mut a = vec!["data", "prompts", "--prompts", s(&src), "--out", s(&out)];
        a.extend_from_slice(extra);
        run(&a)
    };
    let (ok, err) = prompts(&["--template", r"{prompt}\nUse Python."]);
    assert!(ok, "{err}");
    let line: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&out).unwrap().trim()).unwrap();
    assert_eq!(
        line["messages"][0]["content"],
        "Reverse a list.\nUse Python."
    );
    let (ok, err) = prompts(&[]);
    assert!(
        !ok && err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    let (ok, err) = prompts(&["--force"]);
    assert!(ok, "{err}");
}
