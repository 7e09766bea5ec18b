//! The Gated DeltaNet kernels against their CPU twins: the recurrence over a tree and a chain,
//! the chunked rule over a prefill, a layer's prep and gated norm, a batched AR step.

use candle_core::{DType, Device, Result, Tensor};

use super::{fill, push_rows, KernelCheck};
use crate::ops::gdn_recurrence::RecurrenceDims;

/// The tree of the Gated DeltaNet rows (parents of 8 rows: two branches off the root, a
/// chain of three, a node with two children).
const CHECK_TREE: [Option<usize>; 8] = [
    None,
    Some(0),
    Some(0),
    Some(1),
    Some(3),
    Some(2),
    Some(4),
    Some(4),
];

/// The Qwen3.6-27B layer's head sizes (16 key / 48 value heads of 128).
const SHAPE_27B: RecurrenceDims = dims(16, 48, 128, 128);
/// Small head sizes that are not multiples of 32 (three value heads per key head).
const SMALL: RecurrenceDims = dims(2, 6, 24, 40);
/// Head size 64, three value heads per key head: the tensor-core kernels' small case.
const HEAD64: RecurrenceDims = dims(2, 6, 64, 64);

const fn dims(hk: usize, hv: usize, dk: usize, dv: usize) -> RecurrenceDims {
    RecurrenceDims { hk, hv, dk, dv }
}

/// Packed rows of the gated delta rule (`[n, row_len]`: q, k of unit scale as L2-normalised in
/// the model, v, β in (0, 1), g < 0) and a non-zero state, seeded, on the CPU.
pub(crate) fn gdn_rows(dims: RecurrenceDims, n: usize, seed: u64) -> Result<(Tensor, Tensor)> {
    let (kd, vd) = (dims.hk * dims.dk, dims.hv * dims.dv);
    let qk = (fill(&[n, 2 * kd], seed, 1.0)? / (dims.dk as f64).sqrt())?;
    let v = fill(&[n, vd], seed + 1, 1.0)?;
    let beta = ((fill(&[n, dims.hv], seed + 2, 1.0)? + 1.0)? * 0.5)?;
    let g = ((fill(&[n, dims.hv], seed + 3, 1.0)? - 1.5)? * 0.3)?;
    let rows = Tensor::cat(&[&qk, &v, &beta, &g], 1)?;
    Ok((rows, fill(&[dims.state_len()], seed + 4, 0.5)?))
}

/// The gated delta rule's recurrence at the Qwen3.6-27B layer shape (16 key / 48 value heads
/// of 128) with a smaller one whose value heads are not a multiple of the kernel's 32-column
/// tile: a tree verify keeping every row's state, and a 96-row chain keeping the last (a
/// prefill). `[o, states]` per case, on the CPU.
fn gdn(dev: &Device) -> Result<Vec<Tensor>> {
    use crate::ops::gdn_recurrence::gdn_recurrence;
    let mut out = Vec::new();
    for (dims, seed) in [(SHAPE_27B, 20u64), (SMALL, 30)] {
        let tree = CHECK_TREE.to_vec();
        let chain: Vec<Option<usize>> = (0..96).map(|i: usize| i.checked_sub(1)).collect();
        for (parents, keep) in [(tree, true), (chain, false)] {
            let (rows, init) = gdn_rows(dims, parents.len(), seed)?;
            let (o, st) = gdn_recurrence(
                &rows.to_device(dev)?,
                &init.to_device(dev)?,
                &parents,
                dims,
                keep,
            )?;
            out.push(o.to_device(&Device::Cpu)?);
            out.push(st.to_device(&Device::Cpu)?);
        }
    }
    Ok(out)
}

/// The chunked rule over a prefill at the Qwen3.6-27B layer shape (200 rows: 64 + 64 + 64 + 8)
/// and at the small shape (150 rows), from a non-zero state, with the f32 kernels. `[o, state]`
/// per case, on the CPU.
fn gdn_chunk(dev: &Device) -> Result<Vec<Tensor>> {
    use crate::ops::gdn_chunk::ChunkMath;
    gdn_chunk_cases(dev, ChunkMath::F32, &[(SMALL, 150, 50)])
}

