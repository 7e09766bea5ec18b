//! Fuzzing on stable Rust: seeded, structure-aware mutations of a real input, each case run
//! under `catch_unwind` and held to three rules — it ends in `Ok` or an error (no panic), within
//! 5 s, and allocates no single block larger than 64× its input (16 MiB floor: an error's
//! backtrace takes a few MB whatever the input). A test binary that fuzzes declares the
//! counting allocator: `#[global_allocator] static A: Counting = Counting;`.
//!
//! Example: `fuzz("tiny llama", &seed, 5_000, 1, |b, rng| mutate_bytes(b, &fields, rng), |b|
//! read(b))` → `Counts { cases: 5000, ok: …, errors: …, panics: 0, … }`, or a panic naming the
//! first case that broke a rule and its rng seed.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The largest single allocation since the last reset (the test binary's [`Counting`]).
pub static LARGEST: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, recording the largest block asked for.
pub struct Counting;

// SAFETY: forwards to the system allocator, only recording sizes
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LARGEST.fetch_max(new, Ordering::Relaxed);
        System.realloc(p, l, new)
    }
}

/// One fuzz run at a time in a test binary: the allocation record is process-wide.
pub static ONE: Mutex<()> = Mutex::new(());

/// The message of the last panic, recorded while [`Quiet`] holds the hook.
static LAST_PANIC: Mutex<String> = Mutex::new(String::new());

type Hook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send>;

/// Panics are recorded rather than printed while it lives; the hook before it is restored on
/// drop.
struct Quiet(Option<Hook>);

impl Quiet {
    fn new() -> Quiet {
        let old = std::panic::take_hook();
        std::panic::set_hook(Box::new(|info| {
            *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) = info.to_string();
        }));
        Quiet(Some(old))
    }
}

impl Drop for Quiet {
    fn drop(&mut self) {
        // the hook cannot change while this thread panics (the test fails anyway)
        if let Some(h) = self.0.take().filter(|_| !std::thread::panicking()) {
            std::panic::set_hook(h);
        }
    }
}

#[derive(Debug, Default, serde::Serialize)]
pub struct Counts {
    pub cases: usize,
    pub ok: usize,
    pub errors: usize,
    /// Always 0 in a finished run: the first panic ends it with the case that caused it.
    pub panics: usize,
    pub slowest_ms: f64,
    pub largest_alloc_over_input: f64,
}

/// `cases` cases: the seed itself, then `mutate(seed, rng)`'s, each given to `run`; the first
/// case that panics, runs 5 s or allocates past its bound fails the test, naming the case.
pub fn fuzz(
    name: &str,
    seed: &[u8],
    cases: usize,
    rng_seed: u64,
    mut mutate: impl FnMut(&[u8], &mut ChaCha8Rng) -> Vec<u8>,
    run: impl Fn(&[u8]) -> anyhow::Result<()>,
) -> Counts {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = ChaCha8Rng::seed_from_u64(rng_seed);
    let mut c = Counts::default();
    let quiet = Quiet::new();
    let mut failure = None;
    for case in 0..cases {
        let bytes = match case {
            0 => seed.to_vec(),
            _ => mutate(seed, &mut rng),
        };
        LARGEST.store(0, Ordering::Relaxed);
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&bytes)));
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let largest = LARGEST.load(Ordering::Relaxed);
        let ratio = largest as f64 / bytes.len().max(1) as f64;
        c.slowest_ms = c.slowest_ms.max(ms);
        c.largest_alloc_over_input = c.largest_alloc_over_input.max(ratio);
        c.cases += 1;
        let at = format!(
            "{name}: case {case} (rng seed {rng_seed}, {} bytes)",
            bytes.len()
        );
        match r {
            Ok(Ok(())) => c.ok += 1,
            Ok(Err(_)) => c.errors += 1,
            Err(_) => {
                let msg = LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()).clone();
                failure = Some(format!("{at} panicked: {msg}"));
                break;
            }
        }
        if ms > 5_000.0 {
            failure = Some(format!("{at} took {ms:.0} ms"));
            break;
        }
        // a dequantized f32 copy is 8x a 4-bit block's bytes, plus the model's own buffers
        if ratio > 64.0 && largest > 16 << 20 {
            failure = Some(format!(
                "{at} allocated {largest} bytes at once ({ratio:.1}x)"
            ));
            break;
        }
    }
    drop(quiet);
    if let Some(f) = failure {
        panic!("{f}");
    }
    c
}

/// Offsets of the 8-byte little-endian fields worth breaking in a binary format: lengths,
/// counts, dimensions and offsets look like small numbers followed by zero bytes.
pub fn small_u64s(b: &[u8]) -> Vec<usize> {
    (0..b.len().saturating_sub(8))
        .filter(|&i| {
            let v = u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
            (1..1 << 24).contains(&v)
        })
        .collect()
}

