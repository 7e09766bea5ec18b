//! `data generate` killed (SIGKILL) mid-run resumes without losing or duplicating a prompt's
//! response: its shards end as an uninterrupted run's, byte for byte; a shard damaged after it
//! was written is refused by name when the run resumes.

use dflash_testkit::tmp;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn generate(prompts: &Path, out: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dflash-rs"));
    c.args(["data", "generate", "--target", "smollm2-135m", "--prompts"])
        .arg(prompts)
        .arg("--out")
        .arg(out)
        .args(["--max-new-tokens", "16", "--shard-size", "2"]);
    c
}

fn shards_written(out: &Path) -> usize {
    std::fs::read_to_string(out.join("manifest.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|m| m["shards"].as_array().map(Vec::len))
        .unwrap_or(0)
}

#[test]
fn a_killed_data_generate_resumes_to_the_same_shards() {
    let d = tmp("regen-kill");
    let prompts = d.join("p.jsonl");
    let text: String = (0..12)
        .map(|i| {
            format!(
                "{{\"prompt\": \"Name {} things you can find in a kitchen.\"}}\n",
                i + 2
            )
        })
        .collect();
    std::fs::write(&prompts, text).unwrap();
    let clean = d.join("clean");
    let o = generate(&prompts, &clean).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(shards_written(&clean), 6);

    // killed once a shard is in the manifest and before the last
    let killed = d.join("killed");
    let mut child = generate(&prompts, &killed).spawn().unwrap();
    let t0 = Instant::now();
    while shards_written(&killed) < 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no shard written in 120 s"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let at_kill = shards_written(&killed);
    assert!(
        at_kill < 6,
        "killed after its last shard: nothing to resume"
    );
    let o = generate(&prompts, &killed).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for i in 0..6 {
        let f = format!("shard-{i:05}.jsonl");
        assert_eq!(
            std::fs::read(killed.join(&f)).unwrap(),
            std::fs::read(clean.join(&f)).unwrap(),
            "{f} (killed with {at_kill} shards written)"
        );
    }
    let manifest = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p.join("manifest.json")).unwrap()).unwrap()
    };
    assert_eq!(manifest(&killed)["shards"], manifest(&clean)["shards"]);

    // a shard damaged after writing: the next run refuses to add to the set
    let f = killed.join("shard-00001.jsonl");
    let damaged = std::fs::read_to_string(&f)
        .unwrap()
        .replacen("\"ids\":[", "\"ids\":[7,", 1);
    std::fs::write(&f, damaged).unwrap();
    let o = generate(&prompts, &killed).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("shard-00001.jsonl does not match the sha256"),
        "{err}"
    );
}
