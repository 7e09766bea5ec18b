//! The sampling kernels against their CPU twins: each row's arg-max and top k, sampling at
//! T > 0 (probabilities, draws, verdicts), a sampled tree's draws and walks, and the top-k /
//! top-p rule's probabilities.

use candle_core::{DType, Device, Result, Tensor};

use super::{fill, push_rows, KernelCheck};

/// [`crate::ops::sample_rows`] on `dev`: `[probabilities at T = 0.8, draws, verdicts]` on the
/// CPU, for `rows` rows of `v` logits. The verdicts judge the second half's draws (from its
/// probabilities) against the first half's; one pair of rows is equal (its draft always kept).
fn sampling(dev: &Device, rows: usize, v: usize) -> Result<Vec<Tensor>> {
    use crate::ops::sample_rows::{draw_rows, judge_rows, temperature_probs, Uniforms};
    let mut x = fill(&[rows, v], 13, 8.0)?;
    let h = rows / 2;
    x = x.slice_assign(&[h..h + 1, 0..v], &x.narrow(0, 0, 1)?)?;
    let u: Vec<f32> = (0..3 * rows)
        .map(|i| (i as f32 * 0.618_034 + 0.1).fract())
        .collect();
    let u = Uniforms::new(&u, dev)?;
    let p = temperature_probs(&x.to_device(dev)?, 0.8)?;
    let drawn = draw_rows(&p, &u, 0)?;
    let (pp, q) = (p.narrow(0, 0, h)?, p.narrow(0, h, h)?);
    let verdicts = judge_rows(&pp, &q, &drawn.narrow(0, h, h)?, &u, rows, 2 * rows)?;
    [p, drawn, verdicts.flatten_all()?]
        .iter()
        .map(|t| t.to_device(&Device::Cpu))
        .collect()
}

/// [`crate::ops::sampled_tree`] on `dev`: 8 draws from each of 6 depths' distributions (T =
/// 0.8, rows of `v` values), and 4 walks (path length, bonus, path) down the tree of budget 12
/// shaped by their top 8 and given the CPU's draws (the same tree on both devices): two with
/// random target rows (rejections, residuals), two with each row equal to its children's draft
/// distribution (every first child kept), each with its own uniform numbers.
fn sampled_tree(dev: &Device, v: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    use crate::ops::sample_rows::{temperature_probs, Uniforms};
    use crate::ops::sampled_tree::{draw_distinct_rows, walk_tree_rows, TreeTable};
    use dflash_core::sampled_tree::{place_draws, sampled_shape};
    let (depths, k, budget) = (6, 8, 12);
    let q = temperature_probs(&fill(&[depths, v], 19, 8.0)?, 0.8)?;
    let u: Vec<f32> = (0..depths * k + 4 * (budget + 1))
        .map(|i| (i as f32 * 0.618_034 + 0.3).fract())
        .collect();
    let (ud, uc) = (Uniforms::new(&u, dev)?, Uniforms::new(&u, &Device::Cpu)?);
    let draws = draw_distinct_rows(&q.to_device(dev)?, &ud, 0, k)?.to_device(&Device::Cpu)?;
    let (mut tree, _) = sampled_shape(0, &crate::ops::top_k::top_k_rows(&q, k)?, budget);
    place_draws(
        &mut tree,
        &draw_distinct_rows(&q, &uc, 0, k)?.to_vec2::<u32>()?,
    );
    let n = tree.len();
    let random = temperature_probs(&fill(&[n, v], 23, 8.0)?, 0.8)?;
    let at: Vec<u32> = tree
        .depths
        .iter()
        .map(|&d| d.min(depths - 1) as u32)
        .collect();
    let same = q.index_select(&Tensor::new(at, &Device::Cpu)?, 0)?;
    let (table, qd) = (TreeTable::new(&tree, dev)?, q.to_device(dev)?);
    let mut walks = Vec::new();
    for (w, p) in [&random, &random, &same, &same].into_iter().enumerate() {
        let out = walk_tree_rows(&p.to_device(dev)?, &qd, &table, &ud, depths * k + w * n)?;
        walks.extend(out.to_vec1::<u32>()?);
    }
    Ok((draws.flatten_all()?.to_vec1::<u32>()?, walks))
}

/// Rows of 3,001 logits with a NaN in rows 0 and 1: the arg-max's and the top k's inputs.
fn rows_with_nans() -> Result<Tensor> {
    let mut x = fill(&[48, 3001], 5, 8.0)?;
    x = x.slice_assign(&[0..1, 0..1], &Tensor::new(&[[f32::NAN]], &Device::Cpu)?)?;
    x = x.slice_assign(&[1..2, 7..8], &Tensor::new(&[[f32::NAN]], &Device::Cpu)?)?;
    Ok(x)
}

