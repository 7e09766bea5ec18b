//! `bench shape`'s report: the tables of its timings against the memory floor and the cost
//! model, and the JSON rows for `docs/bench/`.

use std::path::Path;

use anyhow::Result;

use super::gdn::GdnRuleTimes;
use super::graph_costs::GraphCosts;
use super::measure::{DraftGraph, Eager, Floor, TreeTime};
use super::BenchShapeArgs;

/// Everything `bench shape` measured.
pub(super) struct Timings {
    pub eager: Eager,
    /// GPU only (not with DFLASH_PROFILE set).
    pub draft_graph: Option<DraftGraph>,
    pub trees: Vec<TreeTime>,
    /// GPU only (not with DFLASH_PROFILE set): `(forward, rows, costs)`.
    pub graphs: Vec<(String, usize, GraphCosts)>,
    /// Hybrid shapes only.
    pub gdn_rule: Vec<GdnRuleTimes>,
    pub floor: Floor,
}

/// The cost model's speed-ups at `tau`: the chain (`t_draft + t_chain`) and the best DDTree
/// budget (`t_draft_top + t_tree`, the same τ: a lower bound, a tree's τ being higher).
/// Example: AR 10 ms, draft 1, chain 11, τ 6 → dflash 6 · 10 / 12 = 5.0.
fn costmodel(
    tau: f64,
    t_ar: f64,
    t_draft: f64,
    t_chain: f64,
    t_draft_top: f64,
    trees: &[f64],
) -> serde_json::Value {
    let best = trees
        .iter()
        .map(|t| tau * t_ar / (t_draft_top + t))
        .fold(f64::NAN, f64::max);
    serde_json::json!({
        "tau": tau,
        "dflash": tau * t_ar / (t_draft + t_chain),
        "ddtree_best": if best.is_nan() { serde_json::Value::Null } else { best.into() },
    })
}

/// The tables, in order: the forwards against the floor, the replayed draft block, where each
/// forward's time goes (GPU), one Gated DeltaNet layer's rule (hybrid shapes), the cost model.
pub(super) fn print(a: &BenchShapeArgs, t: &Timings) {
    print_forwards(a, t);
    if let Some(g) = t.draft_graph {
        print_draft_graph(a, g);
    }
    if !t.graphs.is_empty() {
        print_graph_costs(a.repeats, &t.graphs, t.floor.seconds);
    }
    if !t.gdn_rule.is_empty() {
        print_gdn_rule(a.repeats, &t.gdn_rule);
    }
    print_cost_model(&t.eager, &t.trees);
}

/// The shape, the floor, and one row per eager forward: ms and × floor.
fn print_forwards(a: &BenchShapeArgs, m: &Timings) {
    let (e, f) = (&m.eager, &m.floor);
    let floor = f.seconds;
    println!(
        "random {}-shaped target on {} ({}), {}-row cache, median of {}; {:.2} B parameters, read floor {:.3} ms per forward ({:.0} GB/s read bandwidth; a copy moves {:.0} GB/s counting read + write)\n",
        a.model.shape, a.model.run_on.device, a.model.run_on.dtype, a.cache, a.repeats, f.params as f64 / 1e9, f.seconds * 1e3, f.read_bw / 1e9, f.copy_bw / 1e9
    );
    println!("Verifies read back what the decoding loop reads at T = 0: one arg-max per row, picked on the device.\n");
    println!("| forward | rows | ms | × floor |\n|---|---|---|---|");
    let row = |name: &str, rows: usize, t: f64| {
        println!("| {name} | {rows} | {:.3} | {:.1} |", t * 1e3, t / floor)
    };
    row("AR step", 1, e.ar);
    row(
        &format!("chain verify (B = {})", a.block_size),
        a.block_size,
        e.chain,
    );
    row(
        &format!(
            "chain verify (B = {}), every row's logits to the host (T > 0)",
            a.block_size
        ),
        a.block_size,
        e.chain_rows,
    );
    for (b, rows, t) in &m.trees {
        row(&format!("DDTree-{b} verify"), *rows, *t);
    }
    for (read, t) in [
        ("argmax per row", e.draft),
        (
            "DDTree-32's top 32 per row picked on the device",
            e.draft_top,
        ),
        ("every row's log-probabilities to the host", e.draft_rows),
    ] {
        println!(
            "| draft block ({} layers, B = {}), {read} | {} | {:.3} | |",
            a.draft_layers,
            a.block_size,
            a.block_size,
            t * 1e3
        );
    }
}

/// The draft block replayed from a CUDA graph, per read, and its logits against the eager
/// draft's.
fn print_draft_graph(a: &BenchShapeArgs, (t, t_top, diff): DraftGraph) {
    for (read, t) in [
        ("argmax per row", t),
        ("DDTree-32's top 32 per row picked on the device", t_top),
    ] {
        println!(
            "| draft block ({} layers, B = {}) replayed from a CUDA graph, {read} | {} | {:.3} | |",
            a.draft_layers,
            a.block_size,
            a.block_size,
            t * 1e3
        );
    }
    println!(
        "\nThe replayed draft block's logits against the eager draft's: max abs Δ {diff:.2e}."
    );
}

