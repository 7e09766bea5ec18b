#![allow(dead_code)]
//! Shared fixtures and statistics for the engine tests.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use dflash_core::sampling::SamplingParams;
use dflash_engine::Request;
use dflash_model::io::loader::load_hf_weights;
use dflash_model::models::drafter::Drafter;
use dflash_model::Target;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}
/// The random tiny Qwen3 target of tests/fixtures/qwen3-tiny.
pub fn tiny() -> Target {
    let (cfg, store) =
        load_hf_weights(&fixtures().join("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap();
    Target::load(cfg, &store).unwrap()
}
/// z-lab's "quiet" random drafter for it (long acceptances once the target loops).
pub fn quiet(t: &Target) -> Drafter {
    Drafter::load_dir(&fixtures().join("dflash-tiny/quiet"), t).unwrap()
}
/// The prompt of qwen3-tiny/reference.json.
pub fn tiny_prompt() -> Vec<u32> {
    vec![37, 235, 140, 72, 255, 137, 203, 133, 79, 192, 144, 129]
}
/// Where the tiny target settles into its loop: drafts get accepted from here on.
pub fn loop_prompt() -> Vec<u32> {
    [tiny_prompt(), vec![210, 213, 107, 175, 174, 175, 62, 74]].concat()
}
/// SmolLM2-135M from the asset cache (f32, CPU).
pub fn smollm2() -> dflash_model::io::loader::LoadedTarget {
    let path = dflash_model::io::loader::dflash_home()
        .join("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-assets.sh smollm2",
        path.display()
    );
    dflash_model::io::loader::load_target(path.to_str().unwrap(), DType::F32, &Device::Cpu).unwrap()
}

pub fn req(prompt: &[u32], n: usize, sampling: SamplingParams, stop: &[u32]) -> Request {
    Request {
        prompt_ids: prompt.to_vec(),
        max_new_tokens: n,
        sampling,
        stop_ids: stop.to_vec(),
    }
}

/// Regularized upper incomplete gamma Q(a, x) (Numerical Recipes' series / continued fraction).
pub fn gamma_q(a: f64, x: f64) -> f64 {
    fn ln_gamma(x: f64) -> f64 {
        let c = [
            76.18009172947146,
            -86.50532032941677,
            24.01409824083091,
            -1.231739572450155,
            0.1208650973866179e-2,
            -0.5395239384953e-5,
        ];
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
            if d.abs() < 1e-300 {
                d = 1e-300;
            }
            c = b + an / c;
            if c.abs() < 1e-300 {
                c = 1e-300;
            }
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
pub fn chi_square_p(a: &[usize], b: &[usize]) -> f64 {
    let (na, nb) = (
        a.iter().sum::<usize>() as f64,
        b.iter().sum::<usize>() as f64,
    );
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

/// max |a - b| / max |b| (`dflash_model::ops::compare`)
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    dflash_model::ops::compare::rel_err(a, b).unwrap()
}
/// max |a - b| (`dflash_model::ops::compare`)
pub fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    dflash_model::ops::compare::max_abs(a, b).unwrap()
}
