//! The harness on every dataset (SmolLM2, a random drafter): reports are consistent and T = 0
//! is lossless; the doctor passes a consistent pair and names the cause of three classic
//! mismatches (a perturbed tapped layer, tap ids shifted by one, a drafter for another target).

use dflash_testkit::{smollm2, tmp};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use dflash_core::sampling::SamplingParams;
use dflash_engine::ModeName;
use dflash_eval::datasets;
use dflash_eval::doctor::{doctor, Status, Tolerances};
use dflash_eval::harness::{mode_specs, run, EvalDrafter, EvalOptions};
use dflash_eval::report::{lossless_check, mode_reports, write, Report};
use dflash_model::io::loader::{dflash_home, load_target, LoadedTarget};
use dflash_model::models::drafter::Drafter;
use dflash_model::models::drafter_init::{
    drafter_config, random_weights, save_drafter, DrafterShape,
};
use dflash_train::config::TrainConfig;
use dflash_train::prompts::Prompt;
use dflash_train::regen::{regenerate, RegenOptions};

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

/// The files of the directory `from`, copied into a fresh temporary directory `name`.
fn copied(from: &Path, name: &str) -> PathBuf {
    let dir = tmp(name);
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    dir
}

/// A copy of the drafter `from` whose training record `edit` changed.
fn with_record(from: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dir = copied(from, name);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("training.json")).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(dir.join("training.json"), v.to_string()).unwrap();
    dir
}

/// A copy of the tiny Qwen3 fixture (the doctor's checks read its files), loaded in f32.
fn tiny_target(name: &str) -> (PathBuf, LoadedTarget) {
    let fix = dflash_testkit::fixtures().join("qwen3-tiny");
    let target = copied(&fix, &format!("{name}-target"));
    let lt = load_target(target.to_str().unwrap(), DType::F32, &Device::Cpu).unwrap();
    (target, lt)
}

/// Regeneration resumes only with the prompts its shards came from: another prompt list under
/// the same source name is refused with a message, the same list with prompts appended
/// continues (and writes the new shards).
#[test]
fn resumed_regeneration_refuses_other_prompts_and_continues_appended_ones() {
    let (_, lt) = tiny_target("resume");
    let prompt = |text: String| Prompt {
        messages: vec![dflash_model::io::tokenizer::ChatMessage {
            role: "user".into(),
            content: text,
        }],
    };
    let first: Vec<Prompt> = (0..4)
        .map(|i| prompt(format!("t{} t{}", i + 1, i + 7)))
        .collect();
    let data = tmp("resume-data");
    let opts = RegenOptions {
        max_new_tokens: 4,
        loop_window: 0,
        sampling: SamplingParams::default(),
        prompts_per_shard: 2,
        batch_size: 1,
        cuda_graphs: false,
        time_limit: None,
        source: "prompts.jsonl".into(),
        target_name: "tiny".into(),
    };
    assert_eq!(
        regenerate(&lt, &first, &data, &opts).unwrap().shards.len(),
        2
    );
    let other: Vec<Prompt> = (0..6)
        .map(|i| prompt(format!("t{} t{}", i + 30, i + 9)))
        .collect();
    let err = regenerate(&lt, &other, &data, &opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("was not written from these prompts"), "{err}");
    let mut appended = first.clone();
    appended.extend((0..2).map(|i| prompt(format!("t{} t{}", i + 50, i + 3))));
    let m = regenerate(&lt, &appended, &data, &opts).unwrap();
    assert_eq!(m.shards.len(), 3);
    assert_eq!(m.shards.iter().map(|s| s.sequences).sum::<usize>(), 6);
}

/// The tiny target (copied), a drafter trained on its own greedy outputs, and that data. Two
/// prompts repeated: the held-out validation sequences are ones the drafter has learned, so
/// the stored and measured τ are well above 1 and their agreement means something.
fn trained_pair(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let (target, lt) = tiny_target(name);
    let prompts: Vec<Prompt> = (0..10u32)
        .map(|i| Prompt {
            messages: vec![dflash_model::io::tokenizer::ChatMessage {
                role: "user".into(),
                content: (0..6)
                    .map(|j| format!("t{}", ((i % 2) * 37 + j * 11) % 250 + 1))
                    .collect::<Vec<_>>()
                    .join(" "),
            }],
        })
        .collect();
    let data = tmp(&format!("{name}-data"));
    let opts = RegenOptions {
        max_new_tokens: 24,
        loop_window: 0,
        sampling: SamplingParams::default(),
        prompts_per_shard: 5,
        // batched (attention-only) / falls back to one at a time (hybrid)
        batch_size: 4,
        cuda_graphs: false,
        time_limit: None,
        source: "test".into(),
        target_name: "tiny".into(),
    };
    regenerate(&lt, &prompts, &data, &opts).unwrap();
    let cfg = TrainConfig {
        num_draft_layers: 1,
        block_size: 4,
        intermediate_size: Some(128),
        mask_token_id: Some(255),
        target_layer_ids: Some(vec![1, 2]),
        num_anchors: 32,
        lr: 1e-2,
        warmup_ratio: 0.0,
        grad_accum: 2,
        max_steps: Some(80),
        save_every: 80,
        val_every: 80,
        val_sequences: 2,
        ..Default::default()
    };
    let out = tmp(&format!("{name}-run"));
    dflash_train::trainer::train(&lt, &data, &out, cfg, &Default::default()).unwrap();
    (target, out.join("best"), data)
}

