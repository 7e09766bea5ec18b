//! A name → tensor store keyed by HF safetensors names, which records which tensors a model
//! used so loading can report what it ignored (vision towers, MTP heads, …).

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use crate::cpu::quant::QuantBlocks;

pub struct TensorStore {
    tensors: HashMap<String, Tensor>,
    /// Weights also held as their GGUF blocks, for the CPU panels to stream
    /// ([`crate::cpu::quant`]).
    quant: HashMap<String, Arc<QuantBlocks>>,
    /// Weights held only as their blocks: [`TensorStore::get`] dequantizes them on demand (a
    /// model that streams them never makes the f32 tensor).
    deferred: BTreeSet<String>,
    used: RefCell<BTreeSet<String>>,
    /// Synthesize missing tensors from this seed (benchmarks of shapes we have no weights for).
    random: Option<u64>,
    pub dtype: DType,
    pub device: Device,
}

/// N(0, std²) values of `shape` (f32, CPU) from a ChaCha8 stream seeded by `seed` and an FNV-1a
/// hash of `name` (Box–Muller, two values per pair of draws): a tensor's values depend on the
/// seed and its name only. Example: `seeded_normal(0, "lm_head.weight", &[4, 3], 0.02)` is the
/// same 12 values on every run.
pub fn seeded_normal(seed: u64, name: &str, shape: &[usize], std: f32) -> Result<Tensor> {
    use rand::{Rng, SeedableRng};
    let key = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ key);
    let n: usize = shape.iter().product();
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let u1: f32 = rng.random::<f32>().max(f32::MIN_POSITIVE);
        let u2: f32 = rng.random();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        v.push(r * c);
        v.push(r * s);
    }
    v.truncate(n);
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

impl TensorStore {
    pub fn new(tensors: HashMap<String, Tensor>, dtype: DType, device: Device) -> Self {
        Self {
            tensors,
            quant: HashMap::new(),
            deferred: BTreeSet::new(),
            used: RefCell::new(BTreeSet::new()),
            random: None,
            dtype,
            device,
        }
    }

    /// A store that makes up every tensor a model asks for, on the device: norm weights are
    /// ones, everything else N(0, 0.02²) from the device RNG seeded with `seed`; optional
    /// tensors (biases, an untied LM head) are absent. For timing model shapes without weights
    /// (e.g. a Qwen3-8B-shaped target); never for anything whose numbers matter. candle's CPU
    /// RNG cannot be seeded, so on the CPU each tensor comes from its own ChaCha8 stream keyed
    /// by the seed and its name ([`seeded_normal`]): the same values on every run, whatever
    /// order a model asks for them in.
    pub fn random(dtype: DType, device: &Device, seed: u64) -> Result<Self> {
        if !device.is_cpu() {
            device.set_seed(seed)?;
        }
        let mut s = Self::new(HashMap::new(), dtype, device.clone());
        s.random = Some(seed);
        Ok(s)
    }

