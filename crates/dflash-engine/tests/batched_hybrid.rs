//! Batched decoding of a hybrid target (Gated DeltaNet + gated attention: the random tiny
//! Qwen3.5) equals its one-sequence AR decode token for token (f32, CPU): at T = 0 and at
//! T > 0 with the same seeds, at 1 … 16 slots with fewer slots than requests (each slot's
//! linear-attention state replaced as sequences come and go), prompts long enough for the
//! chunked prefill, the cache's front grown and dropped, the batch laid out again between
//! steps, and the fixed-capacity steps that CUDA graphs replay.

use dflash_core::sampling::SamplingParams;
use dflash_engine::batched::Batch;
use dflash_engine::{Mode, Request};
use dflash_model::Target;
use dflash_testkit::*;

/// Every request of a batched run (eager, and in fixed-capacity steps) gets the tokens of its
/// AR decode alone.
fn assert_equals_ar(t: &Target, reqs: &[Request], slots: usize) {
    let eager = batched_outputs(t, reqs, slots, false);
    assert_eq!(
        batched_outputs(t, reqs, slots, true),
        eager,
        "fixed-capacity steps, {slots} slots"
    );
    for (i, r) in reqs.iter().enumerate() {
        let ar = decode(t, None, Mode::Ar, r);
        let b = eager[i].as_ref().unwrap();
        assert_eq!(b.new_tokens, ar.new_tokens, "request {i}, {slots} slots");
        assert_eq!(b.stopped_by_token, ar.stopped_by_token, "request {i}");
    }
}

/// Prompts of 3 … 90 tokens (those of 64 or more prefill with the chunked rule).
fn prompt(i: usize) -> Vec<u32> {
    let base = tiny_prompt();
    let len = [3, 12, 20, 70, 7, 90, 33][i % 7];
    (0..len)
        .map(|j| (base[j % base.len()] + 7 * (j / base.len()) as u32 + i as u32) % 256)
        .collect()
}

#[test]
fn batched_hybrid_equals_sequential_at_t0_and_with_sampling() {
    let t = tiny_hybrid();
    assert!(t.is_hybrid());
    let mut reqs: Vec<Request> = (0..9)
        .map(|i| {
            let seed = 300 + i as u64;
            // greedy; top-p alone (drawn on the host); temperature, top-k with top-p (device)
            let sampling = match i % 4 {
                0 | 2 => SamplingParams::default(),
                1 => SamplingParams::new(0.9, 0.95, 0, seed).unwrap(),
                _ => SamplingParams::new(1.0, 0.9, 20, seed).unwrap(),
            };
            req(&prompt(i), 6 + 9 * i, sampling, &[])
        })
        .collect();
    // a stop token that request 0's greedy continuation produces
    let ar0 = decode(&t, None, Mode::Ar, &reqs[0]);
    reqs[0].stop_ids = vec![ar0.new_tokens[3]];
    for slots in [1, 2, 4, 16] {
        assert_equals_ar(&t, &reqs, slots);
    }
}

/// A long generation (past 64 columns: the front is dropped) beside a prompt longer than the
/// cache (it grows at the front).
#[test]
fn batched_hybrid_survives_front_growth_and_compaction() {
    let t = tiny_hybrid();
    let g = SamplingParams::default();
    let reqs = vec![
        req(&prompt(0), 1, g, &[]),
        req(&prompt(1), 90, g, &[]),
        req(&prompt(5), 20, g, &[]),
        req(&prompt(4), 30, g, &[]),
    ];
    for slots in [1, 2, 3] {
        assert_equals_ar(&t, &reqs, slots);
    }
}

/// The open batch laid out again between steps (grown, a sequence cancelled, shrunk to its
/// live count): every slot's linear-attention state moves with its sequence.
#[test]
fn a_hybrid_batch_resized_between_steps_keeps_every_sequence() {
    let t = tiny_hybrid();
    let reqs: Vec<Request> = (0..5)
        .map(|i| {
            let sampling = match i % 2 {
                0 => SamplingParams::default(),
                _ => SamplingParams::new(0.9, 0.95, 0, 40 + i as u64).unwrap(),
            };
            req(&prompt(i), 12 + 3 * i, sampling, &[])
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
    let more = [(2, &reqs[2]), (3, &reqs[3]), (4, &reqs[4])];
    take(b.admit(&more).unwrap(), &mut out);
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
            3 => assert_eq!(out[3], alone[..out[3].len()], "the cancelled sequence"),
            _ => assert_eq!(ended[i].as_ref().unwrap(), &alone, "request {i}"),
        }
    }
}

