//! A process killed between the steps of `io::atomic::replace_dir` leaves its destination with
//! the old content or the new one, complete — never neither (`best/` after a crash).

use std::path::{Path, PathBuf};
use std::process::Command;

use dflash_model::io::atomic::{replace_dir, replace_dir_observed, Step};

/// Set for the child process: `DIR|STEP`, the destination and the step after which to abort.
const CHILD: &str = dflash_core::env::ATOMIC_CHILD.name;

fn write_version(dir: &Path, v: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("drafter"))?;
    std::fs::write(dir.join("config.json"), v)?;
    std::fs::write(dir.join("drafter/model.safetensors"), v.repeat(1000))?;
    Ok(())
}

/// The version a directory holds whole, or `None` when it is missing or mixed.
fn version(dir: &Path) -> Option<String> {
    let a = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let b = std::fs::read_to_string(dir.join("drafter/model.safetensors")).ok()?;
    (b == a.repeat(1000)).then_some(a)
}

/// The child half of `killed_between_the_steps`: replaces the directory and aborts after the
/// step it is told (without the variable: nothing to do).
#[test]
fn child_replaces_and_aborts() {
    let Some(spec) = dflash_core::env::ATOMIC_CHILD.get() else {
        return;
    };
    let (dir, step) = spec.split_once('|').unwrap();
    replace_dir_observed(Path::new(dir), |t| write_version(t, "new"), &mut |s| {
        if format!("{s:?}") == step {
            std::process::abort();
        }
    })
    .unwrap();
}

#[test]
fn killed_between_the_steps() {
    let root = std::env::temp_dir().join(format!("dflash-atomic-kill-{}", std::process::id()));
    for (step, want) in [
        (Step::Built, "old"),
        (Step::Synced, "old"),
        (Step::Swapped, "new"),
        (Step::Removed, "new"),
    ] {
        let _ = std::fs::remove_dir_all(&root);
        let best: PathBuf = root.join("best");
        replace_dir(&best, |t| write_version(t, "old")).unwrap();
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_replaces_and_aborts", "--nocapture"])
            .env(CHILD, format!("{}|{step:?}", best.display()))
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "the child did not abort after {step:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            version(&best).as_deref(),
            Some(want),
            "killed after {step:?}"
        );
        // the next replace clears what the killed one left and succeeds
        replace_dir(&best, |t| write_version(t, "third")).unwrap();
        assert_eq!(version(&best).as_deref(), Some("third"));
        let left: Vec<_> = std::fs::read_dir(&root).unwrap().collect();
        assert_eq!(left.len(), 1, "leftovers after {step:?}");
    }
    let _ = std::fs::remove_dir_all(&root);
}
