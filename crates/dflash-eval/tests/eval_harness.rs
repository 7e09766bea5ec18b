//! The evaluation harness on every dataset (SmolLM2, random drafters): reports are consistent
//! and T = 0 is lossless, a turn after a divergence is not held to AR's, drafters run side by
//! side, and the divergence diagnostic's top-2 gap holds on a bf16 target.

use dflash_testkit::{smollm2, tmp};

use candle_core::{DType, Device};
use dflash_core::sampling::SamplingParams;
use dflash_engine::ModeName;
use dflash_eval::datasets;
use dflash_eval::harness::{mode_specs, run, EvalDrafter, EvalOptions};
use dflash_eval::report::{lossless_check, mode_reports, write, Report};
use dflash_model::io::loader::{dflash_home, load_target, LoadedTarget};
use dflash_model::models::drafter::Drafter;

fn random_drafter(lt: &LoadedTarget, seed: u64) -> Drafter {
    dflash_model::models::drafter_init::random_drafter(lt, 1, 4, Some(128), seed).unwrap()
}

#[test]
fn reports_are_consistent_and_lossless_on_every_dataset() {
    let lt = smollm2();
    let drafters = vec![EvalDrafter {
        label: "a".into(),
        drafter: random_drafter(&lt, 1),
    }];
    let specs = mode_specs(
        &ModeName::parse_list("ar,dflash,ddtree:4").unwrap(),
        &drafters,
        None,
    )
    .unwrap();
    for name in datasets::NAMES {
        let items = datasets::load(name, &dflash_home(), Some(2)).unwrap();
        let opts = EvalOptions {
            sampling: SamplingParams::default(),
            max_new_tokens: 10,
            time_limit: None,
            warmup_tokens: 0,
            decode: Default::default(),
        };
        let runs = run(&lt, &drafters, &specs, &items, &opts).unwrap();
        let turns: usize = items.iter().map(|i| i.turns.len()).sum();
        assert_eq!(runs.len(), turns * specs.len());
        let modes = mode_reports(&specs, &runs);
        for m in &modes {
            let t = &m.tau;
            assert!(
                (t.tau_pooled * t.rounds as f64 - t.committed as f64).abs() < 1e-9,
                "{name} {}: τ × rounds ≠ committed",
                m.mode
            );
            assert_eq!(
                t.tau_histogram.iter().sum::<usize>(),
                t.rounds,
                "{name} {}: histogram",
                m.mode
            );
            // every new token but the first (from the prefill) is committed by a round
            assert_eq!(t.committed + m.requests, m.new_tokens, "{name} {}", m.mode);
        }
        let lossless = lossless_check(&lt, &runs, true).unwrap();
        assert!(
            lossless.checked && lossless.divergences.is_empty(),
            "{name}: {:?}",
            lossless.divergences
        );
        let out = tmp(&format!("report-{name}"));
        let report = Report {
            command: "test".into(),
            dataset: name.to_string(),
            target: "smollm2".into(),
            drafters: vec!["a".into()],
            device: "cpu".into(),
            dtype: "f32".into(),
            versions: serde_json::json!({}),
            temperature: 0.0,
            max_new_tokens: 10,
            warmup_tokens: 0,
            acceptance: Default::default(),
            items_done: items.len(),
            items_asked: items.len(),
            modes,
            lossless,
            runs,
        };
        write(&report, &out).unwrap();
        for f in [
            "report.json",
            "report.md",
            "tau.svg",
            "tau_histogram.svg",
            "acceptance.svg",
        ] {
            assert!(out.join(f).exists(), "{f}");
        }
        let back: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap())
                .unwrap();
        assert_eq!(back["modes"].as_array().unwrap().len(), 3);
        assert!(std::fs::read_to_string(out.join("tau.svg"))
            .unwrap()
            .starts_with("<svg"));
    }
}

