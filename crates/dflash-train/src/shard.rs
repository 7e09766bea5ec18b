//! Optimizer-state sharding over data-parallel ranks: each rank keeps the AdamW moments of the
//! parameters it owns and updates only those; after each update every owner sends its
//! parameters to the other ranks. The gradients are summed over the ranks as before, and AdamW
//! is element-wise, so each parameter gets the bits the one-rank run gives it (at f32 on CPU
//! ranks: the whole run equals it bit for bit, `tests/ranks.rs`).
//!
//! Ownership is by whole parameters, contiguous in the sorted parameter order, balanced by
//! values ([`owners`]). Example: sizes [6, 2, 2, 6] over 2 ranks (16 values, 8 per rank) →
//! owners [0, 0, 1, 1]: each rank keeps the moments of 8 values instead of 16.
//! Checkpoints are the unsharded format: the owners send their moments to rank 0 for writing,
//! one parameter at a time ([`gather_moments`]), and a resumed run (sharded or not, on any
//! number of ranks) takes its own part of them.

use anyhow::Result;
use candle_core::{Tensor, Var};

use crate::collective::Collective;
use crate::optim::{AdamW, Shards};

/// The owner rank of each parameter of `sizes` (values per parameter, in order): parameter `i`
/// goes to the rank whose equal share of all the values holds its middle value. Ranks may own
/// nothing (fewer parameters than ranks).
pub fn owners(sizes: &[usize], world: usize) -> Vec<usize> {
    let total: usize = sizes.iter().sum::<usize>().max(1);
    let mut before = 0usize;
    sizes
        .iter()
        .map(|&n| {
            let mid = before + n / 2;
            before += n;
            ((mid * world) / total).min(world.saturating_sub(1))
        })
        .collect()
}

/// The sharding of `params` over `comm`'s ranks, for [`AdamW::shard`].
pub fn plan(params: &[(String, Var)], comm: &dyn Collective) -> Shards {
    let sizes: Vec<usize> = params.iter().map(|(_, p)| p.elem_count()).collect();
    Shards {
        owners: owners(&sizes, comm.world()),
        rank: comm.rank(),
    }
}

/// After a sharded update: every rank's parameters as their owners updated them (one
/// broadcast per owner of its parameters, flattened and concatenated in order).
pub fn sync_weights(
    params: &[(String, Var)],
    shards: &Shards,
    comm: &dyn Collective,
) -> Result<()> {
    for root in 0..comm.world() {
        let mine: Vec<usize> = (0..params.len())
            .filter(|&i| shards.owners[i] == root)
            .collect();
        let Some(&first) = mine.first() else { continue };
        let p0 = params[first].1.as_tensor();
        let flat = match shards.rank == root {
            true => {
                let parts: Vec<Tensor> = mine
                    .iter()
                    .map(|&i| params[i].1.as_tensor().flatten_all())
                    .collect::<candle_core::Result<_>>()?;
                Tensor::cat(&parts, 0)?
            }
            false => {
                let n: usize = mine.iter().map(|&i| params[i].1.elem_count()).sum();
                Tensor::zeros(n, p0.dtype(), p0.device())?
            }
        };
        let got = comm.broadcast(&flat, root)?;
        if shards.rank == root {
            continue;
        }
        let mut at = 0;
        for &i in &mine {
            let p = &params[i].1;
            let n = p.elem_count();
            p.set(&got.narrow(0, at, n)?.reshape(p.shape())?)?;
            at += n;
        }
    }
    Ok(())
}

