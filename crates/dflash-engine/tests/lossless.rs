//! Losslessness of the chain loop: T = 0 output equals AR (SmolLM2 with a random drafter,
//! and a tiny Qwen3 with a drafter that gets long acceptances); T > 0 sampling distribution
//! equals AR's (seeded chi-square); edges (short budgets, stop tokens inside accepted runs,
//! B = 2) and drafters that do not fit.

use std::path::PathBuf;

use candle_core::{DType, Device};
use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, Request};
use dflash_model::drafter::Drafter;
use dflash_model::drafter_init::{default_mask_token, drafter_config, random_weights, DrafterShape};
use dflash_model::loader::{load_hf_weights, load_target};
use dflash_model::weights::TensorStore;
use dflash_model::Target;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}
fn tiny() -> Target {
    let (cfg, store) = load_hf_weights(&fixtures().join("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap();
    Target::load(cfg, &store).unwrap()
}
fn quiet(t: &Target) -> Drafter {
    Drafter::load_dir(&fixtures().join("dflash-tiny/quiet"), t).unwrap()
}
fn tiny_prompt() -> Vec<u32> {
    vec![37, 235, 140, 72, 255, 137, 203, 133, 79, 192, 144, 129]
}
fn req(prompt: &[u32], n: usize, sampling: SamplingParams, stop: &[u32]) -> Request {
    Request { prompt_ids: prompt.to_vec(), max_new_tokens: n, sampling, stop_ids: stop.to_vec() }
}

#[test]
fn smollm2_random_drafter_is_lossless_at_t0() {
    let home = dflash_model::loader::dflash_home();
    let path = home.join("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.exists(), "{} is missing: run scripts/fetch-assets.sh smollm2", path.display());
    let lt = load_target(path.to_str().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let shape = DrafterShape {
        layers: 2,
        block_size: 8,
        mask_token_id: default_mask_token(&lt.tokenizer).unwrap(),
        intermediate_size: Some(256),
        target_layer_ids: None,
    };
    let cfg = drafter_config(&lt.target, &shape).unwrap();
    let store = TensorStore::new(random_weights(&cfg, 7).unwrap(), DType::F32, Device::Cpu);
    let d = Drafter::load(cfg, &store, &lt.target).unwrap();
    let prompts = [
        "What is 2 + 2?",
        "Name a color.",
        "Write a haiku about rain.",
        "Who wrote Hamlet?",
        "Translate 'hello' into French.",
        "What is the boiling point of water?",
        "Give me a synonym for happy.",
        "How many legs does a spider have?",
        "Say something nice.",
        "What is the largest planet?",
    ];
    for (i, p) in prompts.iter().enumerate() {
        let ids = lt.tokenizer.prompt_ids(p, true).unwrap();
        let r = req(&ids, 12, SamplingParams::default(), &lt.tokenizer.stop_ids);
        let ar = generate(&lt.target, None, 1, &r).unwrap();
        let block = [8, 4, 2][i % 3];
        let sp = generate(&lt.target, Some(&d), block, &r).unwrap();
        assert_eq!(sp.new_tokens, ar.new_tokens, "prompt {p:?}, block {block}");
        let committed: usize = sp.rounds.iter().map(|r| r.tau_round).sum();
        assert_eq!(committed + 1, sp.new_tokens.len(), "τ accounting: first token + committed");
    }
}

#[test]
fn tiny_target_long_acceptances_are_lossless() {
    let t = tiny();
    let d = quiet(&t);
    let r = req(&tiny_prompt(), 48, SamplingParams::default(), &[]);
    let ar = generate(&t, None, 1, &r).unwrap();
    for b in [2, 3, 5, 8] {
        let sp = generate(&t, Some(&d), b, &r).unwrap();
        assert_eq!(sp.new_tokens, ar.new_tokens, "block {b}");
        assert!(sp.rounds.iter().all(|r| r.tau_round <= b));
    }
    let sp = generate(&t, Some(&d), 8, &r).unwrap();
    assert!(sp.rounds.iter().any(|r| r.accepted >= 5), "the fixture drafter must get long acceptances");
}

#[test]
fn max_new_tokens_below_block_size() {
    let t = tiny();
    let d = quiet(&t);
    for n in 1..=7 {
        let r = req(&tiny_prompt(), n, SamplingParams::default(), &[]);
        let ar = generate(&t, None, 1, &r).unwrap();
        let sp = generate(&t, Some(&d), 8, &r).unwrap();
        assert_eq!(sp.new_tokens.len(), n);
        assert_eq!(sp.new_tokens, ar.new_tokens, "max_new_tokens {n}");
        assert!(sp.rounds.iter().all(|r| r.drafted < n), "the block shrinks near the end");
    }
}

#[test]
fn stop_token_inside_an_accepted_run() {
    let t = tiny();
    let d = quiet(&t);
    // the tiny target loops on 180 and the drafter accepts long runs of it
    let r = req(&tiny_prompt(), 48, SamplingParams::default(), &[180]);
    let ar = generate(&t, None, 1, &r).unwrap();
    let sp = generate(&t, Some(&d), 8, &r).unwrap();
    assert_eq!(sp.new_tokens, ar.new_tokens);
    assert_eq!(*sp.new_tokens.last().unwrap(), 180);
    assert!(sp.stopped_by_token);
    let last = sp.rounds.last().unwrap();
    assert!(last.accepted + 1 > last.tau_round, "the stop cut an accepted run: {last:?}");
}

#[test]
fn drafter_for_another_target_is_refused() {
    let t = tiny();
    let home = dflash_model::loader::dflash_home();
    let lt = load_target(
        home.join("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf").to_str().unwrap(),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let err = Drafter::load_dir(&fixtures().join("dflash-tiny/quiet"), &lt.target).err().unwrap();
    assert!(err.to_string().contains("hidden_size"), "{err}");
    // a config that claims another target depth
    let dir = fixtures().join("dflash-tiny/quiet");
    let mut cfg: dflash_core::config::DrafterConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg.num_target_layers = 30;
    let store = TensorStore::from_safetensors(&[dir.join("model.safetensors")], DType::F32, &Device::Cpu).unwrap();
    let err = Drafter::load(cfg, &store, &t).err().unwrap();
    assert!(err.to_string().contains("num_target_layers"), "{err}");
}

#[test]
fn missing_or_extra_drafter_tensors_are_refused() {
    let t = tiny();
    let dir = fixtures().join("dflash-tiny/quiet");
    let cfg: dflash_core::config::DrafterConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let mut w = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let fc = w.remove("fc.weight").unwrap();
    let err = Drafter::load(cfg.clone(), &TensorStore::new(w.clone(), DType::F32, Device::Cpu), &t).err().unwrap();
    assert!(err.to_string().contains("missing tensor 'fc.weight'"), "{err}");
    w.insert("fc.weight".into(), fc);
    w.insert("lm_head.weight".into(), candle_core::Tensor::zeros((256, 64), DType::F32, &Device::Cpu).unwrap());
    let err = Drafter::load(cfg, &TensorStore::new(w, DType::F32, Device::Cpu), &t).err().unwrap();
    assert!(err.to_string().contains("lm_head.weight"), "{err}");
}

/// Regularized upper incomplete gamma Q(a, x) (Numerical Recipes' series / continued fraction).
fn gamma_q(a: f64, x: f64) -> f64 {
    fn ln_gamma(x: f64) -> f64 {
        let c = [76.18009172947146, -86.50532032941677, 24.01409824083091, -1.231739572450155, 0.1208650973866179e-2, -0.5395239384953e-5];
        let mut y = x;
        let t = x + 5.5;
        let t = t - (x + 0.5) * t.ln();
        let mut s = 1.000000000190015;
        for ci in c {
            y += 1.0;
            s += ci / y;
        }
        -t + (2.5066282746310005 * s / x).ln()
    }
    if x < a + 1.0 {
        let (mut sum, mut del, mut ap) = (1.0 / a, 1.0 / a, a);
        for _ in 0..1000 {
            ap += 1.0;
            del *= x / ap;
            sum += del;
            if del.abs() < sum.abs() * 1e-14 {
                break;
            }
        }
        1.0 - sum * (-x + a * x.ln() - ln_gamma(a)).exp()
    } else {
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / 1e-300;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..1000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < 1e-300 { d = 1e-300; }
            c = b + an / c;
            if c.abs() < 1e-300 { c = 1e-300; }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-14 {
                break;
            }
        }
        (-x + a * x.ln() - ln_gamma(a)).exp() * h
    }
}

/// Two-sample chi-square homogeneity test; categories with < 10 expected pooled into one.
fn chi_square_p(a: &[usize], b: &[usize]) -> f64 {
    let (na, nb) = (a.iter().sum::<usize>() as f64, b.iter().sum::<usize>() as f64);
    let mut cats: Vec<(f64, f64)> = Vec::new();
    let mut rest = (0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        if (x + y) as f64 * na.min(nb) / (na + nb) >= 10.0 {
            cats.push((x as f64, y as f64));
        } else {
            rest.0 += x as f64;
            rest.1 += y as f64;
        }
    }
    if rest.0 + rest.1 > 0.0 {
        cats.push(rest);
    }
    let mut stat = 0.0;
    for (x, y) in &cats {
        let tot = x + y;
        let ea = tot * na / (na + nb);
        let eb = tot * nb / (na + nb);
        stat += (x - ea).powi(2) / ea + (y - eb).powi(2) / eb;
    }
    let df = (cats.len() - 1) as f64;
    gamma_q(df / 2.0, stat / 2.0)
}

#[test]
fn chi_square_helper_detects_a_difference() {
    // the test below can fail: a clearly different distribution gives a tiny p-value
    let a = [2500usize, 2500, 0];
    let b = [2000usize, 2500, 500];
    assert!(chi_square_p(&a, &b) < 1e-6);
    assert!(chi_square_p(&a, &a) > 0.99);
    assert!((gamma_q(1.0, 2.0) - (-2.0f64).exp()).abs() < 1e-10);
}

#[test]
fn sampling_distribution_equals_ar() {
    // The third new token's distribution, 5k seeded generations each, speculative vs AR. The
    // prefix is where the tiny target settles into its loop and the drafter's drafts get
    // accepted, so the accept path (not only the bonus path) decides many samples.
    let t = tiny();
    let d = quiet(&t);
    let prompt: Vec<u32> = [tiny_prompt(), vec![210, 213, 107, 175, 174, 175, 62, 74]].concat();
    let n = 5000;
    let mut accepted_rounds = 0;
    let mut ar_counts = vec![0usize; 256];
    let mut sp_counts = vec![0usize; 256];
    for s in 0..n {
        let sa = SamplingParams::new(0.02, 0.95, 0, s).unwrap();
        let sb = SamplingParams::new(0.02, 0.95, 0, 1_000_000 + s).unwrap();
        let r = req(&prompt, 3, sa, &[]);
        ar_counts[generate(&t, None, 1, &r).unwrap().new_tokens[2] as usize] += 1;
        let r = req(&prompt, 3, sb, &[]);
        let g = generate(&t, Some(&d), 8, &r).unwrap();
        accepted_rounds += g.rounds.iter().filter(|r| r.accepted > 0).count();
        sp_counts[g.new_tokens[2] as usize] += 1;
    }
    assert!(accepted_rounds > n as usize / 10, "too few accepted drafts ({accepted_rounds}) to test the accept path");
    eprintln!("accepted rounds {accepted_rounds}, distinct third tokens {}", ar_counts.iter().filter(|&&c| c > 0).count());
    let p = chi_square_p(&ar_counts, &sp_counts);
    assert!(p > 0.01, "speculative sampling differs from AR: p = {p}");
}
