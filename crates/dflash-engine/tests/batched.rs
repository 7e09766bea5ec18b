//! Batched decoding equals one-at-a-time AR: the same tokens at T = 0 (SmolLM2 and the
//! tiny Qwen3) and at T > 0 with the same seeds under rules drawn on the host and on the device
//! (tiny Qwen3), with fewer slots than requests
//! (continuous refill and cache compaction are exercised), stop tokens and a request that
//! does not fit the context; the fixed-capacity steps that CUDA graphs replay equal the
//! growing cache's.

use dflash_core::sampling::SamplingParams;
use dflash_engine::batched::{generate_batched, BatchedOptions, BatchedOutput, Flow};
use dflash_engine::{generate, Mode, Request};
use dflash_model::Target;
use dflash_testkit::*;

/// A batched run, which the fixed-capacity steps of `cuda_graphs` (on the CPU: run eagerly on
/// the same buffers, moved in place) must equal.
fn run_batched(t: &Target, reqs: &[Request], slots: usize) -> Vec<Option<BatchedOutput>> {
    let out = batched_outputs(t, reqs, slots, false);
    assert_eq!(
        batched_outputs(t, reqs, slots, true),
        out,
        "fixed-capacity steps, {slots} slots"
    );
    out
}

/// Every request of a batched run with `slots` slots gets the tokens AR gives it alone, and
/// one that AR refuses is refused.
fn assert_equals_ar(t: &Target, reqs: &[Request], slots: usize) {
    let batched = run_batched(t, reqs, slots);
    for (i, r) in reqs.iter().enumerate() {
        match generate(t, None, Mode::Ar, r, Default::default(), None) {
            Ok(ar) => {
                let b = batched[i].as_ref().unwrap();
                assert_eq!(b.new_tokens, ar.new_tokens, "request {i}, {slots} slots");
                assert_eq!(b.stopped_by_token, ar.stopped_by_token, "request {i}");
            }
            Err(_) => assert!(batched[i].is_none(), "request {i} is refused"),
        }
    }
}

#[test]
fn batched_equals_sequential_on_smollm2_at_t0() {
    let lt = smollm2();
    let prompts = [
        "What is 2 + 2?",
        "Write a haiku about rain.",
        "Who wrote Hamlet?",
        "Name three fruits.",
        "What is the capital of France?",
    ];
    // different lengths: sequences finish at different steps and slots are refilled
    let reqs: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ids = lt.tokenizer.prompt_ids(p, true).unwrap();
            req(
                &ids,
                6 + 5 * i,
                SamplingParams::default(),
                &lt.tokenizer.stop_ids,
            )
        })
        .collect();
    assert_equals_ar(&lt.target, &reqs, 3);
}

/// With integer products (`--cpu-products q8`) a row's products depend on its own values only,
/// which requantize every layer's input: a batch must give each sequence the bits it gets alone,
/// or a rounding flip grows into other tokens. Eight chat prompts, four and eight slots.
#[test]
fn batched_equals_sequential_on_smollm2_with_integer_products() {
    let lt = dflash_model::cpu::q8::with_choice(true, smollm2);
    let prompts = &dflash_testkit::serve::PROMPTS[..8];
    let reqs: Vec<Request> = prompts
        .iter()
        .map(|p| {
            let ids = lt.tokenizer.prompt_ids(p, true).unwrap();
            req(&ids, 48, SamplingParams::default(), &lt.tokenizer.stop_ids)
        })
        .collect();
    assert_equals_ar(&lt.target, &reqs, 4);
    assert_equals_ar(&lt.target, &reqs, 8);
}

