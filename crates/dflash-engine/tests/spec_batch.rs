//! Speculation in the running batch ([`SpecBatch`]): whatever else is in the batch, how many
//! slots, which requests join when, and whether a round drafts, each response is AR's at T = 0
//! and AR's seeded response at T > 0 (the exact match draws each token with its number of the
//! request's stream).

use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate_spec_batched, Mode, Request, SpecBatch};
use dflash_model::models::drafter::Drafter;
use dflash_model::Target;
use dflash_testkit::*;

/// Run `reqs` through a batch of `slots` slots in `mode`, admitting the next requests whenever
/// a slot is free (continuous scheduling): each request's new tokens, and the rounds that drafted.
fn run_batch(
    t: &Target,
    d: Option<&Drafter>,
    mode: Mode,
    reqs: &[Request],
    slots: usize,
) -> (Vec<Vec<u32>>, usize) {
    let gens = generate_spec_batched(t, d, mode, reqs, slots).unwrap();
    let drafted = gens
        .iter()
        .flat_map(|g| &g.rounds)
        .filter(|r| r.drafted > 0)
        .count();
    (gens.into_iter().map(|g| g.new_tokens).collect(), drafted)
}

/// Tiny-target requests of several prompt lengths, lengths and sampling rules.
fn tiny_requests(sampled: bool) -> Vec<Request> {
    let base = loop_prompt();
    (0..7)
        .map(|i| {
            let prompt: Vec<u32> = base.iter().skip(i % 4).copied().collect();
            let sampling = match (sampled, i % 3) {
                (false, _) | (true, 0) => SamplingParams::default(),
                (true, 1) => SamplingParams::new(0.9, 0.95, 0, 40 + i as u64).unwrap(),
                (true, _) => SamplingParams::new(1.0, 1.0, 20, 40 + i as u64).unwrap(),
            };
            req(&prompt, 9 + 6 * i, sampling, &[])
        })
        .collect()
}

#[test]
fn every_slot_decodes_ar_tokens_on_the_tiny_target() {
    let t = tiny();
    let d = quiet(&t);
    for sampled in [false, true] {
        let reqs = tiny_requests(sampled);
        let ar: Vec<Vec<u32>> = reqs
            .iter()
            .map(|r| decode(&t, None, Mode::Ar, r).new_tokens)
            .collect();
        for mode in [
            Mode::Chain { block: 8 },
            Mode::Auto {
                block: 8,
                max_budget: 7,
            },
            Mode::Ar,
        ] {
            for slots in [1, 3, 8] {
                let (got, drafted) = run_batch(&t, Some(&d), mode, &reqs, slots);
                for (i, (g, a)) in got.iter().zip(&ar).enumerate() {
                    assert_eq!(
                        g, a,
                        "request {i}, {mode:?}, {slots} slots, sampled {sampled}"
                    );
                }
                if let Mode::Chain { .. } = mode {
                    assert!(drafted > 0, "the chain drafted no round");
                }
                if mode == Mode::Ar {
                    assert_eq!(drafted, 0);
                }
            }
        }
    }
}

#[test]
fn a_slot_makes_the_rounds_its_session_makes_alone() {
    // four copies of one request: each slot drafts, accepts and commits what the chain's
    // session alone does, round by round (the last rounds, shorter than a block, differ: alone
    // the drafter drafts a shorter block, in the batch every slot's block is whole)
    let t = tiny();
    let d = quiet(&t);
    let r = req(&loop_prompt(), 40, SamplingParams::default(), &[]);
    let alone = decode(&t, Some(&d), Mode::Chain { block: 8 }, &r);
    let mut b = SpecBatch::new(&t, Some(&d), Mode::Chain { block: 8 }, 4).unwrap();
    for i in 0..4 {
        assert!(b.admit(i, &r).unwrap().1.is_none());
    }
    let mut rounds = vec![Vec::new(); 4];
    while b.live() > 0 {
        for s in b.round().unwrap() {
            rounds[s.index].push((s.round.drafted, s.round.accepted, s.round.tau_round));
            if let Some(g) = s.done {
                assert_eq!(g.new_tokens, alone.new_tokens);
            }
        }
    }
    let want: Vec<_> = (alone.rounds.iter())
        .map(|r| (r.drafted, r.accepted, r.tau_round))
        .collect();
    assert!(
        want.iter().any(|r| r.1 > 0),
        "the session accepted no draft"
    );
    let whole = want.iter().take_while(|r| r.0 == 7).count();
    assert!(whole > 10);
    for got in rounds {
        assert_eq!(got.len(), want.len());
        assert_eq!(got[..whole], want[..whole]);
    }
}