/// The tensor-core (TF32) kernels: the 27B case above, and a short last chunk at head size 64
/// with three value heads per key head (150 rows: 64 + 64 + 22).
fn gdn_chunk_tc(dev: &Device, math: crate::ops::gdn_chunk::ChunkMath) -> Result<Vec<Tensor>> {
    gdn_chunk_cases(dev, math, &[(HEAD64, 150, 51)])
}

/// Three sequences of 150, 64 and 9 rows (head size 64, three value heads per key head) in
/// one launch from their own states, in `math`. `[o, states]`, on the CPU.
fn gdn_chunk_seqs(dev: &Device, math: crate::ops::gdn_chunk::ChunkMath) -> Result<Vec<Tensor>> {
    use crate::ops::gdn_chunk::gdn_chunked_seqs;
    let d = HEAD64;
    let lens = [150usize, 64, 9];
    let (rows, _) = gdn_rows(d, lens.iter().sum(), 52)?;
    let init = fill(&[lens.len(), d.state_len()], 53, 0.5)?;
    let (o, st) = gdn_chunked_seqs(&rows.to_device(dev)?, &init.to_device(dev)?, &lens, d, math)?;
    Ok(vec![
        o.to_device(&Device::Cpu)?,
        st.to_device(&Device::Cpu)?,
    ])
}

/// The 27B-shape prefill (200 rows) then each of `more` (dims, rows, seed), in `math`.
fn gdn_chunk_cases(
    dev: &Device,
    math: crate::ops::gdn_chunk::ChunkMath,
    more: &[(RecurrenceDims, usize, u64)],
) -> Result<Vec<Tensor>> {
    use crate::ops::gdn_chunk::gdn_chunked;
    let mut out = Vec::new();
    for &(dims, n, seed) in std::iter::once(&(SHAPE_27B, 200usize, 40u64)).chain(more) {
        let (rows, init) = gdn_rows(dims, n, seed)?;
        let (o, st) = gdn_chunked(&rows.to_device(dev)?, &init.to_device(dev)?, dims, math)?;
        out.push(o.to_device(&Device::Cpu)?);
        out.push(st.to_device(&Device::Cpu)?);
    }
    Ok(out)
}

/// A Gated DeltaNet layer's prep and gated norm at the Qwen3.6-27B layer shape: a tree of 8 rows
/// over 3 committed conv inputs (K = 4); the norm's gate read from columns of a wider row (the
/// stacked in-projection's form), its output in `out`. `[rows, normed]`, on the CPU.
fn gdn_prep_and_norm(dev: &Device, out: DType) -> Result<Vec<Tensor>> {
    use crate::ops::gdn_prep::{gated_norm, gdn_prep, window_index};
    let d = SHAPE_27B;
    let kk = 4;
    let parents = CHECK_TREE;
    let n = parents.len();
    let c = 2 * d.hk * d.dk + d.hv * d.dv;
    // the committed inputs and the new rows apart, as a decoding step passes them: the new
    // rows and b | a column ranges of wider rows (the stacked in-projection's form)
    let (conv, mixed) = (fill(&[kk - 1, c], 40, 1.0)?, fill(&[n, c + 40], 39, 1.0)?);
    let ba = fill(&[n, 2 * d.hv + 8], 41, 3.0)?;
    let idx = Tensor::from_vec(window_index(&parents, kk), (n, kk), &Device::Cpu)?;
    let consts = Tensor::cat(
        &[
            fill(&[kk * c], 42, 0.5)?,
            fill(&[d.hv], 43, 1.0)?,
            (fill(&[d.hv], 44, 1.0)?.exp()?.neg())?,
        ],
        0,
    )?;
    let on = |t: &Tensor| t.to_device(dev);
    let (mixed, ba) = (
        on(&mixed)?.narrow(1, 0, c)?,
        on(&ba)?.narrow(1, 8, 2 * d.hv)?,
    );
    let bufs = (&on(&conv)?, Some(&mixed));
    let rows = gdn_prep(bufs, &ba, &on(&idx)?, &on(&consts)?, d, kk)?;
    let vd = d.hv * d.dv;
    let o = fill(&[n, vd], 45, 1.0)?;
    let z = fill(&[n, vd + 2 * d.hv], 46, 2.0)?;
    let w = fill(&[d.dv], 47, 1.0)?;
    let z = on(&z)?.narrow(1, 2 * d.hv, vd)?;
    let normed = gated_norm(&on(&o)?, &z, &on(&w)?, 1e-6, out)?;
    [rows, normed]
        .into_iter()
        .map(|t| t.to_dtype(DType::F32)?.to_device(&Device::Cpu))
        .collect()
}

