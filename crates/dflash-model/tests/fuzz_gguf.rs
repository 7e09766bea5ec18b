//! The GGUF reader under structure-aware mutations: every case ends in `Ok` or a clear error —
//! no panic, no hang, no allocation larger than the input justifies. Seeds: a small complete
//! llama GGUF written here (its metadata and tensors all reachable, so mutations get past the
//! header into the tensors and the model built from them) and the real SmolLM2-135M GGUF's
//! header with its first tensors. A fast seeded run is part of the test command; the long run
//! is `cargo test --release -p dflash-model --test fuzz_gguf -- --ignored fuzz_gguf_long` (each
//! seed's counts go to docs/bench/fuzz-gguf-*.json).

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Cursor;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use dflash_model::io::gguf;
use dflash_model::Target;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The largest single allocation since the last reset (this test binary's allocator).
static LARGEST: AtomicUsize = AtomicUsize::new(0);

struct Counting;

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

#[global_allocator]
static ALLOC: Counting = Counting;

/// One test at a time in this binary: the allocation record is process-wide.
static ONE: Mutex<()> = Mutex::new(());

/// A llama GGUF of one layer, width 64, 2 heads (1 K/V head), vocabulary 32: Q8_0 and Q4_1
/// projections, f32 norms, a tokenizer's tokens.
fn tiny_llama() -> Vec<u8> {
    tiny_llama_with(vec![])
}

/// [`tiny_llama`] with more metadata entries.
fn tiny_llama_with(extra: Vec<(&str, Value)>) -> Vec<u8> {
    let (h, v, ff, kv) = (64usize, 32usize, 64usize, 32usize);
    let q = |rows: usize, cols: usize, dt: GgmlDType, seed: f64| {
        let t = Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu)
            .unwrap()
            .affine(1e-3 * seed, -0.5)
            .unwrap()
            .reshape((rows, cols))
            .unwrap();
        QTensor::quantize(&t, dt).unwrap()
    };
    let norm = || {
        QTensor::quantize(
            &Tensor::ones(h, DType::F32, &Device::Cpu).unwrap(),
            GgmlDType::F32,
        )
        .unwrap()
    };
    let tensors = vec![
        ("token_embd.weight", q(v, h, GgmlDType::Q8_0, 1.0)),
        ("blk.0.attn_q.weight", q(h, h, GgmlDType::Q8_0, 2.0)),
        ("blk.0.attn_k.weight", q(kv, h, GgmlDType::Q8_0, 3.0)),
        ("blk.0.attn_v.weight", q(kv, h, GgmlDType::Q4_1, 4.0)),
        ("blk.0.attn_output.weight", q(h, h, GgmlDType::Q4_1, 5.0)),
        ("blk.0.ffn_gate.weight", q(ff, h, GgmlDType::Q4_1, 6.0)),
        ("blk.0.ffn_up.weight", q(ff, h, GgmlDType::Q8_0, 7.0)),
        ("blk.0.ffn_down.weight", q(h, ff, GgmlDType::Q8_0, 8.0)),
        ("blk.0.attn_norm.weight", norm()),
        ("blk.0.ffn_norm.weight", norm()),
        ("output_norm.weight", norm()),
    ];
    let tokens = Value::Array((0..v).map(|i| Value::String(format!("t{i}"))).collect());
    let metadata = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.embedding_length", Value::U32(h as u32)),
        ("llama.block_count", Value::U32(1)),
        ("llama.attention.head_count", Value::U32(2)),
        ("llama.attention.head_count_kv", Value::U32(1)),
        ("llama.feed_forward_length", Value::U32(ff as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", Value::U32(128)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.eos_token_id", Value::U32(1)),
    ];
    let metadata: Vec<(&str, Value)> = metadata.into_iter().chain(extra).collect();
    let mut out = Cursor::new(Vec::new());
    let m: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let t: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut out, &m, &t).unwrap();
    out.into_inner()
}

/// SmolLM2-135M's GGUF up to its first tensors' data (the header: 30 layers' tensor list, the
/// whole tokenizer), as the project fetches it.
fn smollm2_head() -> Vec<u8> {
    let path = dflash_testkit::smollm2_gguf();
    let mut f = std::fs::File::open(&path).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let end = c.tensor_data_offset as usize + (1 << 16);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.truncate(end);
    bytes
}

