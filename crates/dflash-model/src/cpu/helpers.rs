//! Helper threads for the CPU kernels ([`crate::cpu::panels`], the AVX2 path of [`crate::layers::linear`]):
//! the calling thread splits a product into chunks and helpers that are awake take some.
//!
//! Why not rayon or candle's pool: a decoding step on a small model runs hundreds of short
//! products, and rayon's workers fall asleep between them (a wake-up costs about as much as a
//! product). candle's barrier pool spins, but every operation waits for every worker to check
//! in: with two processes on two cores a worker that is not scheduled stalls each operation for
//! a time slice.
//! Here the caller never waits for a helper that has not started: it takes chunks itself, and
//! waits only for helpers inside the job (each finishing at most the chunk it holds).
//!
//! Protocol: the caller publishes the job (a pointer to its closure) under a new generation and
//! wakes parked helpers; a helper that sees the generation announces itself (`entered + 1`),
//! re-checks that the job is still live, then takes chunks from the shared counter until none
//! is left. The caller takes chunks too, retires the job, and waits until `entered` is 0. A
//! helper that announces itself after the retirement sees it and leaves without touching the
//! job (sequentially consistent `entered` / `live` accesses: either the helper sees the
//! retirement or the caller sees the helper).
//!
//! Example: 96 panels of an `up_proj` in chunks of 2 on 2 cores: the caller starts at chunk 0,
//! the helper (spinning since the previous product) joins within a microsecond and the two
//! take about 24 chunks each; if the helper is not scheduled the caller takes all 48.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long an idle helper spins before it parks: longer than the gap between a decoding
/// step's products, so helpers stay awake through a step (a parked helper costs a wake-up).
const SPIN: Duration = Duration::from_micros(200);

type Job<'a> = &'a (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped per job; helpers wait for a change.
    generation: AtomicUsize,
    /// The generation whose job may still be entered (0: none).
    live: AtomicUsize,
    /// The job: a `*const Job` on the caller's stack, valid while `live` is its generation.
    job: AtomicPtr<()>,
    next: AtomicUsize,
    chunks: AtomicUsize,
    entered: AtomicUsize,
    /// A chunk panicked on a helper (the caller re-raises it).
    helper_panicked: AtomicBool,
    helpers: OnceLock<Vec<Thread>>,
    /// One job at a time (a product inside a product runs inline instead).
    lock: Mutex<()>,
}

fn shared() -> &'static Shared {
    static S: OnceLock<&'static Shared> = OnceLock::new();
    S.get_or_init(|| {
        let s: &'static Shared = Box::leak(Box::new(Shared {
            generation: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            next: AtomicUsize::new(0),
            chunks: AtomicUsize::new(0),
            entered: AtomicUsize::new(0),
            helper_panicked: AtomicBool::new(false),
            helpers: OnceLock::new(),
            lock: Mutex::new(()),
        }));
        // as many threads in all as rayon would use (RAYON_NUM_THREADS, else the cores)
        let n = rayon::current_num_threads().saturating_sub(1);
        let threads = (0..n)
            .filter_map(|i| {
                std::thread::Builder::new()
                    .name(format!("dflash-helper-{i}"))
                    .spawn(move || helper(s))
                    .ok()
                    .map(|h| h.thread().clone())
            })
            .collect();
        let _ = s.helpers.set(threads);
        s
    })
}

fn helper(s: &'static Shared) {
    let mut seen = s.generation.load(SeqCst);
    loop {
        let t0 = Instant::now();
        let mut spins = 0u32;
        let g = loop {
            let g = s.generation.load(SeqCst);
            if g != seen {
                break g;
            }
            spins += 1;
            if spins.is_multiple_of(64) && t0.elapsed() > SPIN {
                std::thread::park_timeout(Duration::from_millis(50));
            } else {
                std::hint::spin_loop();
            }
        };
        seen = g;
        s.entered.fetch_add(1, SeqCst);
        if s.live.load(SeqCst) == g {
            // SAFETY: the job is live, and its caller waits for `entered` to reach 0 after
            // retiring it, so the closure outlives this use
            let job = unsafe { *(s.job.load(SeqCst) as *const Job) };
            // a panicking chunk must not kill the helper before it leaves the job (the caller
            // would wait for it forever): caught here, re-raised by the caller
            let run = std::panic::AssertUnwindSafe(|| take_chunks(s, job));
            if std::panic::catch_unwind(run).is_err() {
                s.helper_panicked.store(true, SeqCst);
            }
        }
        s.entered.fetch_sub(1, SeqCst);
    }
}