/// A batched AR step of 5 slots at the Qwen3.6-27B layer shape: the prep over each slot's own
/// conv window ([`crate::layers::gdn::slot_windows`]: the buffer's rows past the first slot's
/// window are conv rows, not the zero row) and the recurrence of each slot's row from its own
/// state (one launch, [`crate::ops::gdn_recurrence::gdn_recurrence_seqs`]). `[prep rows, o,
/// states]`, on the CPU.
fn gdn_slots(dev: &Device) -> Result<Vec<Tensor>> {
    use crate::layers::gdn::slot_windows;
    use crate::ops::gdn_prep::gdn_prep;
    use crate::ops::gdn_recurrence::{gdn_recurrence_seqs, NO_PARENT};
    let d = SHAPE_27B;
    let (kk, b) = (4usize, 5usize);
    let c = 2 * d.hk * d.dk + d.hv * d.dv;
    // one buffer of every slot's committed inputs and new rows (the batched prefill's form)
    let buf = fill(&[b * (kk - 1) + b, c], 60, 1.0)?;
    let ba = fill(&[b, 2 * d.hv], 61, 3.0)?;
    let idx = Tensor::from_vec(slot_windows(b, kk), (b, kk), &Device::Cpu)?;
    let consts = Tensor::cat(
        &[
            fill(&[kk * c], 62, 0.5)?,
            fill(&[d.hv], 63, 1.0)?,
            (fill(&[d.hv], 64, 1.0)?.exp()?.neg())?,
        ],
        0,
    )?;
    let on = |t: &Tensor| t.to_device(dev);
    let prepped = gdn_prep(
        (&on(&buf)?, None),
        &on(&ba)?,
        &on(&idx)?,
        &on(&consts)?,
        d,
        kk,
    )?;
    let (rows, _) = gdn_rows(d, b, 65)?;
    let init = fill(&[b, d.state_len()], 66, 0.5)?;
    let none = Tensor::from_vec(vec![NO_PARENT], 1, dev)?;
    let (o, st) = gdn_recurrence_seqs(&on(&rows)?, &on(&init)?, &[None], &none, d, true, b)?;
    [prepped, o, st]
        .into_iter()
        .map(|t| t.to_device(&Device::Cpu))
        .collect()
}

/// A conv window settled in place after a forward at the Qwen3.6-27B layer width (K = 4): one
/// row kept (an AR step), a tree path's last three rows (5, 6, 7 of 8), and two rows (a chain
/// verify keeping rows 0 and 1). The inputs: the first columns of wider rows (the stacked
/// in-projection's form). The windows after each, on the CPU.
fn gdn_settle(dev: &Device) -> Result<Vec<Tensor>> {
    let d = SHAPE_27B;
    let c = 2 * d.hk * d.dk + d.hv * d.dv;
    let inputs = fill(&[8, c + 96], 70, 1.0)?
        .to_device(dev)?
        .narrow(1, 0, c)?;
    let mut out = Vec::new();
    for (tail, seed) in [(vec![0usize], 71u64), (vec![5, 6, 7], 72), (vec![0, 1], 73)] {
        let conv = fill(&[3, c], seed, 1.0)?.to_device(dev)?;
        crate::ops::gdn_settle::settle_conv(&conv, &inputs, &tail)?;
        out.push(conv.to_device(&Device::Cpu)?);
    }
    Ok(out)
}

