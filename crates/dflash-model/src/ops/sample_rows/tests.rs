//! The sampling ops' tests: the module doc's example, each op against the host's rule, bad
//! inputs refused.

use super::*;
use dflash_core::acceptance::{judge, Verdict};

fn on_cpu(rows: &[&[f32]]) -> Tensor {
    let v = rows[0].len();
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (rows.len(), v), &Device::Cpu).unwrap()
}

#[test]
fn the_module_example() {
    let logits = on_cpu(&[&[0.0, 3f32.ln()], &[0.0, 0.0]]);
    let p = temperature_probs(&logits, 1.0).unwrap();
    let got = p.to_vec2::<f32>().unwrap();
    for (a, b) in got.iter().flatten().zip([0.25f32, 0.75, 0.5, 0.5]) {
        assert!((a - b).abs() < 1e-6, "{got:?}");
    }
    let u = Uniforms::new(&[0.2, 0.6, 0.5, 0.9], &Device::Cpu).unwrap();
    let t = draw_rows(&p, &u, 0).unwrap().to_vec1::<u32>().unwrap();
    assert_eq!(t, vec![0, 1]);
    let (q, pp) = (p.narrow(0, 0, 1).unwrap(), p.narrow(0, 1, 1).unwrap());
    let d = Tensor::new(&[1u32], &Device::Cpu).unwrap();
    // u_accept .5 < 2/3: kept; .9: rejected, the residual [.25, 0] gives token 0
    let v = judge_rows(&pp, &q, &d, &u, 2, 0).unwrap();
    assert_eq!(v.to_vec2::<u32>().unwrap(), vec![vec![1, 0]]);
    let v = judge_rows(&pp, &q, &d, &u, 3, 0).unwrap();
    assert_eq!(v.to_vec2::<u32>().unwrap(), vec![vec![0, 0]]);
}

/// The ops equal the host's rules row by row, on rows with a dominant token, flat rows,
/// p = q (an empty residual) and uniforms near 0 and 1.
#[test]
fn the_ops_are_the_host_rules() {
    let v = 257;
    let row = |s: u64| -> Vec<f32> {
        (0..v as u64)
            .map(|i| (((i + 3) * (s + 11) * 2654435761 % 1009) as f32 / 1009.0 - 0.5) * 6.0)
            .collect()
    };
    let mut rows: Vec<Vec<f32>> = (0..6).map(row).collect();
    rows[1][17] = 40.0; // one token takes almost all the mass
    rows[2] = vec![0.0; v];
    rows[3] = rows[0].clone(); // p = q against row 0
    let n = rows.len();
    let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
    let logits = on_cpu(&refs);
    let u: Vec<f32> = (0..3 * n)
        .map(|i| [0.0, 0.999_999, 0.37, 0.5, 0.81, 0.05][i % 6])
        .collect();
    let uni = Uniforms::new(&u, &Device::Cpu).unwrap();
    for t in [0.3f32, 1.0, 1.7] {
        let params = dflash_core::sampling::SamplingParams {
            temperature: t,
            ..Default::default()
        };
        let p = temperature_probs(&logits, t).unwrap();
        let host: Vec<Vec<f32>> = rows
            .iter()
            .map(|r| dflash_core::sampling::dense_probs(r, &params))
            .collect();
        assert_eq!(p.to_vec2::<f32>().unwrap(), host, "T {t}");
        let drawn = draw_rows(&p, &uni, 0).unwrap().to_vec1::<u32>().unwrap();
        for (r, q) in host.iter().enumerate() {
            let total = q.iter().map(|&x| x as f64).sum();
            let want = dflash_core::acceptance::pick_weighted(q, total, u[r]);
            assert_eq!(drawn[r], want, "T {t}, row {r}");
        }
        // judge rows 3.. (q) against rows 0.. (p): row 3 is row 0, so p = q there
        let (pp, q) = (p.narrow(0, 0, 3).unwrap(), p.narrow(0, 3, 3).unwrap());
        let d = Tensor::from_vec(drawn[3..].to_vec(), 3, &Device::Cpu).unwrap();
        let got = judge_rows(&pp, &q, &d, &uni, n, 2 * n).unwrap();
        for (r, g) in got.to_vec2::<u32>().unwrap().iter().enumerate() {
            let want = match judge(&host[r], &host[3 + r], drawn[3 + r], u[n + r], u[2 * n + r]) {
                Verdict::Accept => vec![1, 0],
                Verdict::Reject { bonus } => vec![0, bonus],
            };
            assert_eq!(g, &want, "T {t}, row {r}");
        }
    }
}

