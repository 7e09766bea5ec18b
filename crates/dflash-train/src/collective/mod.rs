//! Data-parallel ranks: the collective the trainer sums gradients through, and the summation
//! order that makes N ranks equal one rank.
//!
//! A step's rows are summed as a **halving tree** over their index ([`halving_sum`]): rows
//! `0..8` sum as `((g0+g1)+(g2+g3)) + ((g4+g5)+(g6+g7))`. Rank r of N takes the contiguous
//! slice `r·A/N .. (r+1)·A/N` of the step's A rows and sums it with the same tree; the ranks'
//! partial sums are then added with the halving tree over ranks. With 2 ranks and A = 8, rank 0
//! holds `(g0+g1)+(g2+g3)` and rank 1 `(g4+g5)+(g6+g7)` — the two halves of the one-rank tree —
//! so when N is a power of two dividing A, N ranks compute the one-rank sum bit for bit at f32.
//! (For other N the sums differ by rounding only.)
//!
//! [`Single`] is one rank; [`ThreadGroup`] is N ranks as threads of one process (the CPU ranks
//! CI runs); `nccl::NcclRank` (with the `cuda` feature) is one GPU process of N, found through
//! [`rendezvous`].

#[cfg(feature = "cuda")]
pub mod nccl;
pub mod rendezvous;

use std::sync::{Arc, Barrier, Mutex};

use anyhow::{bail, Result};
use candle_core::Tensor;

/// What the trainer needs from a group of ranks. Every rank calls the same methods in the
/// same order (a rank that skips one deadlocks the others, as with any collective).
pub trait Collective: Sync {
    /// This rank, `0..world()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world(&self) -> usize;
    /// The element-wise sum of every rank's `t` (same shape and dtype on every rank), taken
    /// as [`halving_sum`] over the ranks.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// [`Collective::all_reduce_sum`] started, its sum read by [`PendingSum::wait`]. On GPUs
    /// (NCCL) the sum runs on a stream of its own, beside whatever kernels are enqueued after
    /// this call (the trainer's backward of the layers below); by default it is taken at once.
    /// Every rank starts the same sums in the same order.
    fn start_all_reduce(&self, t: &Tensor) -> Result<PendingSum> {
        Ok(PendingSum::ready(self.all_reduce_sum(t)?))
    }
    /// Every rank's `v` (of the same length on every rank), concatenated in rank order.
    fn all_gather(&self, v: &[f64]) -> Result<Vec<f64>>;
    /// `root`'s `t`, on every rank (each passes a tensor of the same shape and dtype; only the
    /// root's values are read). By default the sum of the root's `t` and every other rank's
    /// zeros: the root's values (a zero's sign aside).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        match self.rank() == root {
            true => self.all_reduce_sum(t),
            false => self.all_reduce_sum(&t.zeros_like()?),
        }
    }
    /// Wait until every rank got here.
    fn barrier(&self) -> Result<()>;
    /// True for [`Single`] only: the trainer then skips the sums (one rank of NCCL still runs
    /// them, so that a world of one exercises NCCL).
    fn is_single(&self) -> bool {
        false
    }
}

/// A sum over the ranks under way ([`Collective::start_all_reduce`]). A device's sum dropped
/// unread still waits for its end (the buffers it reads and writes must outlive it).
pub struct PendingSum {
    finish: Option<Box<dyn FnOnce() -> Result<Tensor>>>,
    /// run `finish` when dropped unread
    on_drop: bool,
}

impl PendingSum {
    /// A sum already taken.
    pub fn ready(t: Tensor) -> Self {
        Self::when_read(move || Ok(t))
    }

    /// A sum that `finish` completes, also when the pending sum is dropped unread (a device's:
    /// `nccl::NcclRank`).
    pub fn deferred(finish: impl FnOnce() -> Result<Tensor> + 'static) -> Self {
        Self {
            finish: Some(Box::new(finish)),
            on_drop: true,
        }
    }

    /// A sum that `finish` completes only when it is read (a [`ThreadGroup`]'s: dropped by a
    /// failing rank, it must not wait for the others).
    pub fn when_read(finish: impl FnOnce() -> Result<Tensor> + 'static) -> Self {
        Self {
            finish: Some(Box::new(finish)),
            on_drop: false,
        }
    }

    /// The sum, once it is done.
    pub fn wait(mut self) -> Result<Tensor> {
        match self.finish.take() {
            Some(f) => f(),
            None => bail!("a pending sum was read twice"),
        }
    }
}

impl Drop for PendingSum {
    fn drop(&mut self) {
        if let Some(f) = self.finish.take().filter(|_| self.on_drop) {
            let _ = f();
        }
    }
}

/// One rank: every collective is the identity.
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_gather(&self, v: &[f64]) -> Result<Vec<f64>> {
        Ok(v.to_vec())
    }
    fn broadcast(&self, t: &Tensor, _root: usize) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn is_single(&self) -> bool {
        true
    }
}

