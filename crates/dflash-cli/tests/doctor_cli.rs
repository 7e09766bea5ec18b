//! `doctor --canary` / `--against` through the binary: the round trip passes (exit 0), a
//! fault in the dump fails (non-zero, the likely cause printed), a missing dump is named.

use dflash_testkit::{fixtures, tmp};
use std::process::Command;

fn doctor(extra: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_dflash-rs"))
        .arg("doctor")
        .arg("--target")
        .arg(fixtures().join("qwen3-tiny"))
        .arg("--drafter")
        .arg(fixtures().join("dflash-tiny/full"))
        .args(extra)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr),
    )
}

#[test]
fn canary_round_trip_through_the_binary() {
    let d = tmp("cli-canary");
    let dump = d.join("dump");
    let (ok, out) = doctor(&["--canary", dump.to_str().unwrap()]);
    assert!(ok, "{out}");
    let (ok, out) = doctor(&["--against", dump.to_str().unwrap()]);
    assert!(ok && out.contains("[PASS] canary: block logits"), "{out}");
    // positions off by one in the dump's JSON
    let j = dump.join("canary.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    for p in m["prompts"].as_array_mut().unwrap() {
        for r in p["rounds"].as_array_mut().unwrap() {
            for x in r["block_positions"].as_array_mut().unwrap() {
                *x = (x.as_u64().unwrap() + 1).into();
            }
        }
    }
    std::fs::write(&j, m.to_string()).unwrap();
    let (ok, out) = doctor(&["--against", dump.to_str().unwrap(), "--json"]);
    assert!(!ok, "{out}");
    assert!(out.contains("block position ids off by 1"), "{out}");
    let (ok, out) = doctor(&["--against", d.join("nowhere").to_str().unwrap()]);
    assert!(!ok && out.contains("canary.json"), "{out}");
}