#[test]
fn batched_equals_sequential_on_tiny_target_with_sampling() {
    let t = tiny();
    let base = tiny_prompt();
    let mut reqs = Vec::new();
    for i in 0..7 {
        let prompt: Vec<u32> = base.iter().skip(i % 3).copied().collect();
        // greedy; top-p alone (drawn on the host); a plain temperature and top-k with top-p
        // (drawn on the device, as AR draws them)
        let seed = 100 + i as u64;
        let sampling = match i % 4 {
            0 => SamplingParams::default(),
            1 => SamplingParams::new(0.9, 0.95, 0, seed).unwrap(),
            2 => SamplingParams::new(0.8, 1.0, 0, seed).unwrap(),
            _ => SamplingParams::new(1.0, 0.9, 20, seed).unwrap(),
        };
        reqs.push(req(&prompt, 10 + 7 * i, sampling, &[]));
    }
    // a stop token that the greedy continuation of request 0 produces
    let ar0 = decode(&t, None, Mode::Ar, &reqs[0]);
    reqs[0].stop_ids = vec![ar0.new_tokens[4]];
    // one request that cannot fit the context: reported as an error, others unaffected
    let ctx = t.config.max_position_embeddings;
    reqs.push(req(&base, ctx, SamplingParams::default(), &[]));
    assert!(generate(
        &t,
        None,
        Mode::Ar,
        reqs.last().unwrap(),
        Default::default(),
        None
    )
    .is_err());
    for slots in [1, 2, 4, 16] {
        assert_equals_ar(&t, &reqs, slots);
    }
    assert!(
        run_batched(&t, &reqs[..1], 1)[0]
            .as_ref()
            .unwrap()
            .stopped_by_token
    );
}

/// The cache's front moves: a prompt longer than the cache (it grows at the front) and a
/// long generation followed by short ones (the unused front columns are dropped).
#[test]
fn batched_survives_front_growth_and_compaction() {
    let t = tiny();
    let base = tiny_prompt();
    let long: Vec<u32> = [base.clone(), base.clone(), base.clone()].concat();
    let g = SamplingParams::default();
    let reqs = vec![
        req(&base[..3], 1, g, &[]), // done at the first fill: its slot is free at once
        req(&base[..4], 90, g, &[]), // long generation: the cache passes 64 columns
        req(&long, 20, g, &[]),     // 36 > 4 + 1 columns: the cache grows at the front
        req(&base[..2], 30, g, &[]), // short, after the long ones: the front is dropped
        req(&base[..5], 12, g, &[]),
    ];
    for slots in [1, 2] {
        assert_equals_ar(&t, &reqs, slots);
    }
}

/// More prompts per fill than one prefill forward takes (16): the fill is chunked.
#[test]
fn batched_fills_many_slots_in_chunks() {
    let t = tiny();
    let base = tiny_prompt();
    let reqs: Vec<Request> = (0..40)
        .map(|i| {
            let prompt: Vec<u32> = base.iter().skip(i % 7).copied().collect();
            req(&prompt, 3 + i % 5, SamplingParams::default(), &[])
        })
        .collect();
    assert_equals_ar(&t, &reqs, 34);
}

#[test]
fn batched_refuses_zero_slots() {
    let t = tiny();
    let r = req(&tiny_prompt(), 4, SamplingParams::default(), &[]);
    let e =
        generate_batched(&t, &[r], 0, Default::default(), |_, _| Ok(Flow::Continue)).unwrap_err();
    assert!(e.to_string().contains("slot"), "{e}");
}

#[test]
fn stop_ends_the_run_at_once() {
    let t = tiny();
    let reqs: Vec<Request> = (0..6)
        .map(|i| req(&tiny_prompt(), 4 + i, SamplingParams::default(), &[]))
        .collect();
    let mut seen = 0;
    generate_batched(&t, &reqs, 2, Default::default(), |_, _| {
        seen += 1;
        Ok(if seen == 2 {
            Flow::Stop
        } else {
            Flow::Continue
        })
    })
    .unwrap();
    assert_eq!(seen, 2);
}

