//! An interrupted evaluation resumes: each item's runs go to a journal as the item finishes,
//! runs stopped by a time limit of zero (one item each) advance to the runs of one
//! uninterrupted evaluation (the same tokens and rounds), a line cut by a kill is decoded
//! again, and a journal of other settings is refused by name.

use std::time::Duration;

use dflash_core::sampling::SamplingParams;
use dflash_engine::ModeName;
use dflash_eval::datasets;
use dflash_eval::harness::{mode_specs, run, run_journaled, EvalDrafter, EvalOptions, Run};
use dflash_eval::journal::Journal;
use dflash_model::io::loader::dflash_home;
use dflash_testkit::*;

fn opts(time_limit: Option<Duration>) -> EvalOptions {
    EvalOptions {
        sampling: SamplingParams::new(0.8, 1.0, 0, 9).unwrap(),
        max_new_tokens: 6,
        time_limit,
        warmup_tokens: 0,
        decode: Default::default(),
    }
}

/// A run as compared: mode, item, turn, its tokens and its rounds' committed counts.
type Key = (String, String, usize, Vec<u32>, Vec<usize>);

fn key(runs: &[Run]) -> Vec<Key> {
    let mut v: Vec<_> = runs
        .iter()
        .map(|r| {
            let taus = r.rounds.iter().map(|x| x.tau_round).collect();
            (
                r.mode.clone(),
                r.item.clone(),
                r.turn,
                r.tokens.clone(),
                taus,
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn an_interrupted_evaluation_resumes_to_the_uninterrupted_runs() {
    let lt = smollm2();
    let d = dflash_model::models::drafter_init::random_drafter(&lt, 1, 4, Some(64), 3).unwrap();
    let drafters = vec![EvalDrafter {
        label: "a".into(),
        drafter: d,
    }];
    let specs = mode_specs(&ModeName::parse_list("ar,dflash").unwrap(), &drafters, None).unwrap();
    let items = datasets::load("gsm8k", &dflash_home(), Some(4)).unwrap();
    let whole = run(&lt, &drafters, &specs, &items, &opts(None)).unwrap();
    let path = tmp("eval-resume").join("runs.jsonl");
    let mut rounds = 0;
    loop {
        let mut j = Journal::open(&path, "gsm8k 4, ar+dflash").unwrap();
        let held = j.done.len();
        let runs = run_journaled(
            &lt,
            &drafters,
            &specs,
            &items,
            &opts(Some(Duration::ZERO)),
            Some(&mut j),
        )
        .unwrap();
        rounds += 1;
        assert_eq!(j.done.len(), held, "the journal's items are read once");
        if runs.len() == whole.len() {
            assert_eq!(key(&runs), key(&whole));
            break;
        }
        assert!(
            runs.len() > held * specs.len(),
            "run {rounds} did not advance"
        );
        if rounds == 2 {
            // a kill while an item was being appended: that item is decoded again
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .unwrap();
            f.write_all(b"{\"item\": \"gsm8k-3\", \"runs\": [{\"mode\"")
                .unwrap();
        }
        assert!(rounds < 10);
    }
    assert_eq!(rounds, 4, "one item per run");
    let e = Journal::open(&path, "gsm8k 8, ar only")
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("runs.jsonl") && e.contains("another evaluation"),
        "{e}"
    );
}
