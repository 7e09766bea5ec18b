//! `data generate --gpus N` without GPUs: the ranks' streams (run here one after another on
//! the CPU) merge into the data one process writes, sampled at T > 0 (every prompt seeded by its
//! index in the whole set), a rank not finished yet leaves the merged manifest at the last
//! complete prefix, and directories of the other kind or another partition are refused by name.

use candle_core::DType;
use dflash_core::sampling::SamplingParams;
use dflash_testkit::*;
use dflash_train::data::read_sequences;
use dflash_train::prompts::Prompt;
use dflash_train::regen::{regenerate, RegenOptions};
use dflash_train::regen_ranks::{merge, regenerate_rank, start, Partition};

fn prompts() -> Vec<Prompt> {
    let text: String = (0..10)
        .map(|i| {
            format!(
                "{{\"prompt\": \"t{} t{} t{}\"}}\n",
                3 + i,
                40 + 7 * i,
                200 - i
            )
        })
        .collect();
    let d = tmp("regen-ranks-prompts");
    let f = d.join("p.jsonl");
    std::fs::write(&f, text).unwrap();
    dflash_train::prompts::load(f.to_str().unwrap(), 100).unwrap()
}

#[test]
fn ranks_merge_into_the_one_process_data() {
    let lt = load(&tiny_target_dir("regen-ranks"), DType::F32);
    let ps = prompts();
    assert_eq!(ps.len(), 10);
    let opts = RegenOptions {
        max_new_tokens: 6,
        loop_window: 0,
        sampling: SamplingParams::new(0.8, 1.0, 0, 3).unwrap(),
        prompts_per_shard: 2,
        batch_size: 1,
        cuda_graphs: false,
        time_limit: None,
        source: "p.jsonl".into(),
        target_name: "tiny".into(),
    };
    let one = tmp("regen-one");
    regenerate(&lt, &ps, &one, &opts).unwrap();

    let two = tmp("regen-two");
    let p = Partition {
        world: 2,
        prompts_per_shard: 2,
    };
    start(&two, p).unwrap();
    regenerate_rank(&lt, &ps, &two, &opts, 0).unwrap();
    // rank 1 not run yet: only global shard 0 is complete in order
    assert_eq!(merge(&two).unwrap().shards.len(), 1);
    regenerate_rank(&lt, &ps, &two, &opts, 1).unwrap();
    let m = merge(&two).unwrap();
    assert_eq!(m.shards.len(), 5);
    assert_eq!(m.shards[1].file, "ranks/rank-1/shard-00000.jsonl");
    let (a, b) = (
        read_sequences(&one).unwrap().1,
        read_sequences(&two).unwrap().1,
    );
    assert_eq!(a, b, "the ranks' data differ from one process's");

    // the other kind of directory, another partition: refused by name
    let e = regenerate(&lt, &ps, &two, &opts).unwrap_err().to_string();
    assert!(e.contains("--gpus 2"), "{e}");
    let e = start(&one, p).unwrap_err().to_string();
    assert!(e.contains("one process"), "{e}");
    let e = start(
        &two,
        Partition {
            world: 3,
            prompts_per_shard: 2,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("2 ranks") && e.contains("--gpus 2"), "{e}");
    // a continued run with the same partition goes on (nothing left to do)
    start(&two, p).unwrap();
    regenerate_rank(&lt, &ps, &two, &opts, 1).unwrap();
    assert_eq!(merge(&two).unwrap().shards.len(), 5);
}