/// `loop_window` ends a response exactly where training's cut of the whole response would
/// ([`dflash_core::loops::keep_until_loop`]): batched, and one at a time in AR, DFlash and
/// DDTree (whose rounds commit several tokens, cut inside a round). The tiny target falls
/// into a loop from `loop_prompt`.
#[test]
fn a_loop_window_ends_the_response_where_training_cuts_it() {
    use dflash_core::loops::keep_until_loop;
    let t = tiny();
    let d = quiet(&t);
    let prompts = [loop_prompt(), tiny_prompt(), tiny_prompt()[3..].to_vec()];
    let mut cut_some = false;
    for w in [2, 4, 8] {
        let mut full = Vec::new();
        let mut reqs = Vec::new();
        for p in &prompts {
            let r = req(p, 48, SamplingParams::default(), &[]);
            full.push(decode(&t, None, Mode::Ar, &r).new_tokens);
            reqs.push(Request {
                loop_window: w,
                ..r
            });
        }
        let batched = run_batched(&t, &reqs, 2);
        for (i, r) in reqs.iter().enumerate() {
            let keep = keep_until_loop(&full[i], w);
            let want = &full[i][..keep];
            cut_some |= keep < full[i].len();
            let b = batched[i].as_ref().unwrap();
            assert_eq!(b.new_tokens, want, "batched, request {i}, w {w}");
            assert_eq!(
                b.stopped_by_loop,
                keep < full[i].len(),
                "request {i}, w {w}"
            );
            assert!(!b.stopped_by_token);
            for mode in [
                Mode::Ar,
                Mode::Chain { block: 8 },
                Mode::Tree {
                    block: 8,
                    budget: 8,
                    top_k: 0,
                },
            ] {
                let drafter = (!matches!(mode, Mode::Ar)).then_some(&d);
                let g = decode(&t, drafter, mode, r);
                assert_eq!(g.new_tokens, want, "{mode:?}, request {i}, w {w}");
                assert_eq!(
                    g.stopped_by_loop,
                    keep < full[i].len(),
                    "{mode:?}, request {i}"
                );
            }
        }
    }
    assert!(
        cut_some,
        "no response was cut: the test would not see the rule"
    );
}

/// A speculative session moved into a batch (the server, when a second request arrives) goes
/// on as AR there: at T = 0 its tokens are AR's, and so are those of the request prefilled
/// beside it; at T > 0 (the exact match seeks its stream to each token's number) the same
/// seeded draws as AR.
#[test]
fn a_session_moved_into_a_batch_goes_on_as_ar() {
    use dflash_engine::batched::Batch;
    use dflash_engine::Session;
    let lt = smollm2();
    let dir = dflash_model::io::loader::bundled_drafter("smollm2-135m").unwrap();
    let d = dflash_model::models::drafter::Drafter::load_dir(&dir, &lt.target).unwrap();
    let auto = Mode::Auto {
        block: 16,
        max_budget: 15,
    };
    let other = lt
        .tokenizer
        .prompt_ids("Write a haiku about autumn rain.", true)
        .unwrap();
    let other = req(&other, 24, SamplingParams::default(), &[]);
    let ids = lt
        .tokenizer
        .prompt_ids("What is 12 times 15? Show the steps.", true)
        .unwrap();
    for sampling in [
        SamplingParams::default(),
        SamplingParams::new(0.8, 1.0, 0, 5).unwrap(),
    ] {
        let r = req(&ids, 48, sampling, &[]);
        let ar = decode(&lt.target, None, Mode::Ar, &r);
        let mut s =
            Session::start(&lt.target, Some(&d), auto, &r, Default::default(), None).unwrap();
        for _ in 0..3 {
            s.round().unwrap();
        }
        let before = s.new_tokens().len();
        assert!(before > 3, "three rounds commit at least their bonuses");
        let (cache, live) = s.into_live(0).unwrap();
        let mut b = Batch::new(&lt.target, 2, None).unwrap();
        b.adopt(&cache, live).unwrap();
        let first = b.admit(&[(1, &other)]).unwrap();
        let mut out: Vec<Vec<u32>> = vec![ar.new_tokens[..before].to_vec(), vec![first[0].token]];
        let mut ended = [None, None];
        while b.live() > 0 {
            for st in b.step().unwrap() {
                out[st.index].push(st.token);
                if let Some(o) = st.done {
                    ended[st.index] = Some(o.new_tokens);
                }
            }
        }
        assert_eq!(ended[0].as_ref().unwrap(), &ar.new_tokens, "{sampling:?}");
        assert_eq!(out[0], ar.new_tokens);
        let alone = decode(&lt.target, None, Mode::Ar, &other);
        assert_eq!(ended[1].as_ref().unwrap(), &alone.new_tokens);
    }
}