/// The arg-max of each row: the same index, ties (the values repeat) and NaN included
pub(super) fn check_argmax(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    let x = rows_with_nans()?;
    let (a, b) = (
        crate::ops::argmax::argmax_rows(&x.to_device(dev)?)?,
        crate::ops::argmax::argmax_rows(&x)?,
    );
    let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
    checks.push(KernelCheck {
        name: "argmax rows (F32), fraction of rows that differ".into(),
        rel_err: differ as f64 / b.len() as f64,
        tolerance: 0.0,
    });
    Ok(())
}

/// The top k of each row (DDTree's candidates): the same tokens in the same order; rows of
/// 9,000 values span three segments of the GPU's first stage, the last shorter than k = 1000
pub(super) fn check_top_k(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    let x = rows_with_nans()?;
    let long = fill(&[6, 9000], 11, 8.0)?;
    for (x, k) in [(&x, 40), (&x, 100), (&long, 1000)] {
        let (a, b) = (
            crate::ops::top_k::top_k_rows(&x.to_device(dev)?, k)?,
            crate::ops::top_k::top_k_rows(x, k)?,
        );
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(p, q)| p.iter().map(|t| t.0).ne(q.iter().map(|t| t.0)))
            .count();
        checks.push(KernelCheck {
            name: format!("top-{k} rows (F32), fraction of rows that differ"),
            rel_err: differ as f64 / b.len() as f64,
            tolerance: 0.0,
        });
    }
    Ok(())
}

/// Sampling at T > 0: probabilities, draws and verdicts (rows of 3,001 and of 151,936
/// values); draws and verdicts the same tokens
pub(super) fn check_sampling(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    for (rows, v) in [(48, 3001), (4, 151_936)] {
        let (got, want) = (sampling(dev, rows, v)?, sampling(&Device::Cpu, rows, v)?);
        push_rows(
            checks,
            &[&format!("temperature probabilities, {v} values")],
            &got[..1],
            &want[..1],
            DType::F32,
            1e-5,
        )?;
        for (i, what) in [(1, "draws"), (2, "verdicts")] {
            let (a, b) = (got[i].to_vec1::<u32>()?, want[i].to_vec1::<u32>()?);
            let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            checks.push(KernelCheck {
                name: format!("sampled {what} of rows of {v} values (F32), fraction that differ"),
                rel_err: differ as f64 / b.len() as f64,
                tolerance: 0.0,
            });
        }
    }
    Ok(())
}

/// A sampled tree's draws without replacement and its walks (`ops::sampled_tree`): the
/// same draws, the same paths and bonuses
pub(super) fn check_sampled_tree(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    for v in [3001, 151_936] {
        let (got, want) = (sampled_tree(dev, v)?, sampled_tree(&Device::Cpu, v)?);
        for (what, a, b) in [("draws", &got.0, &want.0), ("walks", &got.1, &want.1)] {
            let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
            checks.push(KernelCheck {
                name: format!(
                    "sampled tree {what}, rows of {v} values (F32), fraction that differ"
                ),
                rel_err: differ as f64 / b.len() as f64,
                tolerance: 0.0,
            });
        }
    }
    Ok(())
}

/// A top-k and top-p rule's probabilities (the bisected cuts of `rule_probs_f32`): the
/// host's rule within rounding, the same tokens kept; top-k alone, top-p alone, both
pub(super) fn check_rule_probs(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    for (rows, v, k, top_p) in [
        (48, 3001, 20, 0.9f32),
        (4, 151_936, 64, 1.0),
        (48, 3001, 0, 0.9),
        (4, 151_936, 500, 0.95),
    ] {
        let x = fill(&[rows, v], 17, 8.0)?;
        let probs = |d: &Device| -> Result<Tensor> {
            crate::ops::sample_rows::rule_probs(&x.to_device(d)?, 0.8, k, top_p)?
                .to_device(&Device::Cpu)
        };
        let (got, want) = (probs(dev)?, probs(&Device::Cpu)?);
        push_rows(
            checks,
            &[&format!("top-{k} top-p {top_p} probabilities, {v} values")],
            std::slice::from_ref(&got),
            std::slice::from_ref(&want),
            DType::F32,
            1e-5,
        )?;
        let (a, b) = (
            got.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?,
        );
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| (**x > 0.0) != (**y > 0.0))
            .count();
        checks.push(KernelCheck {
            name: format!("top-{k} top-p {top_p} rows of {v} values, tokens kept that differ"),
            rel_err: differ as f64 / b.len() as f64,
            tolerance: 0.0,
        });
    }
    Ok(())
}