/// The linear-attention recurrence (f32 state): every output and kept state
pub(super) fn check_gdn(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    let names = [
        "gdn 27B-shape tree o",
        "gdn 27B-shape tree states",
        "gdn 27B-shape chain o",
        "gdn 27B-shape chain last state",
        "gdn small tree o",
        "gdn small tree states",
        "gdn small chain o",
        "gdn small chain last state",
    ];
    let mut got = gdn(dev)?;
    got.extend(gdn_prep_and_norm(dev, DType::F32)?);
    got.extend(gdn_chunk(dev)?);
    got.extend(gdn_slots(dev)?);
    got.extend(gdn_settle(dev)?);
    let mut want = gdn(&Device::Cpu)?;
    want.extend(gdn_prep_and_norm(&Device::Cpu, DType::F32)?);
    want.extend(gdn_chunk(&Device::Cpu)?);
    want.extend(gdn_slots(&Device::Cpu)?);
    want.extend(gdn_settle(&Device::Cpu)?);
    let names: Vec<&str> = names
        .into_iter()
        .chain([
            "gdn prep (27B shape, tree windows, strided new rows)",
            "gdn gated norm (27B shape, gate strided)",
            "gdn chunked 27B-shape prefill o",
            "gdn chunked 27B-shape prefill state",
            "gdn chunked small prefill o",
            "gdn chunked small prefill state",
            "gdn prep, batched step (5 slots' windows)",
            "gdn batched step o (5 slots, one launch)",
            "gdn batched step states (5 slots, one launch)",
            "gdn conv window settled: one row kept",
            "gdn conv window settled: a tree path's last 3 rows",
            "gdn conv window settled: a chain's 2 rows",
        ])
        .collect();
    push_rows(checks, &names, &got, &want, DType::F32, 1e-5)?;
    // the norm written in bf16: each value rounded once (a rounding the two sides take apart
    // differs by one unit in the last place: at most 2^-7 of the value)
    let (got, want) = (
        gdn_prep_and_norm(dev, DType::BF16)?,
        gdn_prep_and_norm(&Device::Cpu, DType::BF16)?,
    );
    let names = ["gdn gated norm written in bf16 (27B shape, gate strided)"];
    push_rows(checks, &names, &got[1..], &want[1..], DType::BF16, 1e-2)?;
    // TF32 products round their inputs to 11 significant bits (unit roundoff 2^-11 ≈ 4.9e-4);
    // the solve and four chunks of state grow that by a small factor
    use crate::ops::gdn_chunk::ChunkMath;
    let names = [
        "gdn chunked, 3 sequences in one launch, o",
        "gdn chunked, 3 sequences in one launch, states",
    ];
    let (got, want) = (
        gdn_chunk_seqs(dev, ChunkMath::F32)?,
        gdn_chunk_seqs(&Device::Cpu, ChunkMath::F32)?,
    );
    push_rows(checks, &names, &got, &want, DType::F32, 1e-5)?;
    let names = [
        "gdn chunked TF32, 3 sequences in one launch, o",
        "gdn chunked TF32, 3 sequences in one launch, states",
        "gdn chunked TF32 27B-shape prefill o",
        "gdn chunked TF32 27B-shape prefill state",
        "gdn chunked TF32 head-64 prefill o (short last chunk)",
        "gdn chunked TF32 head-64 prefill state (short last chunk)",
    ];
    let tf32 = ChunkMath::Tf32;
    let mut got = gdn_chunk_seqs(dev, tf32)?;
    got.extend(gdn_chunk_tc(dev, tf32)?);
    let mut want = gdn_chunk_seqs(&Device::Cpu, tf32)?;
    want.extend(gdn_chunk_tc(&Device::Cpu, tf32)?);
    push_rows(checks, &names, &got, &want, DType::F32, 5e-3)?;
    Ok(())
}
