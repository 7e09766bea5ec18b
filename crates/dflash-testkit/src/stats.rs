//! Statistics for the losslessness tests at T > 0.

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

/// Each new token's counts in `got` distributed as in `want`: a two-sample chi-square test per
/// position, p > 0.01 ([`chi_square_p`]); `what` names the comparison in the panic message.
pub fn assert_distributed_alike(want: &[Vec<usize>], got: &[Vec<usize>], what: &str) {
    for (pos, (a, g)) in want.iter().zip(got).enumerate() {
        let p = chi_square_p(a, g);
        assert!(p > 0.01, "{what}: new token {} differs: p = {p}", pos + 1);
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