/// `rule_probs_f32`'s algorithm, written again on the host (sums in token order instead of
/// the block's): the temperature probabilities, then each cut as a boundary key (by
/// bisection; top-p alone by the 16-way search of `key_search`) and the tokens at it kept
/// by id, then renormalised.
fn searched_rule(x: &[f32], t: f32, k: usize, top_p: f32) -> Vec<f32> {
    let key = |f: f32| {
        let i = f.to_bits() as i32;
        i ^ (((i >> 31) as u32) >> 1) as i32
    };
    let keys: Vec<i32> = x.iter().map(|&f| key(f)).collect();
    let v = x.len();
    let params = dflash_core::sampling::SamplingParams {
        temperature: t,
        ..Default::default()
    };
    let p = dflash_core::sampling::dense_probs(x, &params);
    // the top-k cut: `key_bisect`
    let bisect = |below: &dyn Fn(i32) -> bool| {
        let (mut lo, mut hi) = (i32::MIN as i64, i32::MAX as i64);
        while lo < hi {
            let mid = lo + ((hi - lo) >> 1);
            if below(mid as i32) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo as i32
    };
    // the top-p cut: `key_search`, 15 keys per pass, the sub-range that holds the answer kept
    let search = |below: &dyn Fn(i32) -> bool| {
        let (mut lo, mut hi) = (i32::MIN as i64, i32::MAX as i64);
        while lo < hi {
            let t: Vec<i64> = (1..16).map(|j| lo + (hi - lo) * j / 16).collect();
            match t.iter().position(|&m| below(m as i32)) {
                Some(f) => {
                    hi = t[f];
                    if f > 0 {
                        lo = t[f - 1] + 1;
                    }
                }
                None => lo = t[14] + 1,
            }
        }
        lo as i32
    };
    let keep_prefix = |q: &[f32], b: i32, j: f64| -> Vec<f32> {
        let mut before = 0.0;
        (0..v)
            .map(|i| {
                let keep = match keys[i].cmp(&b) {
                    std::cmp::Ordering::Greater => true,
                    std::cmp::Ordering::Equal => {
                        before += 1.0;
                        before - 1.0 < j
                    }
                    std::cmp::Ordering::Less => false,
                };
                if keep {
                    q[i]
                } else {
                    0.0
                }
            })
            .collect()
    };
    let sum = |q: &[f32]| q.iter().map(|&x| x as f64).sum::<f64>();
    let (mut q, mut mass) = (p.clone(), 1.0);
    if k > 0 && k < v {
        let count = |m: i32| keys.iter().filter(|&&c| c > m).count() as f64;
        let b = bisect(&|m| count(m) < k as f64);
        q = keep_prefix(&p, b, k as f64 - count(b));
        mass = sum(&q);
    }
    if top_p < 1.0 {
        let limit = top_p as f64 * mass;
        let above = |m: i32| -> f64 { (0..v).filter(|&i| keys[i] > m).map(|i| q[i] as f64).sum() };
        // top-p alone by the search, after a top-k cut by bisection (the kernel's choice)
        let b = match k > 0 && k < v {
            true => bisect(&|m| above(m) < limit),
            false => search(&|m| above(m) < limit),
        };
        let a = above(b);
        let pb = (0..v)
            .filter(|&i| keys[i] == b)
            .map(|i| q[i])
            .fold(0.0f32, f32::max);
        let j = if pb > 0.0 {
            ((limit - a) / pb as f64).ceil()
        } else {
            v as f64
        };
        q = keep_prefix(&q, b, j);
        mass = sum(&q);
    }
    q.iter().map(|&x| x / mass as f32).collect()
}

/// Any top-k and top-p without a sort, as the device computes it ([`searched_rule`]): the
/// host's `dense_probs` — the same tokens kept, each probability within 1e-5 — on rows
/// with ties at the k-th logit and at the top-p boundary (the lower token ids kept), one
/// dominant token, a flat row, −∞ logits and the doc's example; `rule_probs` on the CPU is
/// the host's rule itself, and refuses a bad top-p by name.
#[test]
fn rule_probs_are_the_host_rule() {
    let v = 300;
    let mut rows: Vec<Vec<f32>> = (0..5u64)
        .map(|s| {
            (0..v as u64)
                .map(|i| (((i + 5) * (s + 7) * 2654435761 % 997) as f32 / 997.0 - 0.5) * 8.0)
                .collect()
        })
        .collect();
    rows[1][42] = 30.0;
    rows[2] = vec![1.0; v]; // all tied: every cut keeps the lowest ids
    rows[3][7] = 9.0;
    rows[3][8] = 9.0; // a tie at the top
    rows[4][10..20].fill(2.5); // ten tokens tied in the middle of the ranking
    rows.push({
        let mut r = vec![-50.0; v];
        r[..4].copy_from_slice(&[0.0, 2.0, 1.0, -1.0]);
        r
    });
    rows.push({
        let mut r = vec![f32::NEG_INFINITY; v];
        r[3] = 1.0;
        r[9] = 0.5;
        r
    });
    let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
    let logits = on_cpu(&refs);
    // top-p off the flat row's grid of j / k: a cut exactly there is within rounding of
    // top-p, where the host's f32 running sum and the device's f64 sums may keep one token
    // more or less (the documented boundary move)
    for (t, k, top_p) in [
        (1.0f32, 3, 0.7f32),
        (0.7, 20, 0.905),
        (1.3, 64, 1.0),
        (1.0, 1, 0.5),
        (0.5, 50, 0.305),
        (1.0, 0, 0.9013),
        (0.8, 0, 0.5017),
        (1.2, 0, 0.999),
        (1.0, 200, 1.0),
        (0.9, 299, 0.95),
        (1.0, 150, 0.6033),
    ] {
        let params = dflash_core::sampling::SamplingParams {
            temperature: t,
            top_k: k,
            top_p,
            ..Default::default()
        };
        let on_cpu = rule_probs(&logits, t, k, top_p)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (r, row) in rows.iter().enumerate() {
            let want = dflash_core::sampling::dense_probs(row, &params);
            assert_eq!(on_cpu[r], want, "T {t} k {k} p {top_p} row {r}");
            let got = searched_rule(row, t, k, top_p);
            for (j, (&a, &b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    a > 0.0,
                    b > 0.0,
                    "T {t} k {k} p {top_p} row {r} token {j}: {a} vs {b}"
                );
                // the host renormalises a nucleus by an f32 sum in rank order (≈ n ulps
                // over n tokens), the device by an f64 sum
                assert!(
                    (a - b).abs() <= 1e-5 * b,
                    "T {t} k {k} p {top_p} row {r} token {j}: {a} vs {b}"
                );
            }
        }
    }
    // the doc's example: logits [0, 2, 1, −1] (the rest far below), T 1, top-k 3, top-p .7
    let ex = searched_rule(&rows[5], 1.0, 3, 0.7);
    assert!(
        (ex[1] - 0.731).abs() < 1e-3 && (ex[2] - 0.269).abs() < 1e-3,
        "{:?}",
        &ex[..4]
    );
    assert_eq!((ex[0], ex[3]), (0.0, 0.0));
    let e = rule_probs(&logits, 1.0, 0, 0.0).unwrap_err().to_string();
    assert!(e.contains("top-p in (0, 1]"), "{e}");
}

#[test]
fn bad_inputs_are_refused() {
    let p = on_cpu(&[&[0.5, 0.5]]);
    let u = Uniforms::new(&[0.5], &Device::Cpu).unwrap();
    assert!(temperature_probs(&p, 0.0).is_err());
    assert!(draw_rows(&p, &u, 1).is_err());
    let d = Tensor::new(&[2u32], &Device::Cpu).unwrap();
    let e = judge_rows(&p, &p, &d, &u, 0, 1).unwrap_err().to_string();
    assert!(e.contains("uniforms do not fit"), "{e}");
    let u2 = Uniforms::new(&[0.5, 0.5], &Device::Cpu).unwrap();
    let e = judge_rows(&p, &p, &d, &u2, 0, 1).unwrap_err().to_string();
    assert!(e.contains("outside a vocabulary"), "{e}");
}
