//! The integer products' tests: the module doc's example, the quantizer against its scalar
//! twin, the scoped choice, zeros and non-finite inputs.

#[cfg(target_arch = "x86_64")]
use super::quantize::quantize_block_avx2;
use super::*;

/// The module doc's example: the rule's `q`, `d`, `s` and the Q8_0 column's output.
#[test]
fn the_module_example() {
    let mut x = vec![0f32; QB];
    x[..3].copy_from_slice(&[0.5, -1.0, 0.25]);
    let a = quantize_rows(&x, 1, QB);
    assert_eq!(&a.q[..4], &[64, -127, 32, 0]);
    assert_eq!((a.d[0], a.s[0], a.qsum[0]), (1.0 / 127.0, -0.25, -31));
    let mut panel = vec![0u8; Q80_BLOCK];
    let mut w = [0i32; QB];
    w[..3].copy_from_slice(&[2, 1, -4]);
    IntKind::Signed.put(&mut panel, 0, [0.5; 2], 0.0, &w);
    // the other 15 columns: all weights 0 (byte 128)
    for c in 1..16 {
        IntKind::Signed.put(&mut panel, c, [0.0; 2], 0.0, &[0; QB]);
    }
    let mut y = vec![f32::NAN; 16];
    block_scalar(IntKind::Signed, &a, 0, 1, &panel, &mut y, 16, 16);
    assert_eq!(y[0], -0.5);
    assert!(y[1..].iter().all(|&v| v == 0.0));
}

/// The AVX2 quantizer gives the scalar twin's bits: random blocks of several scales, ties
/// (x · (1/d) = k + 0.5), zeros, infinities and NaNs.
#[test]
fn the_quantizer_equals_its_scalar_twin() {
    let mut seed = 3u32;
    let mut next = || {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (seed >> 8) as f32 / 16_777_216.0 - 0.5
    };
    let mut blocks: Vec<Vec<f32>> = (0..200)
        .map(|b| (0..QB).map(|_| next() * 10f32.powi(b % 7 - 3)).collect())
        .collect();
    // a = 127 → d = 1: 0.5, 1.5, 2.5, −0.5 are ties
    let mut ties = vec![0f32; QB];
    ties[..5].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -0.5]);
    blocks.push(ties);
    blocks.push(vec![0.0; QB]);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut b = blocks[0].clone();
        b[17] = bad;
        blocks.push(b);
    }
    for x in &blocks {
        let (mut q1, mut q2) = ([0i8; QB], [1i8; QB]);
        let a = quantize_block_scalar(x, &mut q1);
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 checked; 32 values
            let b = unsafe { quantize_block_avx2(x, &mut q2) };
            assert_eq!(q1, q2, "{x:?}");
            assert_eq!(
                (a.0.to_bits(), a.1.to_bits(), a.2),
                (b.0.to_bits(), b.1.to_bits(), b.2),
                "{x:?}"
            );
        }
    }
    let mut q = [0i8; QB];
    quantize_block_scalar(&blocks[200], &mut q);
    assert_eq!(&q[..5], &[127, 0, 2, 2, 0]);
}

/// [`with_choice`] decides for its call only, on its thread only, and keeps f32 panels.
#[test]
fn a_scoped_choice_is_this_threads_and_ends_with_its_scope() {
    let at = |p| RuntimeConfig {
        cpu_products: p,
        ..runtime::current()
    };
    runtime::with_config(at(CpuProducts::Exact), || {
        assert!(!enabled());
        assert!(with_choice(true, enabled));
        assert!(!enabled());
        // another thread sees the process's choice, not this thread's scoped one
        with_choice(true, || {
            assert!(enabled());
            let process = runtime::installed().cpu_products == CpuProducts::Q8;
            assert_eq!(std::thread::spawn(enabled).join().unwrap(), process);
        });
        // a panic inside the scope restores the choice before it
        let _ = std::panic::catch_unwind(|| with_choice(true, || panic!("inside the scope")));
        assert!(!enabled());
    });
    runtime::with_config(at(CpuProducts::Q8), || {
        assert!(!with_choice(false, enabled))
    });
    runtime::with_config(at(CpuProducts::F32), || {
        assert_eq!(
            with_choice(false, runtime::current).cpu_products,
            CpuProducts::F32
        );
    });
}

/// Zero rows give zero scales and products; a non-finite input makes its block's scale
/// NaN; `q` stays within ±127.
#[test]
fn zeros_and_non_finite_inputs() {
    let mut x = vec![0f32; 2 * QB];
    x[QB] = f32::INFINITY;
    x[QB + 1] = -3.0;
    let a = quantize_rows(&x, 1, 2 * QB);
    assert_eq!((a.d[0], a.qsum[0]), (0.0, 0));
    assert!(a.d[1].is_nan());
    let x: Vec<f32> = (0..QB).map(|i| (i as f32 - 16.0) * 1e3).collect();
    let a = quantize_rows(&x, 1, QB);
    assert!(a.q.iter().all(|&q| (-127..=127).contains(&q)));
    assert_eq!(a.q[0], -127);
}