/// Every parameter's moments `(m, v)`, shaped as the parameters, on rank 0 (`None` on the
/// others), each sent by its owner: what a checkpoint writes. Every rank calls this.
pub fn gather_moments(
    params: &[(String, Var)],
    opt: &AdamW,
    comm: &dyn Collective,
) -> Result<Option<(Vec<Tensor>, Vec<Tensor>)>> {
    let Some(shards) = opt.shards() else {
        return Ok(match comm.rank() {
            0 => Some((opt.m(params)?, opt.v(params)?)),
            _ => None,
        });
    };
    let (mut m, mut v) = (Vec::new(), Vec::new());
    for (i, (_, p)) in params.iter().enumerate() {
        let owner = shards.owners[i];
        let st = match shards.rank == owner {
            true => opt.state_of(i).clone(),
            false => Tensor::zeros((2, p.elem_count()), p.dtype(), p.device())?,
        };
        // rank 0 holds its own; another owner sends to rank 0 (every rank takes part)
        let st = match owner {
            0 => st,
            _ => comm.broadcast(&st, owner)?,
        };
        if comm.rank() == 0 {
            // on the host at once: rank 0 never holds more than one parameter's moments
            // beyond its own
            let st = st.to_device(&candle_core::Device::Cpu)?;
            m.push(st.get(0)?.reshape(p.shape())?);
            v.push(st.get(1)?.reshape(p.shape())?);
        }
    }
    Ok((comm.rank() == 0).then_some((m, v)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::ThreadGroup;

    /// Contiguous, balanced by values, and every rank owns something when it can.
    #[test]
    fn owners_split_the_values_evenly_in_order() {
        assert_eq!(owners(&[6, 2, 2, 6], 2), vec![0, 0, 1, 1]);
        assert_eq!(owners(&[6, 2, 2, 6], 1), vec![0, 0, 0, 0]);
        assert_eq!(owners(&[10, 1, 1, 1, 1], 2), vec![0, 1, 1, 1, 1]);
        assert_eq!(owners(&[4; 8], 4), vec![0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(owners(&[5], 3), vec![1]);
        let o = owners(&[3; 16], 8);
        for r in 0..8 {
            assert_eq!(o.iter().filter(|&&x| x == r).count(), 2);
        }
        assert!(o.windows(2).all(|w| w[0] <= w[1]));
    }

    /// Each rank of a sharded optimizer keeps the moments of its own parameters (together each
    /// parameter's exactly once, none holding more than its share plus one parameter), and a
    /// sync gives every rank each owner's values.
    #[test]
    fn ranks_keep_their_share_and_sync_the_owners_values() {
        let dev = candle_core::Device::Cpu;
        let shapes: [&[usize]; 6] = [&[8, 4], &[4], &[16, 4], &[4], &[4, 12], &[30]];
        let params = |r: f32| -> Vec<(String, Var)> {
            shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let t = (Tensor::ones(*s, candle_core::DType::F32, &dev).unwrap()
                        * (10.0 * i as f64 + r as f64))
                        .unwrap();
                    (format!("p{i}"), Var::from_tensor(&t).unwrap())
                })
                .collect()
        };
        let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
        let group = ThreadGroup::new(3);
        let out: Vec<(usize, Vec<bool>, Vec<Vec<f32>>)> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let ps = params(g.rank() as f32);
                        let mut opt = AdamW::new(&ps, 0.9, 0.95, 1e-8, 0.0).unwrap();
                        let shards = plan(&ps, g);
                        opt.shard(shards.clone()).unwrap();
                        sync_weights(&ps, &shards, g).unwrap();
                        let owned = (0..ps.len()).map(|i| opt.owns(i)).collect();
                        let vals = ps
                            .iter()
                            .map(|(_, p)| p.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
                            .collect();
                        (opt.state_len(), owned, vals)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let held: usize = out.iter().map(|o| o.0).sum();
        assert_eq!(held, 2 * total);
        let biggest = 2 * 64;
        for (len, _, _) in &out {
            assert!(*len <= 2 * total / 3 + biggest, "{len} of {}", 2 * total);
        }
        let owners = owners(
            &shapes
                .iter()
                .map(|s| s.iter().product())
                .collect::<Vec<_>>(),
            3,
        );
        for (i, &owner) in owners.iter().enumerate() {
            assert_eq!(out.iter().filter(|o| o.1[i]).count(), 1, "parameter {i}");
            // every rank holds the owner's values of parameter i
            let want = 10.0 * i as f32 + owner as f32;
            for (r, o) in out.iter().enumerate() {
                assert!(o.2[i].iter().all(|&x| x == want), "rank {r}, parameter {i}");
            }
        }
    }
}