/// What one exchange of a [`ThreadGroup`] holds: one slot per rank; the sums started and not
/// yet read, by their number in the order every rank starts them.
#[derive(Default)]
struct Slots {
    values: Vec<Vec<f64>>,
    /// The root's tensor of the last broadcast.
    sent: Option<Tensor>,
    sums: std::collections::HashMap<u64, Vec<Option<Tensor>>>,
}

/// N ranks as threads of one process, exchanging through shared slots: each rank deposits
/// its value, waits for all, computes the same reduction from all slots, and waits again
/// before the slots are reused. A sum is deposited when it starts and taken when it is read
/// ([`PendingSum::wait`]), as NCCL's run beside the backward: a rank may start its next
/// buckets before another rank has started the first.
pub struct ThreadGroup {
    rank: usize,
    world: usize,
    barrier: Arc<Barrier>,
    slots: Arc<Mutex<Slots>>,
    /// this rank's sums started so far
    started: std::sync::atomic::AtomicU64,
}

impl ThreadGroup {
    /// The `world` ranks of one group (hand one to each thread).
    pub fn new(world: usize) -> Vec<ThreadGroup> {
        let barrier = Arc::new(Barrier::new(world));
        let slots = Arc::new(Mutex::new(Slots {
            values: vec![Vec::new(); world],
            sent: None,
            sums: Default::default(),
        }));
        (0..world)
            .map(|rank| ThreadGroup {
                rank,
                world,
                barrier: barrier.clone(),
                slots: slots.clone(),
                started: Default::default(),
            })
            .collect()
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Slots>> {
        lock_slots(&self.slots, self.rank)
    }
}

fn lock_slots(slots: &Mutex<Slots>, rank: usize) -> Result<std::sync::MutexGuard<'_, Slots>> {
    slots
        .lock()
        .map_err(|_| anyhow::anyhow!("rank {rank}: another rank panicked"))
}

impl Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.start_all_reduce(t)?.wait()
    }
    fn start_all_reduce(&self, t: &Tensor) -> Result<PendingSum> {
        let n = self
            .started
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (rank, world) = (self.rank, self.world);
        self.lock()?
            .sums
            .entry(n)
            .or_insert_with(|| vec![None; world])[rank] = Some(t.clone());
        let (slots, barrier) = (self.slots.clone(), self.barrier.clone());
        Ok(PendingSum::when_read(move || {
            // every rank started sum n before reading it: after this barrier all are in
            barrier.wait();
            let all: Vec<Tensor> = lock_slots(&slots, rank)?
                .sums
                .get(&n)
                .map(|v| v.iter().flatten().cloned().collect())
                .unwrap_or_default();
            barrier.wait();
            if rank == 0 {
                lock_slots(&slots, rank)?.sums.remove(&n);
            }
            if all.len() != world {
                bail!("rank {rank}: a rank gave no tensor to sum {n}");
            }
            halving_sum(0, all.len(), &mut |i| Ok(all[i].clone()), &|a, b| {
                Ok((a + b)?)
            })
        }))
    }
    fn all_gather(&self, v: &[f64]) -> Result<Vec<f64>> {
        self.lock()?.values[self.rank] = v.to_vec();
        self.barrier.wait();
        let all = self.lock()?.values.concat();
        self.barrier.wait();
        Ok(all)
    }
    /// The root's tensor itself (not a sum with zeros): every rank gets its bits.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if self.rank == root {
            self.lock()?.sent = Some(t.copy()?);
        }
        self.barrier.wait();
        let got = self.lock()?.sent.clone();
        // every rank has read it before the next broadcast's root replaces it
        self.barrier.wait();
        got.ok_or_else(|| anyhow::anyhow!("rank {}: rank {root} sent nothing", self.rank))
    }
    fn barrier(&self) -> Result<()> {
        self.barrier.wait();
        Ok(())
    }
}

/// The sum of `leaf(lo) .. leaf(hi − 1)` as a halving tree: the range split at its middle
/// (`lo + (hi − lo + 1) / 2`), each half summed the same way, then the halves added. Leaves are
/// visited in order and at most one partial sum per level is alive, so rows can be computed
/// (and their backward run) inside `leaf`. For 0..5: `((l0+l1)+l2) + (l3+l4)`.
pub fn halving_sum<T>(
    lo: usize,
    hi: usize,
    leaf: &mut dyn FnMut(usize) -> Result<T>,
    add: &dyn Fn(T, T) -> Result<T>,
) -> Result<T> {
    match hi - lo {
        0 => bail!("halving_sum over an empty range"),
        1 => leaf(lo),
        n => {
            let mid = lo + n.div_ceil(2);
            let a = halving_sum(lo, mid, leaf, add)?;
            let b = halving_sum(mid, hi, leaf, add)?;
            add(a, b)
        }
    }
}

