//! The projection's tests: stacking, the few rows' path and training's written backward
//! against candle's matmul, a quantized layer's weight held once.

use super::few_rows::{avx2_fma, few_rows_path};
use super::forward::tracked_matmul_t;
use super::*;
use candle_core::Module;

/// Stacking needs plain weights on a GPU: on the CPU (panels, or f32 tensors) nothing is
/// stacked and the layers keep their own weights.
#[test]
fn stacking_is_for_gpu_weights_only() {
    let w = |o: usize| Tensor::ones((o, 8), DType::F32, &Device::Cpu).unwrap();
    let (a, b) = (Linear::new(w(4), None), Linear::new(w(2), None));
    assert!(Linear::stack(&[&a, &b]).unwrap().is_none());
    assert!(Linear::stack(&[]).unwrap().is_none());
}

fn reference(x: &Tensor, w: &Tensor) -> Tensor {
    let k = w.dim(1).unwrap();
    let lead = x.dims()[..x.rank() - 1].to_vec();
    let rows: usize = lead.iter().product();
    let y = x
        .reshape((rows, k))
        .unwrap()
        .matmul(&w.t().unwrap())
        .unwrap();
    let mut shape = lead;
    shape.push(w.dim(0).unwrap());
    y.reshape(shape).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    crate::ops::compare::max_abs(a, b).unwrap()
}

/// `matmul_t`'s AVX2 path and `Linear` (the panels on an AVX-512 or AVX2 CPU) = candle's matmul:
/// rows 1..=33 (tiles of 4, the rest single rows; 33 is over the AVX2 path's limit), weight
/// rows not a multiple of 2 or 16 (leftover columns), widths not a multiple of 8 (the tails).
#[test]
fn few_rows_equal_candles_matmul() {
    let dev = Device::Cpu;
    for &(n, k) in &[(37usize, 21usize), (64, 576), (5, 8)] {
        let w = Tensor::randn(0f32, 1., (n, k), &dev).unwrap();
        for rows in [1usize, 2, 3, 4, 5, 7, 16, 32, 33] {
            let x = Tensor::randn(0f32, 1., (1, rows, k), &dev).unwrap();
            let direct = rows <= FEW_ROWS && avx2_fma();
            assert_eq!(few_rows_path(&x, &w, rows), direct);
            let want = reference(&x, &w);
            let got = matmul_t(&x, &w).unwrap();
            assert_eq!(got.dims(), &[1, rows, n]);
            let tol = 1e-4 * (k as f32).sqrt();
            assert!(max_diff(&got, &want) < tol, "n {n} k {k} rows {rows}");
            // Linear: the panels where the CPU runs them, else the same as matmul_t
            let got = Linear::new(w.clone(), None).forward(&x).unwrap();
            assert_eq!(got.dims(), &[1, rows, n]);
            let err = max_diff(&got, &want);
            assert!(err < tol, "Linear n {n} k {k} rows {rows}: {err}");
        }
    }
}