/// On responses shorter than a block, decoding within the response's length alone drafts cut
/// blocks (as z-lab's loop does at a generation's end), which training never scores: with the
/// shipped SmolLM2 drafter that measured τ 1.69 against the walk's 1.78 on such text. The
/// doctor decodes a block past each response and walks its rounds as validation does, so that
/// the two agree (measured: 1.776 vs 1.783 on 32 responses of the evals registry). The walk
/// scores the drafter's arg-max over the whole vocabulary, so the decoding it is held to drafts
/// from the whole vocabulary too, and decoding with `draft_vocab.json`'s proposals is reported
/// beside: on these six answers run 12's weights draft a token outside the 8,192 that the
/// target then emits, a word of its prompt, so the draft vocabulary alone measures 1.250
/// against the walk's 1.316, and with each prompt's tokens added (decoding's proposals) 1.316.
#[test]
fn the_measured_tau_walks_full_blocks_on_short_responses() {
    let lt = dflash_testkit::smollm2();
    let drafter = dflash_testkit::repo_root().join("assets/drafters/smollm2-135m-b16");
    let prompts: Vec<Prompt> = [
        "Name a color.",
        "Say hello.",
        "What is 2 + 2?",
        "Name a fruit.",
        "Give one word for happy.",
        "What day comes after Monday?",
    ]
    .iter()
    .map(|q| Prompt {
        messages: vec![dflash_model::io::tokenizer::ChatMessage {
            role: "user".into(),
            content: q.to_string(),
        }],
    })
    .collect();
    let data = tmp("short-responses");
    let opts = RegenOptions {
        max_new_tokens: 6,
        loop_window: 0,
        sampling: SamplingParams::default(),
        prompts_per_shard: 6,
        batch_size: 1,
        cuda_graphs: false,
        time_limit: None,
        source: "test".into(),
        target_name: "smollm2-135m".into(),
    };
    regenerate(&lt, &prompts, &data, &opts).unwrap();
    let r = doctor(&lt, &drafter, Some(&data), &Tolerances::default()).unwrap();
    let sim = r
        .checks
        .iter()
        .find(|c| c.name == "simulated vs measured τ")
        .unwrap();
    let (walked, measured) = walked_and_measured(&sim.detail);
    eprintln!("{}", sim.detail);
    assert!(
        (walked - measured).abs() <= 1e-3 * measured && !sim.detail.contains("another text"),
        "walked {walked} vs measured {measured}: {}",
        sim.detail
    );
    // the shipped drafter has a draft vocabulary: its decoding τ is reported beside, and the
    // token it lacks here is its prompt's, which decoding drafts too
    let key = "as the walk scores it (";
    let rest = &sim.detail[sim.detail.find(key).expect("the draft vocabulary's τ") + key.len()..];
    let with_vocab: f64 = rest.split_whitespace().next().unwrap().parse().unwrap();
    assert!(
        rest.contains("drafting from the 8192 tokens of draft_vocab.json and each prompt's")
            && (with_vocab - measured).abs() <= 1e-3 * measured,
        "{}",
        sim.detail
    );
}

