//! The cache's tests: the buffers a forward writes into, front moves of batched caches.

use super::*;
use candle_core::{DType, Device};

/// A 2-sequence, 1-head, d = 1 cache whose value at (sequence s, column c) is 10·s + c.
fn filled(cols: usize) -> KvCache {
    let mut c = KvCache::new(1);
    let data: Vec<f32> = (0..2)
        .flat_map(|s| (0..cols).map(move |i| (10 * s + i) as f32))
        .collect();
    let t = Tensor::from_vec(data, (2, 1, cols, 1), &Device::Cpu).unwrap();
    c.append(0, &t, &t).unwrap();
    c.commit(cols);
    c
}
fn values(c: &KvCache) -> Vec<Vec<f32>> {
    let (k, v) = c.layer(0).unwrap().unwrap();
    assert_eq!(
        k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        v.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    k.squeeze(3)
        .unwrap()
        .squeeze(1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
}

/// The buffers a forward writes into: append grows them (doubling, the committed rows
/// kept) and `wrote` returns the `len + n` rows; the fixed layout refuses rows past its
/// capacity and buffers of another size, naming them.
#[test]
fn buffers_for_grows_appends_and_checks_fixed_capacities() {
    let mut c = filled(60);
    let (k, _) = c
        .buffers_for(0, (2, 1, 16, 1), DType::F32, &Device::Cpu, None)
        .unwrap();
    assert_eq!(
        k.dims(),
        &[2, 1, 128, 1],
        "60 + 16 rows outgrow 64: doubled"
    );
    let (kw, _) = c.wrote(0, 16, None).unwrap();
    assert_eq!(kw.dims(), &[2, 1, 76, 1]);
    assert_eq!(
        values(&c)[1][59],
        69.0,
        "the committed rows survive the growth"
    );
    let mut f = filled(4);
    f.reserve_exact(8).unwrap();
    let e = f
        .buffers_for(0, (2, 1, 5, 1), DType::F32, &Device::Cpu, Some(8))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("5 rows after 4 do not fit a capacity of 8"),
        "{e}"
    );
    let e = f
        .buffers_for(0, (2, 1, 1, 1), DType::F32, &Device::Cpu, Some(16))
        .unwrap_err()
        .to_string();
    assert!(e.contains("hold 8 rows, not 16"), "{e}");
    let (kf, _) = f
        .buffers_for(0, (2, 1, 4, 1), DType::F32, &Device::Cpu, Some(8))
        .unwrap();
    assert_eq!(kf.dims(), &[2, 1, 8, 1]);
    assert_eq!(f.wrote(0, 4, Some(8)).unwrap().0.dims(), &[2, 1, 8, 1]);
}

#[test]
fn front_moves_keep_every_sequence_right_aligned() {
    let mut c = filled(4);
    c.drop_front(1).unwrap();
    assert_eq!(values(&c), vec![vec![1., 2., 3.], vec![11., 12., 13.]]);
    c.grow_front(2).unwrap();
    assert_eq!(
        values(&c),
        vec![vec![0., 0., 1., 2., 3.], vec![0., 0., 11., 12., 13.]]
    );
    // a sequence prefilled elsewhere moves into slot 0, ending at the last column
    let src = filled(3);
    c.copy_sequence(0, 3, &src, 1, 1, 2).unwrap();
    assert_eq!(
        values(&c),
        vec![vec![0., 0., 1., 11., 12.], vec![0., 0., 11., 12., 13.]]
    );
    assert!(c.copy_sequence(0, 4, &src, 1, 1, 2).is_err());
}

/// Front moves within the buffers keep them (a captured CUDA graph reads them); a grow past
/// them reallocates, keeping every sequence right-aligned.
#[test]
fn front_moves_stay_in_place_within_the_capacity() {
    let mut c = filled(4);
    assert_eq!(c.capacity().unwrap(), 64);
    c.drop_front(1).unwrap();
    c.grow_front(60).unwrap(); // 3 + 60 ≤ 64
    assert_eq!((c.len(), c.capacity().unwrap()), (63, 64));
    assert_eq!(&values(&c)[1][59..], &[0., 11., 12., 13.]);
    c.grow_front(2).unwrap(); // 65 > 64
    assert_eq!((c.len(), c.capacity().unwrap()), (65, 65));
    assert_eq!(&values(&c)[1][61..], &[0., 11., 12., 13.]);
    assert_eq!(KvCache::new(2).capacity().unwrap(), 0);
}
