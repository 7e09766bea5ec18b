//! The layer's tests: the device path against the host path through a prefill, verifies and
//! rollbacks.

use super::*;
use crate::ops::compare::rel_err;
use candle_core::Device;
use std::collections::HashMap;

fn layer(dims: GdnDims, hidden: usize) -> GatedDeltaNet {
    let (c, vd) = (dims.conv_dim(), dims.hv * dims.dv);
    let mut seed = 1u64;
    let mut t = |shape: &[usize], amp: f32| -> Tensor {
        seed += 1;
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.731 + seed as f32 * 1.37).sin()) * amp)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let mut w = HashMap::new();
    for (name, shape, amp) in [
        ("in_proj_qkv.weight", vec![c, hidden], 0.3),
        ("in_proj_z.weight", vec![vd, hidden], 0.3),
        ("in_proj_b.weight", vec![dims.hv, hidden], 0.3),
        ("in_proj_a.weight", vec![dims.hv, hidden], 0.3),
        ("out_proj.weight", vec![hidden, vd], 0.3),
        ("conv1d.weight", vec![c, 1, dims.kernel], 0.5),
        ("A_log", vec![dims.hv], 0.5),
        ("dt_bias", vec![dims.hv], 0.5),
        ("norm.weight", vec![dims.dv], 1.0),
    ] {
        w.insert(format!("l.{name}"), t(&shape, amp));
    }
    let store = TensorStore::new(w, DType::F32, Device::Cpu);
    GatedDeltaNet::load(&store, "l", hidden, dims, 1e-6).unwrap()
}

/// The device path (tensor ops and the recurrence op, here with its CPU twin) equals the
/// host path through a prefill (chunked on the host, the kernel's keep-last mode on the
/// device), a tree verify kept along one path, a chain verify cut short, and the next
/// forward from the rolled-back state.
#[test]
fn device_path_equals_host_path() {
    let dims = GdnDims {
        hk: 2,
        hv: 4,
        dk: 8,
        dv: 12,
        kernel: 4,
    };
    let hidden = 16;
    let l = layer(dims, hidden);
    let x = |n: usize, s: f32| -> Tensor {
        let v: Vec<f32> = (0..n * hidden)
            .map(|i| (i as f32 * 0.37 + s).cos())
            .collect();
        Tensor::from_vec(v, (1, n, hidden), &Device::Cpu).unwrap()
    };
    let chain = |n: usize| -> Vec<Option<usize>> { (0..n).map(|i| i.checked_sub(1)).collect() };
    let mut ch = GdnCache::new(dims, &Device::Cpu);
    let mut cd = GdnCache::new(dims, &Device::Cpu);
    // (rows, their parents, the rows kept afterwards)
    type Step = (Tensor, Vec<Option<usize>>, Option<Vec<usize>>);
    let steps: Vec<Step> = vec![
        (x(20, 0.1), chain(20), None),
        (
            x(5, 0.7),
            vec![None, Some(0), Some(0), Some(1), Some(3)],
            Some(vec![0, 1, 3]),
        ),
        (x(4, 1.3), chain(4), Some(vec![0, 1])),
        (x(3, 2.1), chain(3), None),
    ];
    for (i, (xi, parents, keep)) in steps.iter().enumerate() {
        let oh = l.forward_host(xi, parents, &mut ch, 8).unwrap();
        let rows = GdnRowsInput::new(parents, l.dims.kernel, xi.device()).unwrap();
        let od = l.forward_device(xi, &rows, &mut cd, 8).unwrap();
        let e = rel_err(&od, &oh).unwrap();
        assert!(e <= 1e-5, "forward {i}: rel err {e}");
        if let Some(path) = keep {
            ch.settle_path(path).unwrap();
            cd.settle_path(path).unwrap();
            let (sh, sd) = (ch.committed().unwrap(), cd.committed().unwrap());
            let e = rel_err(&sd.rec, &sh.rec).unwrap();
            assert!(e <= 1e-5, "state after forward {i}: rel err {e}");
            assert_eq!(
                sd.conv.to_vec2::<f32>().unwrap(),
                sh.conv.to_vec2::<f32>().unwrap(),
                "conv window after forward {i}"
            );
        }
    }
}