/// The τ of the decoding walk and the τ measured by decoding, from the "simulated vs measured
/// τ" check's detail.
fn walked_and_measured(detail: &str) -> (f64, f64) {
    let number_after = |key: &str| -> f64 {
        let rest = &detail[detail.find(key).unwrap() + key.len()..];
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    (
        number_after("as decoding visits them: "),
        number_after("measured by decoding "),
    )
}

/// "N of M greedy draft tokens equal" → (N, M).
fn greedy_counts(detail: &str) -> (usize, usize) {
    let head = &detail[..detail.find(" greedy draft tokens equal").unwrap()];
    let words: Vec<&str> = head.split_whitespace().collect();
    let n = words.len();
    (words[n - 3].parse().unwrap(), words[n - 1].parse().unwrap())
}

fn run_doctor(
    target: &Path,
    drafter: &Path,
    data: Option<&Path>,
) -> dflash_eval::doctor::DoctorReport {
    run_doctor_in(DType::F32, target, drafter, data)
}

fn run_doctor_in(
    dtype: DType,
    target: &Path,
    drafter: &Path,
    data: Option<&Path>,
) -> dflash_eval::doctor::DoctorReport {
    let lt = load_target(target.to_str().unwrap(), dtype, &Device::Cpu).unwrap();
    doctor(&lt, drafter, data, &Tolerances::default()).unwrap()
}

#[test]
fn doctor_passes_a_consistent_pair_and_names_three_mismatches() {
    let (target, drafter, data) = trained_pair("doc");
    let ok = run_doctor(&target, &drafter, Some(&data));
    assert!(ok.ok(), "a consistent pair must pass: {:#?}", ok.checks);
    let rec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(drafter.join("training.json")).unwrap())
            .unwrap();
    assert!(
        rec["val_simulated_tau"].as_f64().unwrap() > 2.0,
        "the pair must be a real one: {}",
        rec["val_simulated_tau"]
    );
    assert_eq!(ok.checks.len(), 9);
    // the decoding walk over the validation responses predicts the τ that decoding them
    // measures (greedy f32 data of this target: the same tokens, the same acceptances)
    let sim = ok
        .checks
        .iter()
        .find(|c| c.name == "simulated vs measured τ")
        .unwrap();
    let (walked, measured) = walked_and_measured(&sim.detail);
    assert!(
        (walked - measured).abs() <= 0.02 * measured,
        "walked {walked} vs measured {measured}: {}",
        sim.detail
    );

    // in f32 the two drafter paths agree within 1e-4 and on every greedy draft token; beside
    // a bf16 target they round differently, and the verdict comes from an f32 copy of the
    // drafter on the same taps, held to the same 1e-4
    let parity = |r: &dflash_eval::doctor::DoctorReport| {
        r.checks
            .iter()
            .find(|c| c.name == "train/infer parity")
            .unwrap()
            .clone()
    };
    let f32_parity = parity(&ok);
    assert!(
        f32_parity.detail.contains("≤ 1e-4")
            && f32_parity.detail.contains("greedy draft tokens equal"),
        "{f32_parity:?}"
    );
    let (same, all) = greedy_counts(&f32_parity.detail);
    assert_eq!(same, all, "{f32_parity:?}");
    let bf16 = parity(&run_doctor_in(DType::BF16, &target, &drafter, None));
    assert!(!bf16.failed(), "{bf16:?}");
    assert!(
        bf16.detail
            .starts_with("an f32 copy of the drafter on this BF16 target's taps")
            && bf16.detail.contains("(≤ 1e-4)")
            && bf16.detail.contains("(reported)"),
        "{bf16:?}"
    );
    let (same, all) = greedy_counts(&bf16.detail);
    assert_eq!(same, all, "the f32 copy's greedy draft tokens: {bf16:?}");

    // (a) one tapped layer's weights perturbed
    let bad_target = copied(&target, "doc-target-perturbed");
    let st = bad_target.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
    let k = "model.layers.1.mlp.down_proj.weight";
    let t = (w[k].clone() * 1.05).unwrap();
    w.insert(k.into(), t);
    candle_core::safetensors::save(&w, &st).unwrap();
    let r = run_doctor(&bad_target, &drafter, Some(&data));
    assert!(!r.ok());
    let failed: Vec<&str> = r
        .checks
        .iter()
        .filter(|c| c.failed())
        .map(|c| c.name.as_str())
        .collect();
    assert!(
        failed.contains(&"target identity") && failed.contains(&"tap statistics"),
        "{failed:?}"
    );
    assert!(r.likely_cause.unwrap().starts_with("target identity"));

    // (b) tap ids shifted by one
    let shifted = copied(&drafter, "doc-shifted");
    let c = std::fs::read_to_string(shifted.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&c).unwrap();
    v["dflash_config"]["target_layer_ids"] = serde_json::json!([2, 3]);
    std::fs::write(shifted.join("config.json"), v.to_string()).unwrap();
    let r = run_doctor(&target, &shifted, Some(&data));
    let taps = r.checks.iter().find(|c| c.name == "tap ids").unwrap();
    assert!(
        taps.failed() && taps.detail.contains("shifted by 1"),
        "{taps:?}"
    );
    assert!(r.likely_cause.unwrap().starts_with("tap ids"));

    // (d) a record without a stored simulated τ (a checkpoint from before every checkpoint
    // was validated): only the measured half is checked, and it still passes; a stored value
    // twice the real one fails, unless the record names another data set: then it is not
    // compared (it was validated on that set's sequences, not these), and the detail says so
    let sim = rec["val_simulated_tau"].as_f64().unwrap();
    for (name, stored, other_data, pass, note) in [
        (
            "doc-unrecorded",
            serde_json::Value::Null,
            false,
            true,
            "none recorded",
        ),
        ("doc-stale", serde_json::json!(2.0 * sim), false, false, ""),
        (
            "doc-other-data",
            serde_json::json!(2.0 * sim),
            true,
            true,
            "not compared",
        ),
    ] {
        let dir = with_record(&drafter, name, |v| {
            v["val_simulated_tau"] = stored;
            if other_data {
                v["data_manifest_sha256"] = serde_json::json!("0".repeat(64));
            }
        });
        let r = run_doctor(&target, &dir, Some(&data));
        let c = r
            .checks
            .iter()
            .find(|c| c.name == "simulated vs measured τ")
            .unwrap();
        assert_eq!(!c.failed(), pass, "{name}: {c:?}");
        for n in ["none recorded", "not compared"] {
            assert_eq!(c.detail.contains(n), n == note, "{name}: {c:?}");
        }
    }

    // (f) the record says another kernel family computed the training features (fla's, as in
    // the seeds' project): named, and the likely cause; the same numerics in another precision
    // pass with a note; a record from before kernel families skips the check
    for (name, kernels, pass, needle) in [
        (
            "doc-fla",
            serde_json::json!({"linear_attention": "fla 0.6.0 chunk_gated_delta_rule",
                               "numerics": "fla", "precision": "bf16"}),
            false,
            "training features came from linear attention fla 0.6.0 chunk_gated_delta_rule (fla numerics), bf16; this run computes them with no linear attention, f32",
        ),
        (
            "doc-bf16",
            serde_json::json!({"linear_attention": null, "numerics": null, "precision": "bf16"}),
            true,
            "no linear attention, f32; another precision (bf16 at training)",
        ),
        ("doc-old", serde_json::Value::Null, true, "predates"),
    ] {
        let dir = with_record(&drafter, name, |v| {
            assert_eq!(
                v["fingerprint"]["kernels"],
                serde_json::json!({"linear_attention": null, "numerics": null, "precision": "f32"}),
                "the trainer records its kernel family"
            );
            if kernels.is_null() {
                v["fingerprint"].as_object_mut().unwrap().remove("kernels");
            } else {
                v["fingerprint"]["kernels"] = kernels;
            }
        });
        let r = run_doctor(&target, &dir, None);
        let c = r.checks.iter().find(|c| c.name == "kernel family").unwrap();
        assert_eq!(!c.failed(), pass, "{name}: {c:?}");
        assert!(c.detail.contains(needle), "{name}: {c:?}");
        if !pass {
            assert!(r.likely_cause.unwrap().starts_with("kernel family"));
        }
    }

    // (e) the same drafter without its training record, as a z-lab checkpoint comes: the
    // checks that read the record are skipped with a note, and the consistent pair passes
    let bare = tmp("doc-bare");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(drafter.join(f), bare.join(f)).unwrap();
    }
    let r = run_doctor(&target, &bare, Some(&data));
    assert!(
        r.ok(),
        "a pair without a training record must pass: {:#?}",
        r.checks
    );
    let status = |name: &str| r.checks.iter().find(|c| c.name == name).unwrap().status;
    for name in [
        "training record",
        "target identity",
        "tap ids",
        "kernel family",
        "tap statistics",
        "simulated vs measured τ",
    ] {
        assert_eq!(status(name), Status::Skipped, "{name}: {:#?}", r.checks);
    }
    for name in ["configuration", "target tensors", "train/infer parity"] {
        assert_eq!(status(name), Status::Pass, "{name}: {:#?}", r.checks);
    }

    // (c) a drafter made for another target (SmolLM2)
    let lt = smollm2();
    let other = tmp("doc-other");
    let cfg = drafter_config(
        &lt.target,
        &DrafterShape {
            layers: 1,
            block_size: 4,
            mask_token_id: 16,
            intermediate_size: Some(64),
            target_layer_ids: None,
            dflash2: None,
        },
    )
    .unwrap();
    save_drafter(&other, &cfg, &random_weights(&cfg, 0).unwrap()).unwrap();
    let r = run_doctor(&target, &other, None);
    let conf = &r.checks[0];
    assert!(
        conf.failed() && conf.detail.contains("hidden_size"),
        "{conf:?}"
    );
}
