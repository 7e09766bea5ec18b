//! GGUF weights streamed from their blocks on the CPU give what the f32 path gives, bit for
//! bit: logits and taps of a prefill, of AR steps and of a 16-row verify of SmolLM2-135M Q4_1
//! (Q4_1 projections, a tied Q8_0 LM head) and Qwen2.5-Coder-0.5B Q4_K_M (Q5_0, Q8_0, Q4_K and
//! Q6_K projections, a Q8_0 LM head), on every ISA the CPU runs (AVX-512, AVX2).
//! `DFLASH_CPU_QUANT=0` loads the same file with f32 panels only.

use candle_core::{DType, Device, Tensor};
use dflash_core::visibility::causal;
use dflash_model::cpu::Isa;
use dflash_model::io::gguf;
use dflash_model::io::loader::load_target;
use dflash_model::{Rows, Target};
use dflash_testkit::{asset, smollm2_gguf};

/// Prefill 20 tokens, 3 AR steps, then a 16-row verify: every forward's logits and taps.
fn outputs(t: &Target) -> Vec<Tensor> {
    let taps = [1usize, 10, 20];
    let mut cache = t.new_cache();
    let mut out = Vec::new();
    let mut run = |tokens: &[u32], start: usize, cache: &mut dflash_model::KvCache| {
        let pos: Vec<usize> = (start..start + tokens.len()).collect();
        let mask = causal(start, tokens.len());
        let o = t
            .forward(tokens, &pos, &mask, cache, &taps, &Rows::All)
            .unwrap();
        out.push(o.logits.unwrap());
        out.extend(o.taps);
    };
    let prompt: Vec<u32> = (0..20).map(|i| 100 + 37 * i).collect();
    run(&prompt, 0, &mut cache);
    for i in 0..3 {
        run(&[500 + i], 20 + i as usize, &mut cache);
    }
    let block: Vec<u32> = (0..16).map(|i| 700 + 11 * i).collect();
    run(&block, 23, &mut cache);
    out
}

#[test]
fn quantized_streaming_equals_the_f32_path_bit_for_bit() {
    let path = smollm2_gguf();
    let g = gguf::load(&path, DType::F32, &Device::Cpu).unwrap();
    let up = g
        .store
        .quant("model.layers.0.mlp.up_proj.weight", &[1536, 576]);
    let q = g
        .store
        .quant("model.layers.0.self_attn.q_proj.weight", &[576, 576]);
    assert!(
        up.is_some() && q.is_some(),
        "SmolLM2's Q4_1 projections keep their blocks"
    );
    // the blocks dequantize to candle's f32 weight, which the store holds with streaming off
    // (q_proj: rows un-permuted like it)
    let plain = with_f32_panels(|| gguf::load(&path, DType::F32, &Device::Cpu)).unwrap();
    for (name, b, shape) in [
        (
            "model.layers.0.mlp.up_proj.weight",
            up.unwrap(),
            [1536usize, 576usize],
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            q.unwrap(),
            [576, 576],
        ),
    ] {
        let w = plain
            .store
            .get(name, &shape)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (r, row) in w.iter().enumerate().step_by(7) {
            for (c, &v) in row.iter().enumerate() {
                assert_eq!(v.to_bits(), b.value(r, c).to_bits(), "{name}[{r}, {c}]");
            }
        }
        // the store's own dequantization of a weight it holds as blocks only
        let lazy = g.store.get(name, &shape).unwrap().flatten_all().unwrap();
        let lazy: Vec<f32> = lazy.to_vec1().unwrap();
        let all: Vec<f32> = w.into_iter().flatten().collect();
        assert!(
            lazy.iter()
                .zip(&all)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}"
        );
    }
    drop((g, plain));

    // every projection of the 30 layers (q, k, v, o, gate, up, down) is Q4_1, and the LM head
    // (tied to the Q8_0 embedding) streams its Q8_0 blocks
    same_bits_streamed_or_not(&path, 30 * 7 + 1);
}

#[test]
fn qwen25_coder_streaming_equals_the_f32_path_bit_for_bit() {
    let path = asset(
        "models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder",
    );
    // per layer q, k, v, o (Q5_0 or Q8_0), gate, up (Q5_0), down (Q4_K or Q6_K); the Q8_0 LM
    // head
    same_bits_streamed_or_not(&path, 24 * 7 + 1);
}

/// Loads `path` streamed and with f32 panels only; `streamed` projections must stream (on a
/// CPU with a kernel ISA), and every output must be the same bits.
fn same_bits_streamed_or_not(path: &std::path::Path, streamed_projections: usize) {
    let streamed = load_target(path.to_str().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let plain =
        with_f32_panels(|| load_target(path.to_str().unwrap(), DType::F32, &Device::Cpu)).unwrap();
    assert_eq!(plain.target.quantized_projections(), 0);
    if dflash_model::cpu::panels::Panels::supported() {
        assert_eq!(
            streamed.target.quantized_projections(),
            streamed_projections
        );
    }
    // on every ISA the CPU runs (AVX-512 and AVX2 on an AVX-512 CPU)
    for isa in Isa::available() {
        let (a, b) = Isa::with(Some(isa), || {
            (outputs(&streamed.target), outputs(&plain.target))
        })
        .unwrap();
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            let (x, y) = (
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert!(
                x.iter().zip(&y).all(|(u, v)| u.to_bits() == v.to_bits()),
                "{isa:?}: output {i} differs"
            );
        }
    }
}

/// `f()` with GGUF weights laid out as f32 panels (no streaming), on this thread.
fn with_f32_panels<T>(f: impl FnOnce() -> T) -> T {
    use dflash_core::runtime::{self, CpuProducts, RuntimeConfig};
    let cfg = RuntimeConfig {
        cpu_products: CpuProducts::F32,
        ..runtime::current()
    };
    runtime::with_config(cfg, f)
}
