//! What the ranks exchange besides gradients: their agreement that every rank is well, and
//! each row's numbers (loss, weight, acceptance counts) as a flat vector.

use anyhow::{bail, Result};
use dflash_core::stats::AcceptCounts;

use crate::collective::Collective;

/// `r` when every rank's `r` is `Ok`; otherwise every rank stops (the failed rank with its own
/// error), so that no rank waits in a collective a failed rank never reaches.
pub(super) fn agreed<T>(comm: &dyn Collective, r: Result<T>) -> Result<T> {
    if comm.is_single() {
        return r;
    }
    let ok = comm.all_gather(&[r.is_ok() as u8 as f64])?;
    match (r, ok.iter().position(|&v| v == 0.0)) {
        (Err(e), _) => Err(e),
        (Ok(_), Some(bad)) => bail!("rank {bad} failed (its error is above): stopping"),
        (Ok(v), None) => Ok(v),
    }
}

/// One row's numbers for the other ranks: loss, weight, anchors, Σ 1/τ, offered, reached.
pub(super) fn row_stats(l: f64, w: f64, c: &AcceptCounts, positions: usize) -> Vec<f64> {
    let mut full = AcceptCounts::new(positions);
    full.merge(c);
    let mut v = vec![l, w, full.anchors as f64, full.inverse_tau_sum];
    v.extend(full.offered.iter().map(|&x| x as f64));
    v.extend(full.reached.iter().map(|&x| x as f64));
    v
}

pub(super) fn row_stats_len(positions: usize) -> usize {
    4 + 2 * positions
}

pub(super) fn parse_row_stats(v: &[f64], positions: usize) -> (f64, f64, AcceptCounts) {
    let mut c = AcceptCounts::new(positions);
    c.anchors = v[2] as u64;
    c.inverse_tau_sum = v[3];
    c.offered = v[4..4 + positions].iter().map(|&x| x as u64).collect();
    c.reached = v[4 + positions..4 + 2 * positions]
        .iter()
        .map(|&x| x as u64)
        .collect();
    (v[0], v[1], c)
}
