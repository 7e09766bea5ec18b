//! The target's rules: causal, tree, padded to a fixed shape, packed sequences and one
//! sequence of a right-aligned batch.

use std::ops::Range;

use super::Visibility;

/// Target rule over `[cache | new rows]`: new row `i` (position `cache_len + i`) sees keys
/// `0 ..= cache_len + i`. Example: cache 3, new 2 → row 0 sees cols 0..=3, row 1 sees 0..=4.
pub fn causal(cache_len: usize, new_len: usize) -> Visibility {
    let mut v = Visibility::new(new_len, cache_len + new_len);
    for r in 0..new_len {
        for c in 0..=cache_len + r {
            v.set(r, c, true);
        }
    }
    v
}

/// [`causal`] as each row's key interval, without the dense matrix: row `i` sees
/// `0 .. cache_len + i + 1`. A slotted cache's rows ([`causal`] over each slot's own columns;
/// a chain's padding rows continue it, unseen by its real rows). Example: cache 3, new 2 →
/// `[0..4, 0..5]`.
pub fn causal_rows(cache_len: usize, new_len: usize) -> Vec<Range<usize>> {
    (0..new_len).map(|i| 0..cache_len + i + 1).collect()
}

/// Tree rule over `[cache | root, node_1 … node_N]`: `parents[i]` is the parent row of tree
/// row `i` (`None` for the root, row 0). Every row sees all cache rows, itself and its
/// ancestors. Example: parents `[None, Some(0), Some(0), Some(1)]` → row 3 sees rows 0, 1, 3.
pub fn tree(cache_len: usize, parents: &[Option<usize>]) -> Visibility {
    let n = parents.len();
    let mut v = Visibility::new(n, cache_len + n);
    for r in 0..n {
        for c in 0..cache_len {
            v.set(r, c, true);
        }
        let mut cur = Some(r);
        while let Some(i) = cur {
            v.set(r, cache_len + i, true);
            cur = parents[i];
        }
    }
    v
}

/// `v` (`[n, cache_len + n]`) padded to `rows` new rows: each padding row sees the cache and
/// itself, like a tree root; no row sees a padding row. The real rows compute exactly what
/// they compute without the padding (a fixed-shape forward pads a short verify to the shape it
/// was captured with, then drops the padding's outputs and rows).
/// Example: cache 2, causal 2 rows padded to 3 → rows 0, 1 as before (cols 0..=2, 0..=3), row 2
/// sees cols 0, 1, 4.
pub fn pad_rows(v: &Visibility, cache_len: usize, rows: usize) -> Visibility {
    padded(v, cache_len, rows, |p, r| {
        for c in 0..cache_len {
            p.set(r, c, true);
        }
        p.set(r, cache_len + r, true);
    })
}

/// `v` (`[n, cache_len + n]`) grown to `rows` new rows, `pad_row` setting padding row r's keys.
fn padded(
    v: &Visibility,
    cache_len: usize,
    rows: usize,
    pad_row: impl Fn(&mut Visibility, usize),
) -> Visibility {
    let n = v.rows;
    let mut p = Visibility::new(rows.max(n), cache_len + rows.max(n));
    for r in 0..n {
        for c in 0..v.cols {
            p.set(r, c, v.get(r, c));
        }
    }
    for r in n..p.rows {
        pad_row(&mut p, r);
    }
    p
}

/// [`pad_rows`] for a chain: each padding row continues the chain (it sees the cache, every
/// new row before it and itself), so that every row of a causal `v` still sees one interval of
/// keys (what the interval attention reads). No real row sees a padding row; the real rows
/// compute exactly what they compute without the padding.
/// Example: cache 2, causal 2 rows padded to 4 → rows 0..4 see cols 0..=2, 0..=3, 0..=4, 0..=5.
pub fn pad_rows_causal(v: &Visibility, cache_len: usize, rows: usize) -> Visibility {
    padded(v, cache_len, rows, |p, r| {
        for c in 0..=cache_len + r {
            p.set(r, c, true);
        }
    })
}