    /// Load every tensor of one or several safetensors files.
    pub fn from_safetensors(
        files: &[impl AsRef<Path>],
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let mut tensors = HashMap::new();
        for f in files {
            let f = f.as_ref();
            let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
            let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
                anyhow::anyhow!("{} is not a valid safetensors file: {e}", f.display())
            })?;
            for (name, view) in st.tensors() {
                let t = convert_view(&view, device)
                    .with_context(|| format!("tensor '{name}' in {}", f.display()))?;
                tensors.insert(name.to_string(), t);
            }
        }
        Ok(Self::new(tensors, dtype, device.clone()))
    }

    /// The store with these weights' quantized blocks ([`TensorStore::quant`]).
    pub fn with_quant(mut self, quant: HashMap<String, Arc<QuantBlocks>>) -> Self {
        self.quant = quant;
        self
    }

    /// The store with weights held only as their blocks (`quant`, not in the tensors): `get`
    /// dequantizes them on demand ([`QuantBlocks::dequantize`], the loader's values).
    pub fn with_deferred(mut self, quant: HashMap<String, Arc<QuantBlocks>>) -> Self {
        for (name, q) in quant {
            self.deferred.insert(name.clone());
            self.quant.insert(name, q);
        }
        self
    }

    /// The quantized blocks of weight `name`, when the store has them, they match `shape` and
    /// streaming is on ([`crate::cpu::quant::streaming`]); the weight then counts as used.
    pub fn quant(&self, name: &str, shape: &[usize]) -> Option<Arc<QuantBlocks>> {
        let q = self
            .quant
            .get(name)
            .filter(|q| [q.n, q.k] == shape && crate::cpu::quant::streaming())
            .cloned();
        if q.is_some() {
            self.used.borrow_mut().insert(name.to_string());
        }
        q
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.deferred.contains(name)
    }

    /// The tensor `name`, in the store's dtype and on its device, checked against `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if let (Some(seed), false) = (self.random, self.tensors.contains_key(name)) {
            self.used.borrow_mut().insert(name.to_string());
            let t = if name.contains("norm") {
                Tensor::ones(shape, DType::F32, &self.device)?
            } else if self.device.is_cpu() {
                seeded_normal(seed, name, shape, 0.02)?
            } else {
                Tensor::randn(0f32, 0.02f32, shape, &self.device)?
            };
            return Ok(t.to_dtype(self.dtype)?);
        }
        if let (false, true, Some(q)) = (
            self.tensors.contains_key(name),
            self.deferred.contains(name),
            self.quant.get(name),
        ) {
            if [q.n, q.k] != shape {
                bail!(
                    "tensor '{name}' has shape {:?}, expected {shape:?}",
                    [q.n, q.k]
                );
            }
            self.used.borrow_mut().insert(name.to_string());
            let t = Tensor::from_vec(q.dequantize(), (q.n, q.k), &Device::Cpu)?;
            return Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?);
        }
        let t = self
            .tensors
            .get(name)
            .with_context(|| format!("missing tensor '{name}'"))?;
        if t.dims() != shape {
            bail!(
                "tensor '{name}' has shape {:?}, expected {:?}",
                t.dims(),
                shape
            );
        }
        self.used.borrow_mut().insert(name.to_string());
        Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?)
    }

    /// The tensor `name` if present (e.g. optional biases).
    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn used(&self) -> Vec<String> {
        self.used.borrow().iter().cloned().collect()
    }

    /// Tensors present in the file(s) that no module took.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.borrow();
        let mut v: Vec<String> = self
            .names()
            .into_iter()
            .filter(|k| !used.contains(k))
            .collect();
        v.sort();
        v
    }

    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tensors.keys().cloned().collect();
        v.extend(self.deferred.iter().cloned());
        v.sort();
        v
    }

    /// Rename keys with `from` as prefix to `to` (e.g. `model.language_model.` → `model.`).
    pub fn rename_prefix(&mut self, from: &str, to: &str) -> usize {
        let keys: Vec<String> = self
            .tensors
            .keys()
            .filter(|k| k.starts_with(from))
            .cloned()
            .collect();
        for k in &keys {
            let t = self.tensors.remove(k).unwrap();
            self.tensors.insert(format!("{to}{}", &k[from.len()..]), t);
        }
        keys.len()
    }
}

fn convert_view(view: &safetensors::tensor::TensorView<'_>, device: &Device) -> Result<Tensor> {
    use safetensors::Dtype as S;
    let shape = view.shape().to_vec();
    let data = view.data();
    let t = match view.dtype() {
        S::F32 => Tensor::from_raw_buffer(data, DType::F32, &shape, device)?,
        S::F16 => Tensor::from_raw_buffer(data, DType::F16, &shape, device)?,
        S::BF16 => Tensor::from_raw_buffer(data, DType::BF16, &shape, device)?,
        S::F64 => Tensor::from_raw_buffer(data, DType::F64, &shape, device)?,
        other => bail!("unsupported safetensors dtype {other:?}"),
    };
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random store on the CPU gives each tensor the same values on every run, whatever
    /// order they are asked for in; another name or seed gives others; the values are N(0, 0.02²)
    /// (mean and standard deviation of 40,000 draws within 3 %·0.02 and 2 %), norms are ones.
    #[test]
    fn random_cpu_tensors_depend_on_seed_and_name_only() {
        let get = |seed: u64, names: &[&str]| -> Vec<Vec<f32>> {
            let s = TensorStore::random(DType::F32, &Device::Cpu, seed).unwrap();
            names
                .iter()
                .map(|n| {
                    s.get(n, &[200, 200])
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                })
                .collect()
        };
        let a = get(7, &["a.weight", "b.weight"]);
        let b = get(7, &["b.weight", "a.weight"]);
        assert_eq!(a[0], b[1]);
        assert_eq!(a[1], b[0]);
        assert_ne!(a[0], a[1]);
        assert_ne!(a[0], get(8, &["a.weight"])[0]);
        let n = a[0].len() as f64;
        let mean = a[0].iter().map(|&x| x as f64).sum::<f64>() / n;
        let sd = (a[0].iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(mean.abs() < 0.03 * 0.02, "mean {mean}");
        assert!((sd / 0.02 - 1.0).abs() < 0.02, "sd {sd}");
        assert!(get(7, &["x.norm.weight"])[0].iter().all(|&x| x == 1.0));
    }
}
