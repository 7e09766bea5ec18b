//! Targets and drafters the tests run: the random tiny Qwen3 of `tests/fixtures/qwen3-tiny`
//! (a word-level tokenizer "t0" … "t255"), z-lab's random drafters for it, the random tiny
//! Qwen3.5 hybrid, and SmolLM2-135M from the asset cache.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, Generation, Mode, Request};
use dflash_model::io::loader::{load_hf_weights, load_target, LoadedTarget};
use dflash_model::models::drafter::Drafter;
use dflash_model::Target;

use crate::paths::{fixtures, smollm2_gguf, tmp};

/// The random tiny Qwen3 target of tests/fixtures/qwen3-tiny (f32, CPU).
pub fn tiny() -> Target {
    let (cfg, store) =
        load_hf_weights(&fixtures().join("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap();
    Target::load(cfg, &store).unwrap()
}

/// The random tiny Qwen3.5 hybrid of tests/fixtures/qwen35-tiny (three Gated DeltaNet and two
/// gated attention layers; f32, CPU).
pub fn tiny_hybrid() -> Target {
    let (cfg, store) =
        load_hf_weights(&fixtures().join("qwen35-tiny"), DType::F32, &Device::Cpu).unwrap();
    Target::load(cfg, &store).unwrap()
}

/// A private copy of tests/fixtures/qwen3-tiny, so a test may alter it.
pub fn tiny_target_dir(name: &str) -> PathBuf {
    let d = tmp(&format!("target-{name}"));
    for e in std::fs::read_dir(fixtures().join("qwen3-tiny")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    d
}

/// A target directory or file loaded on the CPU in `dtype`.
pub fn load(dir: &Path, dtype: DType) -> LoadedTarget {
    load_target(dir.to_str().unwrap(), dtype, &Device::Cpu).unwrap()
}

/// z-lab's "quiet" random drafter for the tiny target (long acceptances once the target
/// loops).
pub fn quiet(t: &Target) -> Drafter {
    Drafter::load_dir(&fixtures().join("dflash-tiny/quiet"), t).unwrap()
}

/// The prompt of qwen3-tiny/reference.json.
pub fn tiny_prompt() -> Vec<u32> {
    vec![37, 235, 140, 72, 255, 137, 203, 133, 79, 192, 144, 129]
}

/// Where the tiny target settles into its loop: drafts get accepted from here on.
pub fn loop_prompt() -> Vec<u32> {
    [tiny_prompt(), vec![210, 213, 107, 175, 174, 175, 62, 74]].concat()
}

/// A draft vocabulary of two thirds of the tiny target's 256 tokens: every token not a multiple
/// of 3, and every token of [`loop_prompt`] (so its loop can be drafted).
pub fn loop_prompt_head() -> dflash_model::models::draft_vocab::DraftVocab {
    let keep = loop_prompt();
    dflash_model::models::draft_vocab::DraftVocab {
        token_ids: (0..256u32)
            .filter(|x| x % 3 != 0 || keep.contains(x))
            .collect(),
        source: "every token not a multiple of 3, and the loop prompt's".into(),
        coverage: None,
    }
}

/// SmolLM2-135M-Instruct from the asset cache (f32, CPU).
pub fn smollm2() -> LoadedTarget {
    load(&smollm2_gguf(), DType::F32)
}

/// A request of `n` new tokens.
pub fn req(prompt: &[u32], n: usize, sampling: SamplingParams, stop: &[u32]) -> Request {
    Request {
        prompt_ids: prompt.to_vec(),
        max_new_tokens: n,
        sampling,
        stop_ids: stop.to_vec(),
        loop_window: 0,
    }
}

/// One generation with the default decode options (no CUDA graphs, the residual rule at
/// T > 0); a failure panics with its message.
pub fn decode(t: &Target, drafter: Option<&Drafter>, mode: Mode, r: &Request) -> Generation {
    generate(t, drafter, mode, r, Default::default(), None).unwrap()
}

/// Greedy continuation with the KV cache, one token per forward, as the references do it.
pub fn greedy(t: &Target, prompt: &[u32], steps: usize) -> Vec<u32> {
    use dflash_core::visibility::causal;
    let mut cache = t.new_cache();
    let mut new = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..steps {
        let start = cache.len();
        let pos: Vec<usize> = (start..start + new.len()).collect();
        let o = t
            .forward(
                &new,
                &pos,
                &causal(start, new.len()),
                &mut cache,
                &[],
                &dflash_model::Rows::Last,
            )
            .unwrap();
        let l: Vec<f32> = o.logits.unwrap().squeeze(0).unwrap().to_vec1().unwrap();
        let next = dflash_core::sampling::argmax(&l);
        out.push(next);
        new = vec![next];
    }
    out
}

/// What `n` seeded generations of 3 tokens from [`loop_prompt`] on the tiny target give under
/// one mode and acceptance rule at `temperature` (seeds `seed0 ..`, top-p 0.95): the counts of
/// the second and third new tokens over the 256-token vocabulary, the rounds that accepted a
/// draft, and the drafts accepted. The chi-square tests of losslessness at T > 0 compare these
/// counts with AR's.
pub fn sampled_counts(
    t: &Target,
    drafter: Option<&Drafter>,
    mode: Mode,
    acceptance: dflash_engine::decode::Acceptance,
    (temperature, seed0, n): (f64, u64, u64),
) -> ([Vec<usize>; 2], usize, usize) {
    let opts = dflash_engine::decode::DecodeOptions {
        acceptance,
        ..Default::default()
    };
    sampled_counts_with(t, drafter, mode, opts, (temperature, 0.95, 0), (seed0, n))
}

/// [`sampled_counts`] with the loop's options and the rule given: (temperature, top-p, top-k);
/// every rule samples on the device unless `opts.drafts_to_host` asks for the host's path.
pub fn sampled_counts_with(
    t: &Target,
    drafter: Option<&Drafter>,
    mode: Mode,
    opts: dflash_engine::decode::DecodeOptions,
    (temperature, top_p, top_k): (f64, f64, i64),
    (seed0, n): (u64, u64),
) -> ([Vec<usize>; 2], usize, usize) {
    let prompt = loop_prompt();
    let mut c = [vec![0usize; 256], vec![0usize; 256]];
    let (mut rounds, mut drafts) = (0, 0);
    for s in 0..n {
        let sp = SamplingParams::new(temperature, top_p, top_k, seed0 + s).unwrap();
        let d = (mode != Mode::Ar).then_some(drafter).flatten();
        let g = generate(t, d, mode, &req(&prompt, 3, sp, &[]), opts, None).unwrap();
        rounds += g.rounds.iter().filter(|r| r.accepted > 0).count();
        drafts += g.rounds.iter().map(|r| r.accepted).sum::<usize>();
        c[0][g.new_tokens[1] as usize] += 1;
        c[1][g.new_tokens[2] as usize] += 1;
    }
    (c, rounds, drafts)
}

/// Concatenated taps `[n, L·h]` of `tokens` from one causal prefill of `t`.
pub fn prefill_taps(t: &Target, taps: &[usize], tokens: &[u32]) -> candle_core::Tensor {
    let mut c = t.new_cache();
    let o = t
        .forward_causal(tokens, &mut c, taps, &dflash_model::Rows::None)
        .unwrap();
    Target::concat_taps(&o.taps).unwrap()
}

/// Replay z-lab's greedy `dflash_generate` record `g` (the reference JSON's `prompt_ids`,
/// `max_new_tokens`, `output_ids`, `acceptance_lengths`) with our chain and the drafter `d`:
/// the same new tokens and the same acceptance length in every round. Returns the prompt, the
/// generation and the acceptance lengths.
pub fn replay_zlab_generation(
    t: &Target,
    d: &Drafter,
    g: &serde_json::Value,
    name: &str,
) -> (Vec<u32>, Generation, Vec<usize>) {
    let prompt = crate::refs::ids(&g["prompt_ids"]);
    let r = req(
        &prompt,
        g["max_new_tokens"].as_u64().unwrap() as usize,
        SamplingParams::default(),
        &[],
    );
    let out = decode(
        t,
        Some(d),
        Mode::Chain {
            block: d.block_size,
        },
        &r,
    );
    let want_out = crate::refs::ids(&g["output_ids"]);
    assert_eq!(
        out.new_tokens,
        want_out[prompt.len()..],
        "{name}: output differs"
    );
    let want_acc: Vec<usize> = crate::refs::ids(&g["acceptance_lengths"])
        .iter()
        .map(|&x| x as usize)
        .collect();
    let got_acc: Vec<usize> = out.rounds.iter().map(|r| r.tau_round).collect();
    assert_eq!(got_acc, want_acc, "{name}: acceptance lengths differ");
    (prompt, out, want_acc)
}

/// One draft block on a fresh draft cache over the context `ctx` (its taps from one prefill):
/// the normed hidden rows and the logits of rows 1 … block − 1.
pub fn fresh_block(
    t: &Target,
    d: &Drafter,
    ctx: &[u32],
    anchor_tok: u32,
    block: usize,
) -> (candle_core::Tensor, candle_core::Tensor) {
    let taps = prefill_taps(t, &d.target_layer_ids, ctx);
    let mut cache = d.new_cache();
    d.draft_rows(
        t,
        None,
        &mut cache,
        &taps.unsqueeze(0).unwrap(),
        dflash_model::models::drafter::BlockAt {
            token: anchor_tok,
            anchor: ctx.len(),
            block,
            positions: block - 1,
        },
    )
    .unwrap()
}

/// A trainable 2-layer drafter (block 4, taps [1, 2], mask 255, intermediate 48; DFlash2 with
/// `dflash2`) for a private copy of the tiny target named `name`, in `dtype`, with every path
/// carrying signal: 2-D weights 5× the init (seed 5), DFlash2 codebooks 50×, the dynamic taps'
/// projections a fixed non-zero pattern `0.05 · sin(0.37 i)`. The objective and DFlash2
/// training tests' setup.
pub fn signal_drafter(
    name: &str,
    dtype: DType,
    dflash2: Option<dflash_core::config::Dflash2Params>,
) -> (LoadedTarget, dflash_train::trainer::TrainableDrafter) {
    use candle_core::Tensor;
    use dflash_model::models::drafter_init::{drafter_config, random_weights, DrafterShape};
    let dir = tiny_target_dir(&format!("{name}-{dtype:?}"));
    let lt = load(&dir, dtype);
    let shape = DrafterShape {
        layers: 2,
        block_size: 4,
        mask_token_id: 255,
        intermediate_size: Some(48),
        target_layer_ids: Some(vec![1, 2]),
        dflash2,
    };
    let cfg = drafter_config(&lt.target, &shape).unwrap();
    let w: std::collections::HashMap<String, Tensor> = random_weights(&cfg, 5)
        .unwrap()
        .into_iter()
        .map(|(k, v)| {
            let v = if k.contains("kernel_projection") {
                let n = v.elem_count();
                let x: Vec<f32> = (0..n).map(|i| 0.05 * (i as f32 * 0.37).sin()).collect();
                Tensor::from_vec(x, v.shape(), v.device()).unwrap()
            } else if k.contains("codebook") {
                (v * 50.0).unwrap()
            } else if v.rank() == 2 {
                (v * 5.0).unwrap()
            } else {
                v
            };
            (k, v)
        })
        .collect();
    let td = dflash_train::trainer::TrainableDrafter::new(cfg, &w, &lt.target).unwrap();
    (lt, td)
}

/// Each request's output of one batched run over `slots` slots (`None` where it was refused),
/// with the fixed-capacity steps CUDA graphs replay when `cuda_graphs` (on the CPU run eagerly
/// on the same buffers); a request reported twice fails.
pub fn batched_outputs(
    t: &Target,
    reqs: &[Request],
    slots: usize,
    cuda_graphs: bool,
) -> Vec<Option<dflash_engine::batched::BatchedOutput>> {
    use dflash_engine::batched::{generate_batched, BatchedOptions, Flow};
    let mut out = vec![None; reqs.len()];
    let opts = BatchedOptions {
        cuda_graphs,
        ..Default::default()
    };
    generate_batched(t, reqs, slots, opts, |i, r| {
        assert!(out[i].is_none(), "request {i} reported twice");
        out[i] = r.ok();
        Ok(Flow::Continue)
    })
    .unwrap();
    out
}