/// Gradients still flow: a tracked input takes candle's matmul.
#[test]
fn tracked_inputs_take_candles_matmul() {
    let dev = Device::Cpu;
    let w = candle_core::Var::randn(0f32, 1., (6, 8), &dev).unwrap();
    let x = Tensor::randn(0f32, 1., (2, 8), &dev).unwrap();
    assert!(!few_rows_path(&x, w.as_tensor(), 2));
    let g = matmul_t(&x, w.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let dw = g.get(w.as_tensor()).unwrap();
    // d/dW of Σ x·Wᵀ = column sums of x, for every weight row
    let want = x.sum_keepdim(0).unwrap().broadcast_as((6, 8)).unwrap();
    let err = (dw - want).unwrap().abs().unwrap().max_all().unwrap();
    assert!(err.to_scalar::<f32>().unwrap() < 1e-5);
}

/// A layer that streams quantized panels holds no f32 weight, and still gives it: `weight()`
/// (dequantized from the panels), `select_rows` (its Q8_0 blocks, the same bits as the full
/// layer's columns)
/// and a tracked input's forward (candle's matmul of the dequantized weight).
#[test]
fn a_quantized_layer_holds_its_weight_once() {
    use crate::cpu::quant::{QuantKind, Q8_0_BYTES};
    let (n, k) = (20usize, 64usize);
    let bytes: Vec<u8> = (0..n * k / 32 * Q8_0_BYTES)
        .map(|i| match i % Q8_0_BYTES {
            0 => 0x00,
            1 => 0x2c, // d = 0.0625
            j => (j * 37 + i / Q8_0_BYTES) as u8,
        })
        .collect();
    let q = QuantBlocks::new(QuantKind::Q8_0, n, k, bytes).unwrap();
    let values: Vec<f32> = (0..n * k).map(|i| q.value(i / k, i % k)).collect();
    let dense = Tensor::from_vec(values.clone(), (n, k), &Device::Cpu).unwrap();
    let l = Linear::from_blocks(&q, None, || Ok(dense.clone())).unwrap();
    if !Panels::supported() {
        return; // no panels on this CPU: the dense layer
    }
    assert!(l.is_quantized() && l.weight.is_none());
    let w: Vec<f32> = l
        .weight()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!(w
        .iter()
        .zip(&values)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let x = Tensor::randn(0f32, 1., (3, k), &Device::Cpu).unwrap();
    let full: Vec<Vec<f32>> = l.forward(&x).unwrap().to_vec2().unwrap();
    let ids = [7u32, 0, 19];
    let sel = l.select_rows(&ids).unwrap();
    // the rows keep their Q8_0 blocks: one panel of 16 columns, 32 + 32 × 16 bytes per block
    assert!(sel.is_quantized() && sel.weight_bytes_held() == k / 32 * (32 + 32 * 16));
    let part: Vec<Vec<f32>> = sel.forward(&x).unwrap().to_vec2().unwrap();
    for (fr, pr) in full.iter().zip(&part) {
        for (j, &id) in ids.iter().enumerate() {
            assert_eq!(fr[id as usize].to_bits(), pr[j].to_bits());
        }
    }
    assert!(l.select_rows(&[20]).is_err());
    let v = candle_core::Var::from_tensor(&x).unwrap();
    let tracked = l.forward(v.as_tensor()).unwrap();
    assert!(max_diff(&tracked, &reference(&x, &dense)) < 1e-4);
}

/// A non-contiguous input (a narrow of the middle columns) is made contiguous first.
#[test]
fn strided_input() {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 1., (9, 16), &dev).unwrap();
    let big = Tensor::randn(0f32, 1., (3, 20), &dev).unwrap();
    let x = big.narrow(1, 2, 16).unwrap();
    let err = (matmul_t(&x, &w).unwrap() - reference(&x.contiguous().unwrap(), &w))
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap();
    assert!(err.to_scalar::<f32>().unwrap() < 1e-4);
}

/// The GPU's training path (one node, written backward) gives candle's autograd's
/// gradients, for a 3-d input and both inputs tracked (run here on the CPU).
#[test]
fn tracked_path_has_candles_gradients() {
    let dev = Device::Cpu;
    let var = |t: Tensor| candle_core::Var::from_tensor(&t).unwrap();
    let x = var(Tensor::randn(0f32, 1., (2, 5, 7), &dev).unwrap());
    let w = var(Tensor::randn(0f32, 1., (3, 7), &dev).unwrap());
    let up = Tensor::randn(0f32, 1., (2, 5, 3), &dev).unwrap();
    let grads = |y: Tensor| {
        let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        (
            g.get(x.as_tensor()).unwrap().clone(),
            g.get(w.as_tensor()).unwrap().clone(),
        )
    };
    let ours = tracked_matmul_t(x.as_tensor(), w.as_tensor(), 10, 7, vec![2, 5, 3]).unwrap();
    let want = x
        .as_tensor()
        .broadcast_matmul(&w.as_tensor().t().unwrap())
        .unwrap();
    assert!(max_diff(&ours, &want) < 1e-5);
    let (a, b) = (grads(ours), grads(want));
    assert_eq!(a.0.dims(), &[2, 5, 7]);
    assert!(max_diff(&a.0, &b.0) < 1e-5 && max_diff(&a.1, &b.1) < 1e-5);
    // one operand frozen: the other's gradient alone
    let frozen = w.as_tensor().detach();
    let y = tracked_matmul_t(x.as_tensor(), &frozen, 10, 7, vec![2, 5, 3]).unwrap();
    let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(max_diff(g.get(x.as_tensor()).unwrap(), &b.0) < 1e-5);
    let y = tracked_matmul_t(&x.as_tensor().detach(), w.as_tensor(), 10, 7, vec![2, 5, 3]);
    let g = (y.unwrap() * &up)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(max_diff(g.get(w.as_tensor()).unwrap(), &b.1) < 1e-5);
}
