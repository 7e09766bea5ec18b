//! Reports: `report.json` (per prompt and per mode), `report.md` (tables) and SVG plots.
//!
//! Definitions (τ from `dflash_core::stats`, once): τ pooled = committed tokens / rounds;
//! τ mean-of-means = z-lab's mean over requests of each request's mean τ_round; TPOT = decode
//! seconds / new tokens of a request (mean over requests); speed-up vs AR = AR's mean TPOT /
//! the mode's mean TPOT, both measured in this process on these prompts.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use dflash_core::stats::{summarize, TauSummary};
use dflash_core::tree::top_k_sorted;
use dflash_model::io::loader::LoadedTarget;
use dflash_model::Rows;
use serde::Serialize;

use crate::harness::{ModeSpec, Run};

#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    pub mode: String,
    pub requests: usize,
    pub new_tokens: usize,
    pub tau: TauSummary,
    pub tokens_per_second: f64,
    pub tpot_ms: f64,
    pub speedup_vs_ar: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Divergence {
    pub mode: String,
    pub item: String,
    pub turn: usize,
    /// Index of the first new token that differs from AR's.
    pub position: usize,
    /// The target's top-2 logit gap at that position given AR's prefix (a near-tie explains it).
    pub top2_gap: f32,
    /// The target's top logit there.
    pub top_logit: f32,
    /// Whether the gap is within the rounding of a bf16 (or f16) target's logits
    /// ([`near_tie`]): the wide verify and the one-row AR step round differently, so such a
    /// divergence is reported, not an error.
    pub near_tie: bool,
    /// The turn's conversation so far already differs from AR's: an earlier turn of the item
    /// diverged and this one continues the mode's own answer, so its tokens are not AR's to
    /// compare (reported, not an error; the earlier turn's divergence carries the verdict).
    /// Example: MT-Bench item 81 left AR's text in turn 0 at a near-tie; turn 1's prompt holds
    /// that other answer, and its first difference (new token 19) follows from it.
    pub follows_earlier_turn: bool,
}

/// The explained divergences, counted by cause, for a summary line. Example: two near-ties and
/// one later turn in bf16 → `["2 at near-ties of the bf16 logits", "1 in turns continuing an
/// earlier turn's divergence"]`; none → empty.
pub fn explained_counts(divs: &[Divergence], dtype: &str) -> Vec<String> {
    let ties = divs.iter().filter(|d| d.near_tie).count();
    let after = divs.iter().filter(|d| d.follows_earlier_turn).count();
    let mut parts = Vec::new();
    if ties > 0 {
        parts.push(format!("{ties} at near-ties of the {dtype} logits"));
    }
    if after > 0 {
        parts.push(format!(
            "{after} in turns continuing an earlier turn's divergence"
        ));
    }
    parts
}

impl Divergence {
    /// Whether the divergence is explained without a fault: a near-tie of the logits, or a
    /// turn that continues an earlier turn's divergence.
    pub fn explained(&self) -> bool {
        self.near_tie || self.follows_earlier_turn
    }
}

/// Whether a top-2 gap of `gap` at a top logit of `top` is within the rounding of `dtype`'s
/// logits: two of its steps at the top logit's magnitude (no gap is, in f32 or f64, where a
/// speculative mode must equal AR exactly). Example: bf16, top logit 20.5 (steps of
/// 2^(4 − 7) = 0.125) → gaps up to 0.25 are near-ties.
pub fn near_tie(dtype: DType, gap: f32, top: f32) -> bool {
    let mantissa = match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => return false,
    };
    if !gap.is_finite() || !top.is_finite() || top == 0.0 {
        return false;
    }
    let step = 2f32.powi(top.abs().log2().floor() as i32 - mantissa);
    gap <= 2.0 * step
}