/// The slice of a step's `rows` that `rank` of `world` computes: contiguous, equal.
pub fn rank_slice(rows: usize, rank: usize, world: usize) -> Result<std::ops::Range<usize>> {
    if world == 0 || !rows.is_multiple_of(world) {
        bail!("grad_accum {rows} is not a multiple of the {world} ranks: every rank must take as many rows per step (choose grad_accum = k · ranks)");
    }
    let k = rows / world;
    Ok(rank * k..(rank + 1) * k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(lo: usize, hi: usize) -> String {
        halving_sum(lo, hi, &mut |i| Ok(format!("{i}")), &|a, b| {
            Ok(format!("({a}+{b})"))
        })
        .unwrap()
    }

    /// Two and four ranks' halving trees are the halves and quarters of the one-rank tree.
    #[test]
    fn rank_slices_are_subtrees_of_the_one_rank_tree() {
        assert_eq!(tree(0, 5), "(((0+1)+2)+(3+4))");
        for (world, rows) in [(2, 8), (4, 8), (2, 6), (4, 12), (8, 8)] {
            let parts: Vec<String> = (0..world)
                .map(|r| {
                    let s = rank_slice(rows, r, world).unwrap();
                    tree(s.start, s.end)
                })
                .collect();
            let over_ranks = halving_sum(0, world, &mut |r| Ok(parts[r].clone()), &|a, b| {
                Ok(format!("({a}+{b})"))
            })
            .unwrap();
            assert_eq!(over_ranks, tree(0, rows), "{world} ranks, {rows} rows");
        }
        // three ranks do not split the tree: the sums then differ by rounding only
        let parts: Vec<String> = (0..3).map(|r| tree(2 * r, 2 * r + 2)).collect();
        let over = halving_sum(0, 3, &mut |r| Ok(parts[r].clone()), &|a, b| {
            Ok(format!("({a}+{b})"))
        })
        .unwrap();
        assert_ne!(over, tree(0, 6));
    }

    #[test]
    fn uneven_slices_are_refused_by_name() {
        let e = rank_slice(6, 0, 4).unwrap_err().to_string();
        assert!(e.contains("grad_accum 6") && e.contains("4 ranks"), "{e}");
    }

    /// Sums started one after another are read later, in the same order: a rank starts its
    /// second sum before the slowest rank has started the first.
    #[test]
    fn thread_ranks_read_started_sums_later() {
        let group = ThreadGroup::new(3);
        let out: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let r = g.rank() as f32;
                        if g.rank() == 2 {
                            std::thread::sleep(std::time::Duration::from_millis(50));
                        }
                        let dev = &candle_core::Device::Cpu;
                        let a = g
                            .start_all_reduce(&Tensor::new(&[r], dev).unwrap())
                            .unwrap();
                        let b = g
                            .start_all_reduce(&Tensor::new(&[r, 100.0 * r], dev).unwrap())
                            .unwrap();
                        let a = a.wait().unwrap().to_vec1::<f32>().unwrap();
                        let b = b.wait().unwrap().to_vec1::<f32>().unwrap();
                        (a, b)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (a, b) in out {
            assert_eq!((a, b), (vec![3.0], vec![3.0, 300.0]));
        }
        assert!(
            group[0].lock().unwrap().sums.is_empty(),
            "sums read are dropped"
        );
    }

    /// A broadcast gives every rank the root's bits (a negative zero too), and the default
    /// (a sum with the others' zeros) the root's values.
    #[test]
    fn thread_ranks_broadcast_the_roots_tensor() {
        struct BySum<'a>(&'a ThreadGroup);
        impl Collective for BySum<'_> {
            fn rank(&self) -> usize {
                self.0.rank()
            }
            fn world(&self) -> usize {
                self.0.world()
            }
            fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
                self.0.all_reduce_sum(t)
            }
            fn all_gather(&self, v: &[f64]) -> Result<Vec<f64>> {
                self.0.all_gather(v)
            }
            fn barrier(&self) -> Result<()> {
                self.0.barrier()
            }
        }
        let group = ThreadGroup::new(3);
        let out: Vec<(Vec<u32>, Vec<f32>)> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let r = g.rank() as f32;
                        let t = Tensor::new(&[r + 0.5, -0.0, 7.0 * r], &candle_core::Device::Cpu)
                            .unwrap();
                        let exact = g.broadcast(&t, 1).unwrap().to_vec1::<f32>().unwrap();
                        let by_sum = BySum(g).broadcast(&t, 2).unwrap();
                        (
                            exact.iter().map(|x| x.to_bits()).collect(),
                            by_sum.to_vec1::<f32>().unwrap(),
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let root: Vec<u32> = [1.5f32, -0.0, 7.0].iter().map(|x| x.to_bits()).collect();
        for (exact, by_sum) in out {
            assert_eq!(exact, root);
            assert_eq!(by_sum, vec![2.5, 0.0, 14.0]);
        }
    }

    #[test]
    fn thread_ranks_sum_and_gather_in_rank_order() {
        let group = ThreadGroup::new(3);
        let out: Vec<(Vec<f32>, Vec<f64>)> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let r = g.rank() as f32;
                        let t = Tensor::new(&[r, 10.0 * r], &candle_core::Device::Cpu).unwrap();
                        let sum = g.all_reduce_sum(&t).unwrap().to_vec1::<f32>().unwrap();
                        let all = g.all_gather(&[g.rank() as f64; 2]).unwrap();
                        (sum, all)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sum, all) in out {
            assert_eq!(sum, vec![3.0, 30.0]);
            assert_eq!(all, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
        }
    }
}