/// A speculative session of the hybrid target (a DFlash chain and auto's trees) moved into a
/// batch after a few rounds goes on as AR there, its linear-attention state with it: its tokens
/// are AR's alone, at T = 0 and seeded at T > 0, beside another request in the batch.
#[test]
fn a_hybrid_session_moved_into_a_batch_goes_on_as_ar() {
    use dflash_engine::Session;
    let t = tiny_hybrid();
    let d = dflash_model::models::drafter::Drafter::load_dir(
        &fixtures().join("dflash-tiny/hybrid"),
        &t,
    )
    .unwrap();
    let other = req(&prompt(2), 20, SamplingParams::default(), &[]);
    let modes = [
        Mode::Chain {
            block: d.block_size,
        },
        Mode::Auto {
            block: d.block_size,
            max_budget: 8,
        },
    ];
    for (mode, sampling) in modes.into_iter().zip([
        SamplingParams::default(),
        SamplingParams::new(0.8, 1.0, 0, 5).unwrap(),
    ]) {
        let r = req(&prompt(3), 40, sampling, &[]);
        let ar = decode(&t, None, Mode::Ar, &r);
        let mut s = Session::start(&t, Some(&d), mode, &r, Default::default(), None).unwrap();
        for _ in 0..3 {
            s.round().unwrap();
        }
        let before = s.new_tokens().len();
        let (cache, live) = s.into_live(0).unwrap();
        let mut b = Batch::new(&t, 2, None).unwrap();
        b.adopt(&cache, live).unwrap();
        let first = b.admit(&[(1, &other)]).unwrap();
        let mut out: Vec<Vec<u32>> = vec![ar.new_tokens[..before].to_vec(), vec![first[0].token]];
        while b.live() > 0 {
            for st in b.step().unwrap() {
                out[st.index].push(st.token);
            }
        }
        assert_eq!(out[0], ar.new_tokens, "{mode:?} {sampling:?}");
        assert_eq!(out[1], decode(&t, None, Mode::Ar, &other).new_tokens);
    }
}

/// Prompts of different lengths prefilled together, left-padded (as on a GPU): each sequence's
/// Gated DeltaNet layers start at its first real row, so every response is AR's alone; a
/// prompt long enough for the chunked rule included.
#[test]
fn hybrid_prompts_prefilled_together_equal_ar() {
    let t = tiny_hybrid();
    let reqs: Vec<Request> = (0..6)
        .map(|i| req(&prompt(i), 12 + i, SamplingParams::default(), &[]))
        .collect();
    let mut b = Batch::new(&t, 6, None).unwrap();
    b.set_prefill_chunk(6);
    let all: Vec<(usize, &Request)> = reqs.iter().enumerate().collect();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); reqs.len()];
    for st in b.admit(&all).unwrap() {
        out[st.index].push(st.token);
    }
    while b.live() > 0 {
        for st in b.step().unwrap() {
            out[st.index].push(st.token);
        }
    }
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(
            out[i],
            decode(&t, None, Mode::Ar, r).new_tokens,
            "prompt {i}"
        );
    }
}

/// A batched hybrid cache keeps no rows to roll back to: a speculative verify's rollback on it
/// is refused by name, never silently wrong.
#[test]
fn a_batched_hybrid_cache_refuses_rollback() {
    let t = tiny_hybrid();
    let mut c = t.new_batched_cache(2, 16).unwrap();
    c.grow_front(4).unwrap();
    let e = c.truncate(2).unwrap_err();
    assert!(e.to_string().contains("roll back"), "{e}");
    let e = c.keep_rows(&[0, 1]).unwrap_err();
    assert!(e.to_string().contains("roll back"), "{e}");
}