/// Packed rule over `[cache | new rows]` for several independent sequences decoded in one
/// forward (batch data regeneration): every cache row and every new row belongs to one
/// sequence (`cache_owner`, `new_owner`); a new row sees the cache rows of its own sequence and
/// the earlier-or-same new rows of its own sequence, nothing of any other sequence. Within one
/// sequence this is exactly the target rule [`causal`], provided each sequence's rows are
/// appended in position order (they are: prefill, then one row per step).
/// Example: cache owners [0, 0, 1], new owners [0, 1] → row 0 (seq 0) sees cols 0, 1, 3;
/// row 1 (seq 1) sees cols 2, 4.
pub fn packed(cache_owner: &[usize], new_owner: &[usize]) -> Visibility {
    let c = cache_owner.len();
    let mut v = Visibility::new(new_owner.len(), c + new_owner.len());
    for (r, &o) in new_owner.iter().enumerate() {
        for (col, &co) in cache_owner.iter().enumerate() {
            if co == o {
                v.set(r, col, true);
            }
        }
        for (j, &no) in new_owner[..=r].iter().enumerate() {
            if no == o {
                v.set(r, c + j, true);
            }
        }
    }
    v
}

/// Batched rule, for one sequence of a batched cache whose sequences are right-aligned (each
/// sequence's rows end at the last column; the columns before them are padding or an earlier
/// sequence's leftovers): the sequence holds the last `held` of the `cache_len` cache columns,
/// and its new rows are the last `fresh` of the `new_len` new rows (the first
/// `new_len - fresh` are padding). A sequence row sees its sequence's earlier rows and itself,
/// i.e. the target rule [`causal`] on its own rows; a padding row sees only itself (its
/// softmax stays finite, nothing reads it).
/// Examples: held 2, cache 5, fresh 1 of 1 → row 0 sees cols 3, 4, 5.
/// Prefill of a 2-token prompt padded to 4: held 0, cache 0, fresh 2 of 4 → rows 0 and 1 see
/// only themselves, row 2 sees col 2, row 3 sees cols 2, 3.
pub fn right_aligned(held: usize, cache_len: usize, fresh: usize, new_len: usize) -> Visibility {
    let mut v = Visibility::new(new_len, cache_len + new_len);
    for (r, runs) in right_aligned_runs(held, cache_len, fresh, new_len)
        .into_iter()
        .enumerate()
    {
        for c in runs.into_iter().flatten() {
            v.set(r, c, true);
        }
    }
    v
}

/// The rule of [`right_aligned`], written once: each row's visible columns as two runs, its
/// sequence's cache rows and its new rows (a padding row: itself, and an empty cache run).
fn right_aligned_runs(
    held: usize,
    cache_len: usize,
    fresh: usize,
    new_len: usize,
) -> Vec<[Range<usize>; 2]> {
    assert!(
        held <= cache_len && fresh <= new_len,
        "right_aligned: held {held} of {cache_len}, fresh {fresh} of {new_len}"
    );
    let first_new = new_len - fresh;
    (0..new_len)
        .map(|r| {
            if r < first_new {
                [cache_len..cache_len, cache_len + r..cache_len + r + 1]
            } else {
                [
                    cache_len - held..cache_len,
                    cache_len + first_new..cache_len + r + 1,
                ]
            }
        })
        .collect()
}

