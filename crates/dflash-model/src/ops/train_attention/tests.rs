//! The training attention's tests: the intervals and key tiles against the dense mask, the
//! module's example, the dK/dV work split, misfitting parts refused.

use super::*;
use dflash_core::segments::Segments;
use dflash_core::visibility::{draft_training, draft_training_parts, DraftRule};

/// The kernels' intervals are the dense training mask: row r sees key c exactly when c lies
/// in one of its two intervals, and every such row lies in its key tile's row range (full,
/// sliding-window and causal rules; two packed segments; anchors unsorted).
#[test]
fn intervals_and_key_tiles_cover_the_training_mask() {
    let segs = Segments::from_lengths(&[150, 170]);
    let anchors = [3usize, 40, 149, 77, 155, 200, 260, 300];
    let block = 16;
    let rules = [
        DraftRule::FULL,
        DraftRule {
            sliding_window: Some(50),
            causal: false,
        },
        DraftRule {
            sliding_window: None,
            causal: true,
        },
    ];
    for rule in rules {
        let (c, o) = draft_training_parts(rule, &segs, &anchors, block);
        let dense = draft_training(rule, &segs, &anchors, block);
        let m = segs.len();
        let iv = TrainIntervals::new(&c, &o, block, m, &Device::Cpu).unwrap();
        assert_eq!((iv.n, iv.t), (dense.rows, dense.cols));
        for r in 0..dense.rows {
            let (a, b) = iv.row(r);
            for key in 0..dense.cols {
                let seen = a.contains(&key) || b.contains(&key);
                assert_eq!(seen, dense.get(r, key), "rule {rule:?} row {r} key {key}");
                if seen {
                    assert!(iv.key_rows(key / KEY_TILE).contains(&r));
                }
            }
        }
    }
}

/// The module's example: rows per 64-key tile, and each row's two intervals.
#[test]
fn the_example_holds() {
    let segs = Segments::from_lengths(&[200]);
    let (c, o) = draft_training_parts(DraftRule::FULL, &segs, &[37, 90], 16);
    let iv = TrainIntervals::new(&c, &o, 16, 200, &Device::Cpu).unwrap();
    assert_eq!(iv.row(0), (0..37, 200..216));
    assert_eq!(iv.row(16), (0..90, 216..232));
    assert_eq!(iv.key_rows(0), 0..32);
    assert_eq!(iv.key_rows(1), 16..32);
    assert_eq!(iv.key_rows(2), 0..0);
    assert_eq!(iv.key_rows(3), 0..32);
}

/// The dK/dV kernel's blocks: the doc's Qwen3-8B example (anchors every 4 tokens), and a
/// small layout in one chunk per seen key tile, the unseen tile left out.
#[test]
fn dkv_work_splits_the_seen_tiles() {
    let segs = Segments::from_lengths(&[2048]);
    let anchors: Vec<usize> = (0..512).map(|i| 4 * i).collect();
    let (c, o) = draft_training_parts(DraftRule::FULL, &segs, &anchors, 16);
    let iv = TrainIntervals::new(&c, &o, 16, 2048, &Device::Cpu).unwrap();
    let rows = || (0..iv.t.div_ceil(KEY_TILE)).map(|k| iv.key_rows(k));
    let (chunk, work) = dkv_work(rows(), 4, 8, 2048);
    assert_eq!((chunk, work.len() / 2), (70, 385));
    let first: Vec<u32> = work.chunks(2).filter(|w| w[0] == 0).map(|w| w[1]).collect();
    assert_eq!(first.len(), 15);
    assert_eq!(&first[..3], &[0, 70, 140]);
    assert_eq!(work.chunks(2).filter(|w| w[0] == 40).count(), 1);
    // per K/V head's 1,024 blocks: chunks of 18, 1,081 items
    let (chunk, work) = dkv_work(rows(), 4, 8, 8 * 1024);
    assert_eq!((chunk, work.len() / 2), (18, 1081));

    let segs = Segments::from_lengths(&[200]);
    let (c, o) = draft_training_parts(DraftRule::FULL, &segs, &[37, 90], 16);
    let iv = TrainIntervals::new(&c, &o, 16, 200, &Device::Cpu).unwrap();
    let (chunk, work) = dkv_work((0..4).map(|k| iv.key_rows(k)), 3, 1, DKV_BLOCKS);
    assert_eq!(chunk, 16);
    // tiles 0, 1 and 3 are seen (tile 2, keys 128..192, by no row)
    assert_eq!(work, vec![0, 0, 1, 0, 3, 0]);
}

/// Misfitting parts are refused by name.
#[test]
fn misfitting_parts_are_refused() {
    let segs = Segments::from_lengths(&[40]);
    let (c, o) = draft_training_parts(DraftRule::FULL, &segs, &[5], 16);
    let e = TrainIntervals::new(&c, &o, 8, 40, &Device::Cpu).unwrap_err();
    assert!(e.to_string().contains("do not fit B = 8"), "{e}");
    let e = TrainIntervals::new(&c, &o, 16, 3, &Device::Cpu).unwrap_err();
    assert!(e.to_string().contains("past the 3 context rows"), "{e}");
}