fn take_chunks(s: &Shared, job: Job) {
    let chunks = s.chunks.load(SeqCst);
    loop {
        let c = s.next.fetch_add(1, SeqCst);
        if c >= chunks {
            break;
        }
        job(c);
    }
}

/// `f(c)` for every chunk `c` in `0..chunks`, on the calling thread and the helpers that are
/// awake; returns when all are done. Runs inline when another job is running (a nested call)
/// or there are no helpers.
pub fn for_each_chunk(chunks: usize, f: &(dyn Fn(usize) + Sync)) {
    let s = shared();
    let guard = match s.lock.try_lock() {
        Ok(g) => Some(g),
        // a chunk panicked under the lock earlier; the shared state is reset per job
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    };
    let helpers = s.helpers.get().is_some_and(|h| !h.is_empty());
    let Some(guard) = guard.filter(|_| chunks > 1 && helpers) else {
        (0..chunks).for_each(f);
        return;
    };
    let job: Job = f;
    // (a job that ended in a panic on this thread may have left the flag set)
    s.helper_panicked.store(false, SeqCst);
    s.next.store(0, SeqCst);
    s.chunks.store(chunks, SeqCst);
    s.job.store(&job as *const Job as *mut (), SeqCst);
    let g = s.generation.load(SeqCst).wrapping_add(1).max(1);
    s.live.store(g, SeqCst);
    s.generation.store(g, SeqCst);
    for t in s.helpers.get().into_iter().flatten() {
        t.unpark();
    }
    // retires the job and waits for the helpers inside it (each finishes the chunk it holds)
    // when this frame ends, also by a panic of a chunk on this thread: `f` must outlive them
    struct Retire(&'static Shared);
    impl Drop for Retire {
        fn drop(&mut self) {
            self.0.live.store(0, SeqCst);
            while self.0.entered.load(SeqCst) != 0 {
                std::hint::spin_loop();
            }
        }
    }
    let retire = Retire(s);
    take_chunks(s, job);
    drop(retire);
    let helper_panicked = s.helper_panicked.swap(false, SeqCst);
    drop(guard);
    if helper_panicked {
        panic!("a chunk of a CPU kernel panicked on a helper thread");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_runs_once_over_many_jobs() {
        for chunks in [0usize, 1, 2, 7, 100] {
            for _ in 0..200 {
                let hits: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
                for_each_chunk(chunks, &|c| {
                    hits[c].fetch_add(1, SeqCst);
                });
                assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "{chunks} chunks");
            }
        }
    }

    /// A chunk that panics on a helper or on the caller: the call panics (no hang), and the
    /// next job runs normally.
    #[test]
    fn a_panicking_chunk_panics_the_call_and_leaves_the_helpers_working() {
        for _ in 0..20 {
            let r = std::panic::catch_unwind(|| {
                for_each_chunk(64, &|c| {
                    if c % 7 == 3 {
                        panic!("chunk {c}");
                    }
                    std::hint::black_box(c);
                })
            });
            assert!(r.is_err());
        }
        let total = AtomicUsize::new(0);
        for_each_chunk(50, &|c| {
            total.fetch_add(c, SeqCst);
        });
        assert_eq!(total.load(SeqCst), 50 * 49 / 2);
    }

    #[test]
    fn a_nested_call_runs_inline() {
        let total = AtomicUsize::new(0);
        for_each_chunk(4, &|_| {
            for_each_chunk(3, &|_| {
                total.fetch_add(1, SeqCst);
            });
        });
        assert_eq!(total.load(SeqCst), 12);
    }
}