/// Offsets of the 8-byte little-endian fields worth breaking: lengths, counts, dimensions and
/// offsets look like small numbers followed by zero bytes.
fn small_u64s(b: &[u8]) -> Vec<usize> {
    (0..b.len().saturating_sub(8))
        .filter(|&i| {
            let v = u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
            (1..1 << 24).contains(&v)
        })
        .collect()
}

/// One mutation of `seed`: a bit flip, a field set to a huge / zero / off-by-one value, a type
/// code changed, a truncation, a splice of another part, NaN/Inf over a float, or several.
fn mutate(seed: &[u8], fields: &[usize], rng: &mut ChaCha8Rng) -> Vec<u8> {
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
            1 | 2 => {
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

#[derive(Debug, Default, serde::Serialize)]
struct Counts {
    cases: usize,
    ok: usize,
    errors: usize,
    /// Always 0 in a finished run: the first panic ends it with the case that caused it.
    panics: usize,
    slowest_ms: f64,
    largest_alloc_over_input: f64,
}

/// The message of the last panic, recorded while [`Quiet`] holds the hook.
static LAST_PANIC: Mutex<String> = Mutex::new(String::new());

/// Panics are recorded rather than printed while it lives; the hook before it is restored on
/// drop.
struct Quiet(Option<Hook>);

type Hook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send>;

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

/// `cases` mutations of `seed` through the reader and the model built from it; the first
/// case that panics, runs 5 s or allocates past its bound fails the test, naming the case.
fn fuzz(name: &str, seed: &[u8], cases: usize, rng_seed: u64) -> Counts {
    let fields = small_u64s(seed);
    let mut rng = ChaCha8Rng::seed_from_u64(rng_seed);
    let mut c = Counts::default();
    let path = Path::new("fuzz.gguf");
    let quiet = Quiet::new();
    let mut failure = None;
    for case in 0..cases {
        let bytes = if case == 0 {
            seed.to_vec()
        } else {
            mutate(seed, &fields, &mut rng)
        };
        LARGEST.store(0, Ordering::Relaxed);
        let t = Instant::now();
        let r = std::panic::catch_unwind(|| {
            let g = gguf::load_from(&mut Cursor::new(&bytes), path, DType::F32, &Device::Cpu)?;
            Target::load(g.config, &g.store).map(drop)
        });
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
        // a dequantized f32 copy is 8x a 4-bit block's bytes, plus the model's own buffers; an
        // error's backtrace (under RUST_BACKTRACE) takes a few MB whatever the input
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

/// Cases the fuzzing found or that a parser is known to trip on, each refused by name.
#[test]
fn damaged_headers_are_refused_by_name() {
    let load = |b: &[u8]| {
        gguf::load_from(
            &mut Cursor::new(b),
            Path::new("x.gguf"),
            DType::F32,
            &Device::Cpu,
        )
        .map(drop)
        .unwrap_err()
        .to_string()
    };
    // candle's parser divides by the declared alignment
    let e = load(&tiny_llama_with(vec![("general.alignment", Value::U32(0))]));
    assert!(e.contains("x.gguf is not a readable GGUF file"), "{e}");
    // a block count far beyond the tensors present must not size anything
    let e = load(&tiny_llama_with(vec![(
        "llama.block_count",
        Value::U32(1 << 24),
    )]))
    .to_string();
    assert!(e.contains("num_hidden_layers 16777216"), "{e}");
}

#[test]
fn fuzz_gguf_seeded() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let tiny = tiny_llama();
    let c = fuzz("tiny llama", &tiny, 5_000, 1);
    eprintln!("tiny llama: {c:?}");
    assert!(c.ok > 0, "the seed itself must load: {c:?}");
    assert!(c.errors > 0, "the mutations must reach the errors: {c:?}");
    let head = smollm2_head();
    let c = fuzz("SmolLM2 header", &head, 1_000, 2);
    eprintln!("SmolLM2 header: {c:?}");
    assert_eq!(c.panics, 0);
}

/// The long run of one seed: 100,000 cases, one JSON object printed (docs/bench/fuzz-gguf-*).
fn long_run(name: &str, seed: &[u8]) {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let c = fuzz(name, seed, 100_000, 7);
    println!(
        "{}",
        serde_json::json!({"reader": "gguf", "seed": name, "counts": c})
    );
}

#[test]
#[ignore]
fn fuzz_gguf_long_tiny_llama() {
    long_run("tiny llama", &tiny_llama());
}

#[test]
#[ignore]
fn fuzz_gguf_long_smollm2_header() {
    long_run("SmolLM2 header", &smollm2_head());
}