/// One to three byte-level mutations of `seed`: a bit flip, one of `fields` set to a huge /
/// zero / off-by-one value, a u32 type code changed, a truncation, a splice of another part,
/// NaN/Inf over a float, or inserted bytes.
pub fn mutate_bytes(seed: &[u8], fields: &[usize], rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..rng.random_range(1..=3) {
        if b.len() < 16 {
            break;
        }
        let at = |rng: &mut ChaCha8Rng, b: &[u8]| rng.random_range(0..b.len() - 8);
        match rng.random_range(0..8) {
            0 => {
                let i = rng.random_range(0..b.len());
                b[i] ^= 1 << rng.random_range(0..8);
            }
            1 | 2 if !fields.is_empty() => {
                let i = fields[rng.random_range(0..fields.len())];
                if i + 8 > b.len() {
                    continue; // cut off by an earlier mutation of this case
                }
                let old = u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
                let v = [
                    u64::MAX,
                    1 << 40,
                    1 << 62,
                    0,
                    old.wrapping_add(1),
                    old.wrapping_sub(1),
                    old.wrapping_mul(1000),
                ][rng.random_range(0..7)];
                b[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            3 => {
                let i = at(rng, &b);
                let code: u32 = rng.random_range(0..40);
                b[i..i + 4].copy_from_slice(&code.to_le_bytes());
            }
            4 => {
                let n = rng.random_range(0..b.len());
                b.truncate(n);
            }
            5 => {
                let (from, to) = (at(rng, &b), at(rng, &b));
                let n = rng.random_range(1..=64).min(b.len() - from.max(to));
                let chunk = b[from..from + n].to_vec();
                b[to..to + n].copy_from_slice(&chunk);
            }
            6 => {
                let i = at(rng, &b);
                let v = [f32::NAN, f32::INFINITY, -0.0, f32::MAX][rng.random_range(0..4)];
                b[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                let i = at(rng, &b);
                let junk: Vec<u8> = (0..rng.random_range(1..16)).map(|_| rng.random()).collect();
                let tail = b.split_off(i);
                b.extend(junk);
                b.extend(tail);
            }
        }
    }
    b
}

/// One mutation of a JSON text: a number set to 0, −1, a huge or a fractional value; a value
/// replaced by null, a string, an empty array or a deep nest; a key removed; the text cut, or
/// a byte of it made invalid UTF-8. Example: `{"a": 3}` → `{"a": 1099511627776}`.
pub fn mutate_json(seed: &[u8], rng: &mut ChaCha8Rng) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(seed) else {
        return mutate_bytes(seed, &[], rng);
    };
    match rng.random_range(0..10) {
        0 => {
            let mut b = seed.to_vec();
            b.truncate(rng.random_range(0..seed.len().max(1)));
            return b;
        }
        1 => {
            let mut b = seed.to_vec();
            let i = rng.random_range(0..b.len().max(1));
            if let Some(x) = b.get_mut(i) {
                *x = 0xff;
            }
            return b;
        }
        _ => {}
    }
    let mut leaves = Vec::new();
    paths(&v, &mut Vec::new(), &mut leaves);
    if leaves.is_empty() {
        return mutate_bytes(seed, &[], rng);
    }
    let path = leaves[rng.random_range(0..leaves.len())].clone();
    let new = match rng.random_range(0..9) {
        0 => serde_json::json!(0),
        1 => serde_json::json!(-1),
        2 => serde_json::json!(1u64 << 40),
        3 => serde_json::json!(u64::MAX),
        4 => serde_json::json!(2.5),
        5 => serde_json::Value::Null,
        6 => serde_json::json!("x"),
        7 => serde_json::json!([]),
        _ => {
            let deep = "[".repeat(200) + &"]".repeat(200);
            serde_json::from_str(&deep).unwrap_or(serde_json::Value::Null)
        }
    };
    set(&mut v, &path, new, rng.random_range(0..4) == 0);
    serde_json::to_vec(&v).unwrap_or_default()
}

/// A step into a JSON value: an object's key or an array's index.
#[derive(Clone)]
enum Step {
    Key(String),
    Index(usize),
}

/// Every path to a value inside `v` (objects' and arrays' members, at every depth).
fn paths(v: &serde_json::Value, at: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                at.push(Step::Key(k.clone()));
                out.push(at.clone());
                paths(x, at, out);
                at.pop();
            }
        }
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                at.push(Step::Index(i));
                out.push(at.clone());
                paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// Set the value at `path` to `new`, or (`remove`) take an object's key out.
fn set(v: &mut serde_json::Value, path: &[Step], new: serde_json::Value, remove: bool) {
    let Some((last, head)) = path.split_last() else {
        return;
    };
    let mut cur = v;
    for s in head {
        cur = match (s, cur) {
            (Step::Key(k), serde_json::Value::Object(m)) => m.get_mut(k).unwrap(),
            (Step::Index(i), serde_json::Value::Array(a)) => &mut a[*i],
            _ => return,
        };
    }
    match (last, cur) {
        (Step::Key(k), serde_json::Value::Object(m)) if remove => {
            m.remove(k);
        }
        (Step::Key(k), serde_json::Value::Object(m)) => {
            m.insert(k.clone(), new);
        }
        (Step::Index(i), serde_json::Value::Array(a)) => a[*i] = new,
        _ => {}
    }
}

/// One mutation of a safetensors file: its JSON header by [`mutate_json`] (the length prefix
/// kept consistent, so the parser reads the mutated shapes, dtypes and offsets), or one in
/// three times its bytes by [`mutate_bytes`] at `fields`.
pub fn mutate_safetensors(st: &[u8], fields: &[usize], rng: &mut ChaCha8Rng) -> Vec<u8> {
    let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    if rng.random_range(0..3) == 0 || n + 8 > st.len() {
        return mutate_bytes(st, fields, rng);
    }
    let header = mutate_json(&st[8..8 + n], rng);
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&st[8 + n..]);
    out
}

/// One mutation of a JSONL text: one of its lines by [`mutate_json`], or one in four times the
/// whole text by [`mutate_bytes`].
pub fn mutate_jsonl(seed: &[u8], rng: &mut ChaCha8Rng) -> Vec<u8> {
    let lines: Vec<&[u8]> = seed
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    if lines.is_empty() || rng.random_range(0..4) == 0 {
        return mutate_bytes(seed, &small_u64s(seed), rng);
    }
    let k = rng.random_range(0..lines.len());
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        match i == k {
            true => out.extend(mutate_json(l, rng)),
            false => out.extend_from_slice(l),
        }
        out.push(b'\n');
    }
    out
}
