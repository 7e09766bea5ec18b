//! Comparing two tensors: the numbers every parity check reports (device checks, the doctor,
//! the tests). Both sides are read on the host, flattened, in f32 (f64 when either is f64, so
//! gradient checks keep their precision), so a `[1, n, h]` tensor compares with its `[n, h]`
//! twin and a GPU tensor with a CPU one.
//! Example: a = [1.0, 2.0], b = [1.0, 2.5] → max_abs 0.5, rel_err 0.5 / 2.5 = 0.2.

use candle_core::{DType, Device, Result, Tensor};

fn host(t: &Tensor, dt: DType) -> Result<Tensor> {
    t.to_dtype(dt)?.to_device(&Device::Cpu)?.flatten_all()
}

fn wide(a: &Tensor, b: &Tensor) -> DType {
    if a.dtype() == DType::F64 || b.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// `max |t|` over all elements.
fn max_magnitude(t: &Tensor, dt: DType) -> Result<f64> {
    host(t, dt)?
        .abs()?
        .max(0)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()
}

/// Every value of `t`, flattened, as f64 (for assertions).
pub fn values_f64(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()
}

/// Every f32 value of `t` (on the host), flattened, as its bits: what bit-exactness
/// assertions compare.
pub fn bits_f32(t: &Tensor) -> Result<Vec<u32>> {
    Ok(host(t, DType::F32)?
        .to_vec1::<f32>()?
        .iter()
        .map(|v| v.to_bits())
        .collect())
}

/// `max |a - b|` over all elements.
pub fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    let dt = wide(a, b);
    let d = (host(a, dt)? - host(b, dt)?)?;
    Ok(max_magnitude(&d, dt)? as f32)
}

/// `max |a - b| / max |b|` (the scale floored at 1e-12).
pub fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    let scale = max_magnitude(b, wide(a, b))? as f32;
    Ok(max_abs(a, b)? / scale.max(1e-12))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example() {
        let a = Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        let b = Tensor::new(&[[1.0f32, 2.5]], &Device::Cpu).unwrap();
        assert_eq!(max_abs(&a, &b).unwrap(), 0.5);
        assert!((rel_err(&a, &b).unwrap() - 0.2).abs() < 1e-7);
    }
}