#[derive(Debug, Clone, Serialize)]
pub struct Lossless {
    pub checked: bool,
    pub divergences: Vec<Divergence>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub command: String,
    pub dataset: String,
    pub target: String,
    pub drafters: Vec<String>,
    pub device: String,
    pub dtype: String,
    pub versions: serde_json::Value,
    pub temperature: f32,
    pub max_new_tokens: usize,
    /// Untimed tokens each mode decoded before the timed items (`EvalOptions::warmup_tokens`).
    pub warmup_tokens: usize,
    /// How DFlash chains accepted drafts at T > 0.
    pub acceptance: dflash_engine::Acceptance,
    /// Items evaluated, and in the dataset slice asked for (fewer when a time limit stopped it).
    pub items_done: usize,
    pub items_asked: usize,
    pub modes: Vec<ModeReport>,
    pub lossless: Lossless,
    pub runs: Vec<Run>,
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

pub fn mode_reports(specs: &[ModeSpec], runs: &[Run]) -> Vec<ModeReport> {
    let tpot = |r: &Run| dflash_core::stats::decode_secs_per_token(r.decode_secs, r.tokens.len());
    let ar_tpot = mean(
        &runs
            .iter()
            .filter(|r| r.mode == "ar")
            .map(tpot)
            .collect::<Vec<_>>(),
    );
    specs
        .iter()
        .map(|s| {
            let rs: Vec<&Run> = runs.iter().filter(|r| r.mode == s.label).collect();
            let rounds: Vec<&[dflash_core::stats::RoundOutcome]> =
                rs.iter().map(|r| r.rounds.as_slice()).collect();
            let new_tokens: usize = rs.iter().map(|r| r.tokens.len()).sum();
            let secs: f64 = rs.iter().map(|r| r.prefill_secs + r.decode_secs).sum();
            let t = mean(&rs.iter().map(|r| tpot(r)).collect::<Vec<_>>());
            ModeReport {
                mode: s.label.clone(),
                requests: rs.len(),
                new_tokens,
                tau: summarize(&rounds),
                tokens_per_second: new_tokens as f64 / secs.max(1e-12),
                tpot_ms: t * 1e3,
                speedup_vs_ar: (ar_tpot > 0.0 && t > 0.0).then(|| ar_tpot / t),
            }
        })
        .collect()
}

/// At T = 0 every mode must reproduce AR token for token; list where one does not.
pub fn lossless_check(lt: &LoadedTarget, runs: &[Run], greedy: bool) -> Result<Lossless> {
    if !greedy {
        return Ok(Lossless {
            checked: false,
            divergences: vec![],
        });
    }
    let ar_of = |item: &str, turn: usize| {
        runs.iter()
            .find(|a| a.mode == "ar" && a.item == item && a.turn == turn)
    };
    let mut divs = Vec::new();
    for r in runs.iter().filter(|r| r.mode != "ar") {
        let Some(ar) = ar_of(&r.item, r.turn) else {
            continue;
        };
        let prompt_differs = r.prompt_ids != ar.prompt_ids;
        if !prompt_differs && r.tokens == ar.tokens {
            continue;
        }
        // a prompt that differs from AR's is excused only after an earlier turn of the same
        // item and mode left AR's text (a first turn's prompt must be AR's)
        let follows_earlier_turn = prompt_differs
            && runs.iter().any(|e| {
                e.mode == r.mode
                    && e.item == r.item
                    && e.turn < r.turn
                    && ar_of(&e.item, e.turn).is_some_and(|a| a.tokens != e.tokens)
            });
        let p = r
            .tokens
            .iter()
            .zip(&ar.tokens)
            .position(|(a, b)| a != b)
            .unwrap_or(r.tokens.len().min(ar.tokens.len()));
        divs.push(Divergence {
            mode: r.mode.clone(),
            item: r.item.clone(),
            turn: r.turn,
            position: p,
            top2_gap: f32::NAN,
            top_logit: f32::NAN,
            near_tie: false,
            follows_earlier_turn,
        });
    }
    // the target's top-2 logit gap at each divergence, given AR's own prefix (a turn that
    // continues an earlier divergence has another prefix: no gap of AR's explains it)
    for d in divs.iter_mut().filter(|d| !d.follows_earlier_turn) {
        let ar = ar_of(&d.item, d.turn).expect("a divergence has its AR run");
        let mut prefix = ar.prompt_ids.clone();
        prefix.extend_from_slice(&ar.tokens[..d.position.min(ar.tokens.len())]);
        // a diagnostic beside the result: a gap that cannot be computed must not lose the runs
        (d.top2_gap, d.top_logit) = top2(lt, &prefix).unwrap_or_else(|e| {
            eprintln!(
                "warning: the top-2 logit gap at {} turn {} position {} could not be computed: {e:#}",
                d.item, d.turn, d.position
            );
            (f32::NAN, f32::NAN)
        });
        d.near_tie = near_tie(lt.target.dtype, d.top2_gap, d.top_logit);
    }
    Ok(Lossless {
        checked: true,
        divergences: divs,
    })
}

/// The target's top-2 logit gap after `prefix`, on the host in f32 whatever the target's device
/// and dtype (a bf16 CUDA target included: candle's CUDA sort refuses a 49,152-column row).
/// E.g. logits [1.0, 3.5, 2.0] → 3.5 − 2.0 = 1.5; a tie gives 0.
pub fn top2_gap(lt: &LoadedTarget, prefix: &[u32]) -> Result<f32> {
    Ok(top2(lt, prefix)?.0)
}

/// [`top2_gap`] and the top logit.
fn top2(lt: &LoadedTarget, prefix: &[u32]) -> Result<(f32, f32)> {
    let mut c = lt.target.new_cache();
    let o = lt.target.forward_causal(prefix, &mut c, &[], &Rows::Last)?;
    let logits = o
        .logits
        .context("the target's forward returned no logits")?
        .squeeze(0)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    match top_k_sorted(&logits, 2)[..] {
        [(_, a), (_, b)] => Ok((a - b, a)),
        _ => bail!("a top-2 gap needs at least 2 logits, got {}", logits.len()),
    }
}

fn svg_bars(title: &str, groups: &[(String, Vec<f64>)], xlabels: &[String], ymax: f64) -> String {
    let (w, h, left, bottom) = (720.0, 320.0, 50.0, 40.0);
    let colors = [
        "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
    ];
    let n = xlabels.len().max(1) as f64;
    let g = groups.len().max(1) as f64;
    let slot = (w - left - 10.0) / n;
    let bw = slot * 0.8 / g;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="16" font-size="13">{title}</text>"#,
        left
    );
    let plot_h = h - bottom - 30.0;
    let _ = write!(
        s,
        r#"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        h - bottom,
        w - 10.0,
        h - bottom
    );
    let _ = write!(
        s,
        r#"<text x="4" y="34">{ymax:.2}</text><text x="4" y="{}">0</text>"#,
        h - bottom
    );
    for (gi, (name, vals)) in groups.iter().enumerate() {
        let c = colors[gi % colors.len()];
        for (i, v) in vals.iter().enumerate() {
            let bh = if ymax > 0.0 {
                (v / ymax).clamp(0.0, 1.0) * plot_h
            } else {
                0.0
            };
            let x = left + i as f64 * slot + slot * 0.1 + gi as f64 * bw;
            let _ = write!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="{bw:.1}" height="{bh:.1}" fill="{c}"><title>{name}: {v:.3}</title></rect>"#,
                h - bottom - bh
            );
        }
        let _ = write!(
            s,
            r#"<rect x="{}" y="{}" width="10" height="10" fill="{c}"/><text x="{}" y="{}">{name}</text>"#,
            w - 170.0,
            24.0 + gi as f64 * 14.0,
            w - 155.0,
            33.0 + gi as f64 * 14.0
        );
    }
    for (i, l) in xlabels.iter().enumerate() {
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{l}</text>"#,
            left + (i as f64 + 0.5) * slot,
            h - bottom + 14.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Write report.json, report.md and the plots into `out`.
pub fn write(report: &Report, out: &Path) -> Result<()> {
    use dflash_model::io::atomic::write_file;
    std::fs::create_dir_all(out)?;
    write_file(
        &out.join("report.json"),
        (serde_json::to_string_pretty(report)? + "\n").as_bytes(),
    )?;
    write_plots(report, out)?;
    write_file(&out.join("report.md"), markdown(report).as_bytes())?;
    Ok(())
}

/// The plots: τ per mode, the histogram of tokens committed per round, the acceptance per
/// draft position.
fn write_plots(report: &Report, out: &Path) -> Result<()> {
    use dflash_model::io::atomic::write_file;
    let spec: Vec<&ModeReport> = report.modes.iter().filter(|m| m.mode != "ar").collect();
    // τ histogram (fraction of rounds committing t tokens)
    let maxt = report
        .modes
        .iter()
        .map(|m| m.tau.tau_histogram.len())
        .max()
        .unwrap_or(1);
    let hist: Vec<(String, Vec<f64>)> = spec
        .iter()
        .map(|m| {
            let tot = m.tau.rounds.max(1) as f64;
            (
                m.mode.clone(),
                (0..maxt)
                    .map(|t| *m.tau.tau_histogram.get(t).unwrap_or(&0) as f64 / tot)
                    .collect(),
            )
        })
        .collect();
    let labels: Vec<String> = (0..maxt).map(|t| t.to_string()).collect();
    write_file(
        &out.join("tau_histogram.svg"),
        svg_bars(
            "tokens committed per round (fraction of rounds)",
            &hist,
            &labels,
            1.0,
        )
        .as_bytes(),
    )?;
    let maxk = spec
        .iter()
        .map(|m| m.tau.per_position_acceptance.len())
        .max()
        .unwrap_or(0);
    let acc: Vec<(String, Vec<f64>)> = spec
        .iter()
        .map(|m| (m.mode.clone(), m.tau.per_position_acceptance.clone()))
        .collect();
    let klabels: Vec<String> = (1..=maxk).map(|k| k.to_string()).collect();
    write_file(
        &out.join("acceptance.svg"),
        svg_bars(
            "P(draft k accepted | drafts 1..k-1 accepted)",
            &acc,
            &klabels,
            1.0,
        )
        .as_bytes(),
    )?;
    let taus: Vec<(String, Vec<f64>)> = report
        .modes
        .iter()
        .map(|m| (m.mode.clone(), vec![m.tau.tau_pooled]))
        .collect();
    let tmax = report
        .modes
        .iter()
        .map(|m| m.tau.tau_pooled)
        .fold(1.0, f64::max);
    write_file(
        &out.join("tau.svg"),
        svg_bars(
            &format!("τ (pooled) on {}", report.dataset),
            &taus,
            std::slice::from_ref(&report.dataset),
            tmax,
        )
        .as_bytes(),
    )?;

    Ok(())
}

/// report.md: the run's settings, one row per mode, the acceptance per position and the
/// losslessness check.
fn markdown(report: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# dflash-rs evaluation: {}\n", report.dataset);
    let _ = writeln!(md, "- command: `{}`", report.command);
    let _ = writeln!(
        md,
        "- target: {}; drafters: {}",
        report.target,
        report.drafters.join(", ")
    );
    let _ = writeln!(
        md,
        "- device {}, dtype {}, temperature {}, max new tokens {}, warm-up {} untimed tokens per mode, acceptance {}",
        report.device,
        report.dtype,
        report.temperature,
        report.max_new_tokens,
        report.warmup_tokens,
        report.acceptance
    );
    let _ = writeln!(md, "- versions: {}", report.versions);
    if report.items_done < report.items_asked {
        let _ = writeln!(
            md,
            "- **stopped at the time limit: {} of {} items** (every mode on the same items)",
            report.items_done, report.items_asked
        );
    }
    let _ = writeln!(md);
    let _ = writeln!(md, "| mode | requests | τ pooled | τ mean of means | rounds | new tokens | tok/s | TPOT ms | speed-up vs AR | draft s | verify s | other s |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for m in &report.modes {
        let _ = writeln!(
            md,
            "| {} | {} | {:.3} | {:.3} | {} | {} | {:.1} | {:.2} | {} | {:.2} | {:.2} | {:.2} |",
            m.mode,
            m.requests,
            m.tau.tau_pooled,
            m.tau.tau_mean_of_means,
            m.tau.rounds,
            m.new_tokens,
            m.tokens_per_second,
            m.tpot_ms,
            m.speedup_vs_ar
                .map(|s| format!("{s:.2}×"))
                .unwrap_or_default(),
            m.tau.draft_secs,
            m.tau.verify_secs,
            m.tau.other_secs
        );
    }
    lossless_markdown(report, &mut md);
    md
}

/// report.md's acceptance per position and losslessness sections.
fn lossless_markdown(report: &Report, md: &mut String) {
    let spec: Vec<&ModeReport> = report.modes.iter().filter(|m| m.mode != "ar").collect();
    let _ = writeln!(md, "\nPer-position acceptance (k = 1 …):\n");
    for m in &spec {
        let v: Vec<String> = m
            .tau
            .per_position_acceptance
            .iter()
            .map(|a| format!("{a:.2}"))
            .collect();
        let _ = writeln!(md, "- {}: {}", m.mode, v.join(" "));
    }
    let _ = writeln!(
        md,
        "\nLosslessness (T = 0: every mode equals AR token for token): {}",
        match (&report.lossless.checked, report.lossless.divergences.len()) {
            (false, _) => "not checked (T > 0)".to_string(),
            (true, 0) => "all modes equal AR".to_string(),
            (true, n) => {
                let parts = explained_counts(&report.lossless.divergences, &report.dtype);
                match parts.is_empty() {
                    true => format!("{n} divergence(s)"),
                    false => format!(
                        "{n} divergence(s), {} (reported, not errors)",
                        parts.join(", ")
                    ),
                }
            }
        }
    );
    for d in &report.lossless.divergences {
        let _ = writeln!(
            md,
            "- {} on {} turn {}: first difference at new token {}{}",
            d.mode,
            d.item,
            d.turn,
            d.position,
            match (d.follows_earlier_turn, d.near_tie) {
                (true, _) =>
                    " (the conversation already differs: an earlier turn diverged)".to_string(),
                (false, true) => format!(", target top-2 gap {:.2e} (a near-tie)", d.top2_gap),
                (false, false) => format!(", target top-2 gap {:.2e}", d.top2_gap),
            }
        );
    }
    let _ = writeln!(
        md,
        "\n![τ](tau.svg) ![histogram](tau_histogram.svg) ![acceptance](acceptance.svg)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The summary counts each cause of an explained divergence; faults are not counted.
    #[test]
    fn explained_divergences_are_counted_by_cause() {
        let d = |near_tie, follows_earlier_turn| Divergence {
            mode: "dflash".into(),
            item: "mt-bench-81".into(),
            turn: usize::from(follows_earlier_turn),
            position: 3,
            top2_gap: 0.1,
            top_logit: 20.0,
            near_tie,
            follows_earlier_turn,
        };
        let divs = [
            d(true, false),
            d(true, false),
            d(false, true),
            d(false, false),
        ];
        assert_eq!(
            explained_counts(&divs, "bf16"),
            [
                "2 at near-ties of the bf16 logits",
                "1 in turns continuing an earlier turn's divergence"
            ]
        );
        assert_eq!(divs.iter().filter(|d| !d.explained()).count(), 1);
        assert!(explained_counts(&divs[3..], "f32").is_empty());
    }

    /// Near-ties are gaps within two rounding steps of a half-precision target's top logit;
    /// never in f32.
    #[test]
    fn near_ties_are_two_rounding_steps_of_the_top_logit() {
        // bf16 at 20.5: steps of 0.125
        assert!(near_tie(DType::BF16, 0.0, 20.5));
        assert!(near_tie(DType::BF16, 0.25, 20.5));
        assert!(!near_tie(DType::BF16, 0.375, 20.5));
        // bf16 at 3.0: steps of 2^(1 − 7)
        assert!(near_tie(DType::BF16, 0.03, -3.0));
        assert!(!near_tie(DType::BF16, 0.05, 3.0));
        // f16 at 20.5: steps of 2^(4 − 10)
        assert!(!near_tie(DType::F16, 0.25, 20.5));
        assert!(near_tie(DType::F16, 0.03, 20.5));
        // f32 never; an unknown gap never
        assert!(!near_tie(DType::F32, 0.0, 20.5));
        assert!(!near_tie(DType::BF16, f32::NAN, 20.5));
    }
}