/// Drafting after AR rounds: the drafter's context then holds every row committed so far (the
/// AR rounds' taps appended to it), so the batch drafts, accepts and commits what a session
/// started from the prompt and those tokens does, round by round.
#[test]
fn drafting_after_ar_rounds_drafts_from_every_committed_row() {
    use dflash_core::batch_policy::RoundKind;
    let t = tiny();
    let d = quiet(&t);
    let (prompt, n, k) = (loop_prompt(), 40usize, 6usize);
    let r = req(&prompt, n, SamplingParams::default(), &[]);
    let mut b = SpecBatch::new(&t, Some(&d), Mode::Chain { block: 8 }, 2).unwrap();
    let mut out = vec![Vec::new(); 2];
    for (i, o) in out.iter_mut().enumerate() {
        o.push(b.admit(i, &r).unwrap().0);
    }
    b.force_rounds(Some(RoundKind::Ar));
    for _ in 0..k {
        for s in b.round().unwrap() {
            assert_eq!((s.round.drafted, s.tokens.len()), (0, 1), "an AR round");
            out[s.index].extend(&s.tokens);
        }
    }
    // a session from the prompt and the tokens committed so far (the last one is its anchor)
    let mut prompt2 = prompt.clone();
    prompt2.extend(&out[0][..k]);
    let alone = decode(
        &t,
        Some(&d),
        Mode::Chain { block: 8 },
        &req(&prompt2, n - k, SamplingParams::default(), &[]),
    );
    assert_eq!(alone.new_tokens[0], out[0][k]);
    b.force_rounds(Some(RoundKind::Draft));
    let mut rounds = vec![Vec::new(); 2];
    let mut done = vec![None; 2];
    while b.live() > 0 {
        for s in b.round().unwrap() {
            rounds[s.index].push((s.round.drafted, s.round.accepted, s.round.tau_round));
            done[s.index] = s.done.map(|g| g.new_tokens);
        }
    }
    let want: Vec<_> = (alone.rounds.iter())
        .map(|r| (r.drafted, r.accepted, r.tau_round))
        .collect();
    let whole = want.iter().take_while(|r| r.0 == 7).count();
    assert!(
        whole > 3 && want[..whole].iter().any(|r| r.1 > 0),
        "{want:?}"
    );
    let mut all = out[0][..k].to_vec();
    all.extend(&alone.new_tokens);
    for (got, tokens) in rounds.iter().zip(&done) {
        assert_eq!(got[..whole], want[..whole]);
        assert_eq!(tokens.as_ref().unwrap(), &all);
    }
}

#[test]
fn a_session_moves_into_the_batch_and_slots_resize() {
    let t = tiny();
    let d = quiet(&t);
    let reqs = tiny_requests(true);
    let ar: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| decode(&t, None, Mode::Ar, r).new_tokens)
        .collect();
    let mode = Mode::Auto {
        block: 8,
        max_budget: 7,
    };
    let mut b = SpecBatch::new(&t, Some(&d), mode, 2).unwrap();
    // request 0 decodes alone for three rounds (its own mode: trees), then moves in
    let mut s =
        dflash_engine::Session::start(&t, Some(&d), mode, &reqs[0], Default::default(), None)
            .unwrap();
    for _ in 0..3 {
        s.round().unwrap();
    }
    b.adopt(0, s).unwrap();
    assert!(b.admit(1, &reqs[1]).unwrap().1.is_none());
    let mut out = vec![Vec::new(); reqs.len()];
    let mut next = 2;
    while b.live() > 0 || next < reqs.len() {
        if b.free() > 0 && next < reqs.len() {
            b.resize(b.live() + 1).unwrap();
            b.admit(next, &reqs[next]).unwrap();
            next += 1;
        }
        for r in b.round().unwrap() {
            if let Some(g) = r.done {
                out[r.index] = g.new_tokens;
            }
        }
        if b.live() > 0 && b.free() > 1 {
            b.resize(b.live()).unwrap();
        }
    }
    for (i, (g, a)) in out.iter().zip(&ar).enumerate() {
        assert_eq!(g, a, "request {i}");
    }
}

/// SmolLM2 with its bundled drafter on chat prompts, in both CPU products modes: every
/// response equals AR's with every prompt in the batch at once and with 3 slots (prompts
/// joining as others end).
#[test]
fn smollm2_batch_equals_ar_in_both_products_modes() {
    for q8 in [false, true] {
        let lt = dflash_model::cpu::q8::with_choice(q8, smollm2);
        let dir = dflash_model::io::loader::bundled_drafter("smollm2-135m").unwrap();
        let d = Drafter::load_dir(&dir, &lt.target).unwrap();
        let prompts = [
            "What is 17 times 23? Show the steps.",
            "Write a haiku about autumn rain.",
            "Write a Python function that reverses a string.",
            "A train travels 120 km in 1.5 hours. What is its average speed?",
        ];
        let reqs: Vec<Request> = prompts
            .iter()
            .map(|p| {
                let ids = lt.tokenizer.prompt_ids(p, true).unwrap();
                req(&ids, 32, SamplingParams::default(), &lt.tokenizer.stop_ids)
            })
            .collect();
        let ar: Vec<Vec<u32>> = reqs
            .iter()
            .map(|r| decode(&lt.target, None, Mode::Ar, r).new_tokens)
            .collect();
        for slots in [4, 3] {
            let (got, drafted) = run_batch(
                &lt.target,
                Some(&d),
                Mode::Chain { block: 16 },
                &reqs,
                slots,
            );
            assert!(drafted > 0);
            for (i, (g, a)) in got.iter().zip(&ar).enumerate() {
                assert_eq!(g, a, "prompt {i}, {slots} slots, q8 {q8}");
            }
        }
    }
}

#[test]
fn hybrid_targets_are_refused_by_name() {
    let t = tiny_hybrid();
    let err = SpecBatch::new(&t, None, Mode::Ar, 2)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("attention-only"), "{err}");
}
