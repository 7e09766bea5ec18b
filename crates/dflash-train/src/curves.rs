//! Training curves as a self-contained SVG: loss (train and validation) and simulated τ
//! (train, validation, and validation as decoding would measure it) against the optimizer step, from `metrics.jsonl`. Written beside
//! every checkpoint (`OUT/curves.svg`) and by `dflash-rs train curves` for any run.
//!
//! Train curves are smoothed with a centred moving average over `max(1, steps / 50)` steps
//! (one sequence batch is noisy); validation points are drawn as they were measured.

use std::fmt::Write;

use crate::trainer::StepMetrics;

/// One series: (step, value) points.
type Series = Vec<(f64, f64)>;

fn smooth(points: &[(f64, f64)]) -> Series {
    let w = (points.len() / 50).max(1);
    (0..points.len())
        .map(|i| {
            let lo = i.saturating_sub(w / 2);
            let hi = (i + w / 2 + 1).min(points.len());
            let mean = points[lo..hi].iter().map(|p| p.1).sum::<f64>() / (hi - lo) as f64;
            (points[i].0, mean)
        })
        .collect()
}

/// A panel of line series (name, colour, points), at (x0, y0) of size (w, h).
fn panel(
    s: &mut String,
    title: &str,
    series: &[(&str, &str, Series)],
    (x0, y0, w, h): (f64, f64, f64, f64),
) {
    let pts = series.iter().flat_map(|x| x.2.iter());
    let (mut xmin, mut xmax, mut ymin, mut ymax) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts.filter(|p| p.1.is_finite()) {
        xmin = xmin.min(x);
        xmax = xmax.max(x);
        ymin = ymin.min(y);
        ymax = ymax.max(y);
    }
    if xmin > xmax {
        (xmin, xmax, ymin, ymax) = (0.0, 1.0, 0.0, 1.0);
    }
    if ymax - ymin < 1e-9 {
        ymax = ymin + 1.0;
    }
    if xmax - xmin < 1e-9 {
        xmax = xmin + 1.0;
    }
    let px = |x: f64| x0 + 40.0 + (x - xmin) / (xmax - xmin) * (w - 50.0);
    let py = |y: f64| y0 + h - 25.0 - (y - ymin) / (ymax - ymin) * (h - 45.0);
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" font-weight="bold">{title}</text>"#,
        x0 + 40.0,
        y0 + 12.0
    );
    let _ = write!(
        s,
        r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#999"/>"##,
        x0 + 40.0,
        y0 + 20.0,
        w - 50.0,
        h - 45.0
    );
    for (v, y) in [(ymin, py(ymin)), (ymax, py(ymax))] {
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{v:.2}</text>"#,
            x0 + 36.0,
            y + 4.0
        );
    }
    for (v, x) in [(xmin, px(xmin)), (xmax, px(xmax))] {
        let _ = write!(
            s,
            r#"<text x="{x}" y="{}" text-anchor="middle">step {v:.0}</text>"#,
            y0 + h - 8.0
        );
    }
    for (i, (name, colour, points)) in series.iter().enumerate() {
        let coords: Vec<String> = points
            .iter()
            .filter(|p| p.1.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        if coords.len() == 1 {
            let (x, y) = coords[0].split_once(',').unwrap();
            let _ = write!(s, r#"<circle cx="{x}" cy="{y}" r="2.5" fill="{colour}"/>"#);
        } else if !coords.is_empty() {
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{}"/>"#,
                coords.join(" ")
            );
        }
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" fill="{colour}">{name}</text>"#,
            x0 + w - 150.0,
            y0 + 34.0 + 14.0 * i as f64
        );
    }
}

/// The SVG of a run's metrics (empty runs give empty panels).
pub fn svg(metrics: &[StepMetrics]) -> String {
    let pick = |f: &dyn Fn(&StepMetrics) -> Option<f64>| -> Series {
        metrics
            .iter()
            .filter_map(|m| f(m).map(|v| (m.step as f64, v)))
            .collect()
    };
    let loss = smooth(&pick(&|m| Some(m.loss)));
    let val_loss = pick(&|m| m.val_loss);
    let tau = smooth(&pick(&|m| Some(m.simulated_tau)));
    let val_tau = pick(&|m| m.val_simulated_tau);
    let val_dec = pick(&|m| m.val_simulated_decoding_tau);
    let mut s = String::from(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="760" height="300" font-family="sans-serif" font-size="11">"#,
    );
    panel(
        &mut s,
        "loss",
        &[
            ("train (smoothed)", "#1f77b4", loss),
            ("validation", "#d62728", val_loss),
        ],
        (0.0, 0.0, 380.0, 300.0),
    );
    panel(
        &mut s,
        "simulated τ",
        &[
            ("train (smoothed)", "#1f77b4", tau),
            ("validation", "#d62728", val_tau),
            ("validation, as decoding", "#2ca02c", val_dec),
        ],
        (380.0, 0.0, 380.0, 300.0),
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(step: usize, loss: f64, val: Option<f64>) -> StepMetrics {
        StepMetrics {
            step,
            epoch: 0,
            loss,
            lr: 1e-3,
            grad_norm: 1.0,
            supervised_tokens: 10,
            acceptance: vec![],
            simulated_tau: 1.0 + 1.0 / loss,
            simulated_decoding_tau: 1.0,
            tokens_per_sec: 1.0,
            val_loss: val,
            val_simulated_tau: val.map(|v| 1.0 + 1.0 / v),
            val_simulated_decoding_tau: None,
        }
    }

    #[test]
    fn curves_have_one_point_per_step_and_validation_markers() {
        let ms: Vec<StepMetrics> = (1..=100)
            .map(|i| m(i, 10.0 / i as f64, (i % 50 == 0).then_some(5.0 / i as f64)))
            .collect();
        let s = svg(&ms);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        // 2 train polylines of 100 points, 2 validation polylines of 2 points
        let polylines: Vec<&str> = s.split("<polyline").skip(1).collect();
        assert_eq!(polylines.len(), 4);
        let npts = |p: &str| {
            p.split("points=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .split(' ')
                .count()
        };
        assert_eq!(npts(polylines[0]), 100);
        assert_eq!(npts(polylines[1]), 2);
        // a single validation point is a marker, no run at all is still an SVG
        assert!(svg(&[m(1, 2.0, Some(1.0))]).contains("<circle"));
        assert!(svg(&[]).contains("</svg>"));
    }

    #[test]
    fn smoothing_keeps_a_constant_and_the_length() {
        let p: Vec<(f64, f64)> = (0..200).map(|i| (i as f64, 3.0)).collect();
        let s = smooth(&p);
        assert_eq!(s.len(), 200);
        assert!(s.iter().all(|q| (q.1 - 3.0).abs() < 1e-12));
    }
}
