//! Speculative decoding on a hybrid (Gated DeltaNet) target is lossless at T = 0: chain and
//! DDTree rounds roll the linear-attention states back to the accepted prefix or path. The
//! drafter is trained briefly on the target's own outputs, so rounds accept some drafts and
//! reject others (both rollbacks exercised).

use dflash_testkit::{decode, fixtures, tmp};

use candle_core::{DType, Device};
use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, DecodeOptions, Mode, Request};
use dflash_model::io::loader::{load_target, LoadedTarget};
use dflash_model::models::drafter::Drafter;
use dflash_train::config::TrainConfig;
use dflash_train::prompts::Prompt;
use dflash_train::regen::{regenerate, RegenOptions};

/// Six chat prompts of five words from the tiny vocabulary (two distinct ones, alternating).
fn prompts() -> Vec<Prompt> {
    (0..6u32)
        .map(|i| Prompt {
            messages: vec![dflash_model::io::tokenizer::ChatMessage {
                role: "user".into(),
                content: (0..5)
                    .map(|j| format!("t{}", ((i % 2) * 53 + j * 17) % 250 + 1))
                    .collect::<Vec<_>>()
                    .join(" "),
            }],
        })
        .collect()
}

/// A one-layer drafter trained briefly (60 steps) on the target's own responses to `prompts`.
fn trained_drafter(lt: &LoadedTarget, prompts: &[Prompt]) -> Drafter {
    let data = tmp("data");
    let opts = RegenOptions {
        max_new_tokens: 32,
        loop_window: 0,
        sampling: SamplingParams::default(),
        prompts_per_shard: 6,
        // batched (attention-only) / falls back to one at a time (hybrid)
        batch_size: 4,
        cuda_graphs: false,
        time_limit: None,
        source: "test".into(),
        target_name: "qwen35-tiny".into(),
    };
    regenerate(lt, prompts, &data, &opts).unwrap();
    let cfg = TrainConfig {
        num_draft_layers: 1,
        block_size: 6,
        intermediate_size: Some(96),
        mask_token_id: Some(255),
        target_layer_ids: Some(vec![1, 3]),
        num_anchors: 32,
        lr: 1e-2,
        warmup_ratio: 0.0,
        grad_accum: 2,
        max_steps: Some(60),
        save_every: 60,
        val_every: 60,
        val_sequences: 1,
        ..Default::default()
    };
    let out = tmp("run");
    dflash_train::trainer::train(lt, &data, &out, cfg, &Default::default()).unwrap();
    Drafter::load_dir(&out.join("best"), &lt.target).unwrap()
}

/// The T = 0 request for `p`'s chat prompt, 40 new tokens.
fn request(lt: &LoadedTarget, p: &Prompt) -> Request {
    let ids = lt
        .tokenizer
        .encode(
            &lt.tokenizer.apply_chat_template(&p.messages).unwrap(),
            false,
        )
        .unwrap();
    Request {
        prompt_ids: ids,
        max_new_tokens: 40,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        loop_window: 0,
    }
}

/// AR with the fixed layout, and chain and tree decoding with and without it, all give AR's
/// tokens for `req`; returns whether some round accepted drafts and whether some rejected.
fn assert_lossless(lt: &LoadedTarget, d: &Drafter, req: &Request) -> (bool, bool) {
    let (mut accepted_some, mut rejected_some) = (false, false);
    let ar = decode(&lt.target, None, Mode::Ar, req);
    // the fixed-shape forwards CUDA graphs replay (on the CPU the same fixed layout and
    // in-place input buffers, without graphs; padded tails, the linear-attention rows
    // kept pending across the padding)
    let fixed = DecodeOptions {
        cuda_graphs: true,
        ..Default::default()
    };
    let g = generate(&lt.target, None, Mode::Ar, req, fixed, None).unwrap();
    assert_eq!(g.new_tokens, ar.new_tokens, "AR with the fixed layout");
    for mode in [
        Mode::Chain { block: 6 },
        Mode::Chain { block: 3 },
        Mode::Tree {
            block: 6,
            budget: 4,
            top_k: 0,
        },
        Mode::Tree {
            block: 6,
            budget: 16,
            top_k: 0,
        },
    ] {
        let g = decode(&lt.target, Some(d), mode, req);
        assert_eq!(
            g.new_tokens,
            ar.new_tokens,
            "{} differs from AR",
            mode.name()
        );
        let f = generate(&lt.target, Some(d), mode, req, fixed, None).unwrap();
        assert_eq!(
            f.new_tokens,
            ar.new_tokens,
            "{} with the fixed layout differs from AR",
            mode.name()
        );
        accepted_some |= g.rounds.iter().any(|r| r.accepted > 0);
        rejected_some |= g.rounds.iter().any(|r| r.accepted + 1 < r.drafted.max(1));
    }
    (accepted_some, rejected_some)
}

/// On the tiny Qwen3.5 hybrid, a drafter trained on the target's outputs decodes the first two
/// prompts with chain and tree rounds (with and without the fixed layout) to AR's tokens, and
/// the rounds both accept and reject drafts.
#[test]
fn chain_and_tree_are_lossless_on_a_hybrid_target() {
    let dir = fixtures().join("qwen35-tiny");
    let lt = load_target(dir.to_str().unwrap(), DType::F32, &Device::Cpu).unwrap();
    assert!(lt.target.is_hybrid());
    let prompts = prompts();
    let d = trained_drafter(&lt, &prompts);
    let mut accepted_some = false;
    let mut rejected_some = false;
    for p in &prompts[..2] {
        let (accepted, rejected) = assert_lossless(&lt, &d, &request(&lt, p));
        accepted_some |= accepted;
        rejected_some |= rejected;
    }
    assert!(
        accepted_some && rejected_some,
        "the test must exercise both accepted and rejected drafts"
    );
}