/// The open batch laid out again between steps (grown, shrunk to its live count, a sequence
/// cancelled) goes on with every sequence's own tokens: each equals its AR decode alone.
#[test]
fn a_batch_resized_between_steps_keeps_every_sequence() {
    use dflash_engine::batched::Batch;
    let t = tiny();
    let base = tiny_prompt();
    let reqs: Vec<Request> = (0..5)
        .map(|i| {
            let prompt: Vec<u32> = base.iter().skip(i % 3).copied().collect();
            let sampling = match i % 2 {
                0 => SamplingParams::default(),
                _ => SamplingParams::new(0.9, 0.95, 0, 40 + i as u64).unwrap(),
            };
            req(&prompt, 12 + 3 * i, sampling, &[])
        })
        .collect();
    let mut b = Batch::new(&t, 2, None).unwrap();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); reqs.len()];
    let mut ended: Vec<Option<Vec<u32>>> = vec![None; reqs.len()];
    let mut take = |stepped: Vec<dflash_engine::batched::Stepped>, out: &mut Vec<Vec<u32>>| {
        for s in stepped {
            out[s.index].push(s.token);
            if let Some(o) = s.done {
                ended[s.index] = Some(o.new_tokens);
            }
        }
    };
    take(b.admit(&[(0, &reqs[0]), (1, &reqs[1])]).unwrap(), &mut out);
    for _ in 0..3 {
        take(b.step().unwrap(), &mut out);
    }
    b.resize(5).unwrap();
    take(
        b.admit(&[(2, &reqs[2]), (3, &reqs[3]), (4, &reqs[4])])
            .unwrap(),
        &mut out,
    );
    for _ in 0..4 {
        take(b.step().unwrap(), &mut out);
    }
    assert!(b.cancel(3));
    b.resize(4).unwrap();
    while b.live() > 0 {
        take(b.step().unwrap(), &mut out);
        let live = b.live();
        if live > 0 && 2 * live <= b.slots() {
            b.resize(live).unwrap();
        }
    }
    for (i, r) in reqs.iter().enumerate() {
        let alone = decode(&t, None, Mode::Ar, r).new_tokens;
        match i {
            3 => assert_eq!(
                out[3],
                alone[..out[3].len()],
                "the cancelled sequence's tokens"
            ),
            _ => assert_eq!(ended[i].as_ref().unwrap(), &alone, "request {i}"),
        }
    }
}

/// Past `admit_until` no prompt is prefilled: the first prefill always runs, the sequences in
/// the slots finish, the rest stay unstarted (a time-limited regeneration ends soon after its
/// limit, however long the waiting prompts); without it every request finishes.
#[test]
fn no_prompt_is_prefilled_past_admit_until() {
    let t = tiny();
    let base = tiny_prompt();
    let reqs: Vec<Request> = (0..6)
        .map(|i| req(&base[i % 3..], 6 + i, SamplingParams::default(), &[]))
        .collect();
    let run = |admit_until| {
        let mut done = Vec::new();
        let opts = BatchedOptions {
            admit_until,
            ..Default::default()
        };
        generate_batched(&t, &reqs, 4, opts, |i, r| {
            r.unwrap();
            done.push(i);
            Ok(Flow::Continue)
        })
        .unwrap();
        done
    };
    // on the CPU a prefill forward holds one prompt: one request, the shortest
    assert_eq!(run(Some(std::time::Instant::now())).len(), 1);
    let later = std::time::Instant::now() + std::time::Duration::from_secs(3600);
    assert_eq!(run(Some(later)).len(), reqs.len());
}