/// The rows of [`right_aligned`] as their key intervals, without the dense matrix (the
/// batched engine's prefills and steps): `None` when a row sees two runs (a sequence with cache
/// rows, padding rows and new rows: `held > 0` and `0 < fresh < new_len`).
/// Examples: held 2, cache 5, fresh 1 of 1 → `[3..6]`; held 0, cache 0, fresh 2 of 4 →
/// `[0..1, 1..2, 2..3, 2..4]`.
pub fn right_aligned_rows(
    held: usize,
    cache_len: usize,
    fresh: usize,
    new_len: usize,
) -> Option<Vec<Range<usize>>> {
    right_aligned_runs(held, cache_len, fresh, new_len)
        .into_iter()
        .map(|[c, n]| match (c.is_empty(), c.end == n.start) {
            (true, _) => Some(n),
            (false, true) => Some(c.start..n.end),
            (false, false) => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::visibility::*;

    #[test]
    fn causal_padding_continues_the_chain() {
        let p = pad_rows_causal(&causal(2, 2), 2, 4);
        assert_eq!(p, causal(2, 4));
        assert!((0..4).all(|r| p.row_interval(r).is_some()));
        // nothing to pad is the same matrix; the real rows never see the padding
        assert_eq!(pad_rows_causal(&causal(3, 5), 3, 5), causal(3, 5));
        let t = tree(1, &[None, Some(0), Some(0)]);
        let pt = pad_rows_causal(&t, 1, 5);
        for r in 0..3 {
            for c in 0..4 {
                assert_eq!(pt.get(r, c), t.get(r, c));
            }
            assert!(!pt.get(r, 4) && !pt.get(r, 5));
        }
    }

    #[test]
    fn padding_rows_are_roots_no_one_sees() {
        let p = pad_rows(&causal(2, 2), 2, 3);
        let rows: Vec<Vec<usize>> = (0..3)
            .map(|r| (0..5).filter(|&c| p.get(r, c)).collect())
            .collect();
        assert_eq!(rows, vec![vec![0, 1, 2], vec![0, 1, 2, 3], vec![0, 1, 4]]);
        // a tree's rows keep their ancestors; nothing to pad is the same matrix
        let t = tree(1, &[None, Some(0), Some(0)]);
        assert_eq!(pad_rows(&t, 1, 3), t);
        let padded = pad_rows(&t, 1, 5);
        assert_eq!(padded, tree(1, &[None, Some(0), Some(0), None, None]));
    }

    #[test]
    fn packed_sequences_are_isolated_and_causal() {
        let v = packed(&[0, 0, 1], &[0, 1]);
        let row0: Vec<usize> = (0..5).filter(|&c| v.get(0, c)).collect();
        let row1: Vec<usize> = (0..5).filter(|&c| v.get(1, c)).collect();
        assert_eq!(row0, vec![0, 1, 3]);
        assert_eq!(row1, vec![2, 4]);
        // one sequence alone is the target rule
        assert_eq!(packed(&[7, 7, 7], &[7, 7]), causal(3, 2));
        assert_eq!(packed(&[], &[0; 5]), causal(0, 5));
        // a prefill of sequence 2 after two others: causal among its own rows only
        let p = packed(&[0, 1, 0], &[2, 2, 2]);
        for r in 0..3 {
            let cols: Vec<usize> = (0..6).filter(|&c| p.get(r, c)).collect();
            assert_eq!(cols, (3..=3 + r).collect::<Vec<_>>());
        }
    }

    #[test]
    fn right_aligned_is_causal_on_the_sequence_rows() {
        // the docs' examples
        let v = right_aligned(2, 5, 1, 1);
        assert_eq!(
            (0..6).filter(|&c| v.get(0, c)).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        let v = right_aligned(0, 0, 2, 4);
        let seen = |r: usize| (0..4).filter(|&c| v.get(r, c)).collect::<Vec<_>>();
        assert_eq!(
            (0..4).map(seen).collect::<Vec<_>>(),
            vec![vec![0], vec![1], vec![2], vec![2, 3]]
        );
        // with no padding and the whole cache held it is exactly the target rule
        assert_eq!(right_aligned(7, 7, 3, 3), causal(7, 3));
    }

    #[test]
    fn causal_rows_are_the_causal_rule() {
        for (c, n) in [(0, 1), (3, 2), (7, 16)] {
            let v = causal(c, n);
            let rows: Vec<_> = (0..n).map(|r| v.row_interval(r).unwrap()).collect();
            assert_eq!(causal_rows(c, n), rows);
        }
    }

    #[test]
    fn tree_sees_ancestors_only() {
        let v = tree(2, &[None, Some(0), Some(0), Some(1)]);
        let row3: Vec<usize> = (0..6).filter(|&c| v.get(3, c)).collect();
        assert_eq!(row3, vec![0, 1, 2, 3, 5]);
        assert!(causal(3, 2).is_causal());
        assert!(!v.is_causal());
    }

    /// `right_aligned_rows` is `right_aligned` read row by row: the same interval for every row,
    /// and `None` exactly where a row of the dense rule is not one interval.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one row, one interval
    fn right_aligned_rows_are_the_dense_rules_intervals() {
        assert_eq!(right_aligned_rows(2, 5, 1, 1), Some(vec![3..6]));
        assert_eq!(
            right_aligned_rows(0, 0, 2, 4),
            Some(vec![0..1, 1..2, 2..3, 2..4])
        );
        for cache in 0..5 {
            for held in 0..=cache {
                for new in 1..5 {
                    for fresh in 0..=new {
                        let dense = right_aligned(held, cache, fresh, new);
                        let rows: Option<Vec<_>> =
                            (0..new).map(|r| dense.row_interval(r)).collect();
                        assert_eq!(
                            right_aligned_rows(held, cache, fresh, new),
                            rows,
                            "held {held}, cache {cache}, fresh {fresh} of {new}"
                        );
                    }
                }
            }
        }
    }
}