/// Where each forward's time goes ([`GraphCosts`]), against the floor.
fn print_graph_costs(repeats: usize, graphs: &[(String, usize, GraphCosts)], floor: f64) {
    println!("\nWhere a forward's time goes (`Target::forward_prepared`: the device part, after `prepare` copied ids, RoPE rows and mask; `dflash_model::cuda::launch_profile`), median of {}. Kernels and layout uploads counted by a CUDA-graph capture that is never launched; \"param cache\": candle's device cache of small uploads, warmed by one run; host enqueue and GPU time of the same kernels enqueued behind a GPU blocker; graph replay: the forward captured (with the param cache) and relaunched.\n", repeats);
    println!("| forward | rows | kernels | uploads (no cache / cache) | allocs / frees | prepare ms | eager ms | eager, param cache ms | host enqueue ms | GPU ms | graph replay ms | replay × floor | replay vs eager logits, max abs Δ |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, rows, c) in graphs {
        let (k, kc) = (&c.nodes, &c.nodes_cached);
        let split = match c.split {
            Some((h, g)) => format!("{:.3} | {:.3}", h * 1e3, g * 1e3),
            None => "host waited | —".to_string(),
        };
        println!(
            "| {name} | {rows} | {} | {} / {} | {} / {} | {:.3} | {:.3} | {:.3} | {split} | {:.3} | {:.1} | {:.2e} |",
            kc.kernels,
            k.memcpy,
            kc.memcpy,
            kc.alloc,
            kc.free,
            c.prepare * 1e3,
            c.eager * 1e3,
            c.eager_cached * 1e3,
            c.replay * 1e3,
            c.replay / floor,
            c.max_diff
        );
    }
}

/// One Gated DeltaNet layer's rule alone: chunked against recurrent per length.
fn print_gdn_rule(repeats: usize, gdn_rule: &[GdnRuleTimes]) {
    println!("\nOne Gated DeltaNet layer's rule alone (f32 rows of q, k, v, β, g in; o and the last state out; `dflash_model::ops::gdn_chunk` with the `--dtype`'s products, TF32 tensor cores unless f32, vs the recurrent kernel over the same chain), median of {}:\n", repeats);
    println!("| rows | chunked ms | of which the prep kernel ms | recurrent ms | recurrent / chunked |\n|---|---|---|---|---|");
    for (t, c, p, r) in gdn_rule {
        let p = p.map_or("—".to_string(), |p| format!("{:.3}", p * 1e3));
        println!(
            "| {t} | {:.3} | {p} | {:.3} | {:.1}× |",
            c * 1e3,
            r * 1e3,
            r / c
        );
    }
}

/// The cost model's speed-ups at τ 2..=7: the chain and each DDTree budget.
fn print_cost_model(e: &Eager, trees: &[TreeTime]) {
    println!("\nCost model, speed-up = τ · T_AR / (T_draft + T_verify):\n");
    let taus = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0];
    print!("| τ |");
    for t in taus {
        print!(" {t} |");
    }
    println!("\n|---|{}", "---|".repeat(taus.len()));
    let line = |name: &str, verify: f64| {
        print!("| {name} |");
        for t in taus {
            print!(" {:.2}× |", t * e.ar / (e.draft + verify));
        }
        println!();
    };
    line("DFlash chain", e.chain);
    for (b, _, t) in trees {
        line(&format!("DDTree-{b}"), *t);
    }
}

/// The `--output-json` rows written to `path`: one per timing mode (eager; CUDA graphs when their AR
/// step and chain verify were measured), the AR step, the chain verify and the DDTree verifies
/// of that mode, the (eager) draft block beside them.
pub(super) fn write_json(path: &Path, a: &BenchShapeArgs, t: &Timings) -> Result<()> {
    let (e, floor) = (&t.eager, t.floor.seconds);
    // each budget's DDTree verify, ms: `{"8": 25.5, …}`
    let tree_ms = |trees: &[(usize, f64)]| -> serde_json::Map<String, serde_json::Value> {
        trees
            .iter()
            .map(|&(b, t)| (b.to_string(), (t * 1e3).into()))
            .collect()
    };
    let row = |mode: &str,
               ar: f64,
               chain: f64,
               trees: &[(usize, f64)],
               (t_draft, t_draft_top): (f64, f64)| {
        let times: Vec<f64> = trees.iter().map(|t| t.1).collect();
        serde_json::json!({
            "shape": a.model.shape,
            "impl": "dflash-rs",
            "mode": mode,
            "device": a.model.run_on.device,
            "dtype": a.model.run_on.dtype,
            "cache_rows": a.cache,
            "block_size": a.block_size,
            "ar_ms": ar * 1e3,
            "verify16_ms": chain * 1e3,
            "draft_ms": t_draft * 1e3,
            "draft_top32_ms": t_draft_top * 1e3,
            "read_floor_ms": floor * 1e3,
            "ddtree_verify_ms": tree_ms(trees),
            "costmodel": costmodel(a.tau, ar, t_draft, chain, t_draft_top, &times),
        })
    };
    let trees: Vec<(usize, f64)> = t.trees.iter().map(|r| (r.0, r.2)).collect();
    let mut rows = vec![row("eager", e.ar, e.chain, &trees, (e.draft, e.draft_top))];
    let replay = |name: &str| {
        t.graphs
            .iter()
            .find(|g| g.0.starts_with(name))
            .map(|g| g.2.replay)
    };
    if let (Some(g_ar), Some(g_chain)) = (replay("AR step"), replay("chain verify")) {
        let g_trees: Vec<(usize, f64)> = t
            .trees
            .iter()
            .filter_map(|r| Some((r.0, replay(&format!("DDTree-{} verify", r.0))?)))
            .collect();
        let (mode, draft) = match t.draft_graph {
            Some((t, t_top, _)) => ("cuda graphs", (t, t_top)),
            None => (
                "cuda graphs (the draft block eager)",
                (e.draft, e.draft_top),
            ),
        };
        rows.push(row(mode, g_ar, g_chain, &g_trees, draft));
    }
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    dflash_model::io::atomic::write_file(path, text.as_bytes())?;
    Ok(())
}