/// A multi-turn item whose first turn left AR's text: the second turn continues the mode's own
/// answer, so its difference is marked as following the first (not a fault), while the first
/// turn's (f32: no near-tie) stays a fault.
#[test]
fn a_turn_after_a_divergence_is_not_compared_with_ar() {
    let lt = smollm2();
    let drafters = vec![EvalDrafter {
        label: "a".into(),
        drafter: random_drafter(&lt, 1),
    }];
    let specs = mode_specs(&ModeName::parse_list("ar,dflash").unwrap(), &drafters, None).unwrap();
    let items = datasets::load("mt-bench", &dflash_home(), Some(1)).unwrap();
    let opts = EvalOptions {
        sampling: SamplingParams::default(),
        max_new_tokens: 6,
        time_limit: None,
        warmup_tokens: 0,
        decode: Default::default(),
    };
    let mut runs = run(&lt, &drafters, &specs, &items, &opts).unwrap();
    assert!(lossless_check(&lt, &runs, true)
        .unwrap()
        .divergences
        .is_empty());
    // the chain's first answer differs from AR's in its last token, and its second turn's
    // prompt holds that answer
    for r in runs.iter_mut().filter(|r| r.mode != "ar") {
        match r.turn {
            0 => *r.tokens.last_mut().unwrap() += 1,
            _ => r.prompt_ids.insert(r.prompt_ids.len() / 2, 42),
        }
    }
    let divs = lossless_check(&lt, &runs, true).unwrap().divergences;
    assert_eq!(divs.len(), 2, "{divs:?}");
    let first = divs.iter().find(|d| d.turn == 0).unwrap();
    assert!(!first.follows_earlier_turn && !first.near_tie && !first.explained());
    assert!(first.top2_gap.is_finite());
    let second = divs.iter().find(|d| d.turn == 1).unwrap();
    assert!(second.follows_earlier_turn && second.explained());
    // without the first turn's divergence, a second prompt unlike AR's is a fault
    for r in runs.iter_mut().filter(|r| r.mode != "ar" && r.turn == 0) {
        *r.tokens.last_mut().unwrap() -= 1;
    }
    let divs = lossless_check(&lt, &runs, true).unwrap().divergences;
    assert_eq!(divs.len(), 1, "{divs:?}");
    assert!(divs[0].turn == 1 && !divs[0].explained());
}

#[test]
fn two_drafters_side_by_side() {
    let lt = smollm2();
    let drafters = vec![
        EvalDrafter {
            label: "ours".into(),
            drafter: random_drafter(&lt, 1),
        },
        EvalDrafter {
            label: "ref".into(),
            drafter: random_drafter(&lt, 2),
        },
    ];
    let specs = mode_specs(&ModeName::parse_list("ar,dflash").unwrap(), &drafters, None).unwrap();
    let labels: Vec<&str> = specs.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, vec!["ar", "dflash[ours]", "dflash[ref]"]);
    let items = datasets::load("gsm8k", &dflash_home(), Some(1)).unwrap();
    // greedy options: new tokens, a time limit, warm-up tokens
    let greedy = |max_new_tokens, time_limit, warmup_tokens| EvalOptions {
        sampling: SamplingParams::default(),
        max_new_tokens,
        time_limit,
        warmup_tokens,
        decode: Default::default(),
    };
    let runs = run(&lt, &drafters, &specs, &items, &greedy(6, None, 0)).unwrap();
    assert_eq!(runs.len(), 3);
    // a time limit stops between items, never inside one: every mode on the same first item
    let two = datasets::load("gsm8k", &dflash_home(), Some(2)).unwrap();
    let limited = |limit| run(&lt, &drafters, &specs, &two, &greedy(2, limit, 0)).unwrap();
    let cut = limited(Some(std::time::Duration::ZERO));
    assert_eq!(cut.len(), 3);
    assert!(cut.iter().all(|r| r.item == two[0].id));
    assert_eq!(limited(Some(std::time::Duration::from_secs(3600))).len(), 6);
    assert!(runs[1].tokens == runs[0].tokens && runs[2].tokens == runs[0].tokens);
    // the warm-up decodes untimed and reports nothing: the same runs, the same tokens
    let warmed = run(&lt, &drafters, &specs, &items, &greedy(6, None, 4)).unwrap();
    assert_eq!(warmed.len(), runs.len());
    for (w, r) in warmed.iter().zip(&runs) {
        assert_eq!((&w.mode, &w.item, &w.tokens), (&r.mode, &r.item, &r.tokens));
    }
    assert!(ModeName::parse_list("ar,ddtree:0").is_err() && ModeName::parse_list("beam").is_err());
}

/// The divergence diagnostic's top-2 logit gap works on a bf16 target (it read f32 values out of
/// the target's own dtype and sorted on the device: a bf16 GPU evaluation lost its report there)
/// and equals the gap of a full sort of the same logits.
#[test]
fn top2_gap_in_f32_and_bf16() {
    use dflash_eval::report::top2_gap;
    let fix = dflash_testkit::fixtures().join("qwen3-tiny");
    let prefix = [3u32, 17, 42, 5, 99];
    for dtype in [DType::F32, DType::BF16] {
        let lt = load_target(fix.to_str().unwrap(), dtype, &Device::Cpu).unwrap();
        let mut cache = lt.target.new_cache();
        let out = lt
            .target
            .forward_causal(&prefix, &mut cache, &[], &dflash_model::Rows::Last)
            .unwrap();
        let mut v = out
            .logits
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        v.sort_by(|a, b| b.total_cmp(a));
        let gap = top2_gap(&lt, &prefix).unwrap();
        assert_eq!(gap, v[0] - v[1], "{dtype:?}");
        assert!(gap >= 0.0);
    }
}
