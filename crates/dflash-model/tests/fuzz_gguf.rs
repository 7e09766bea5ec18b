//! The GGUF reader under structure-aware mutations: every case ends in `Ok` or a clear error —
//! no panic, no hang, no allocation larger than the input justifies. Seeds: a small complete
//! llama GGUF written here (its metadata and tensors all reachable, so mutations get past the
//! header into the tensors and the model built from them) and the real SmolLM2-135M GGUF's
//! header with its first tensors. A fast seeded run is part of the test command; the long run
//! is `cargo test --release -p dflash-model --test fuzz_gguf -- --ignored fuzz_gguf_long` (each
//! seed's counts go to docs/bench/fuzz-gguf-*.json).

use std::io::Cursor;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use dflash_model::io::gguf;
use dflash_model::Target;
use dflash_testkit::fuzz::{fuzz, mutate_bytes, small_u64s, Counting};

#[global_allocator]
static ALLOC: Counting = Counting;

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

/// `cases` mutations of a GGUF through the reader and the model built from it.
fn fuzz_gguf(name: &str, seed: &[u8], cases: usize, rng_seed: u64) -> dflash_testkit::fuzz::Counts {
    let fields = small_u64s(seed);
    fuzz(
        name,
        seed,
        cases,
        rng_seed,
        |b, rng| mutate_bytes(b, &fields, rng),
        |bytes| {
            let path = Path::new("fuzz.gguf");
            let g = gguf::load_from(&mut Cursor::new(bytes), path, DType::F32, &Device::Cpu)?;
            Target::load(g.config, &g.store).map(drop)
        },
    )
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
    let tiny = tiny_llama();
    let c = fuzz_gguf("tiny llama", &tiny, 5_000, 1);
    eprintln!("tiny llama: {c:?}");
    assert!(c.ok > 0, "the seed itself must load: {c:?}");
    assert!(c.errors > 0, "the mutations must reach the errors: {c:?}");
    let head = smollm2_head();
    let c = fuzz_gguf("SmolLM2 header", &head, 1_000, 2);
    eprintln!("SmolLM2 header: {c:?}");
    assert_eq!(c.panics, 0);
}

/// The long run of one seed: 100,000 cases, one JSON object printed (docs/bench/fuzz-gguf-*).
fn long_run(name: &str, seed: &[u8]) {
    let c = fuzz_gguf(name, seed, 100_000, 7);
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
