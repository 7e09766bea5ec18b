//! Resolve a target by path or alias and load it with its tokenizer.
//!
//! - an alias (`smollm2-135m`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`) names a cached asset under
//!   `$DFLASH_HOME` (default `~/.cache/dflash-rs`), fetched by `scripts/fetch-assets.sh`;
//! - a `.gguf` file;
//! - an HF directory: `config.json`, `model.safetensors` or `model.safetensors.index.json`,
//!   `tokenizer.json`, `tokenizer_config.json`. Vision-language wrappers (text weights under
//!   `model.language_model.*`, config under `text_config`) load the text model only.

use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use dflash_core::config::TargetConfig;

use crate::io::gguf;
use crate::io::tokenizer::TextTokenizer;
use crate::io::weights::TensorStore;
use crate::models::target::Target;

/// Known target aliases: (alias, path under `$DFLASH_HOME`, fetch-assets name).
pub const ALIASES: &[(&str, &str, &str)] = &[
    (
        "smollm2-135m",
        "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2",
    ),
    (
        "qwen2.5-coder-0.5b",
        "models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder",
    ),
    (
        "qwen2.5-coder-1.5b",
        "models/qwen2.5-coder-1.5b/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder-1.5b",
    ),
];

/// The asset cache directory.
pub fn dflash_home() -> PathBuf {
    if let Some(h) = dflash_core::env::HOME.get() {
        return PathBuf::from(h);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    PathBuf::from(home).join(".cache/dflash-rs")
}

/// The drafter that ships for a target alias: `$DFLASH_HOME/drafters/<alias>-b16`, else the
/// `assets/drafters/<alias>-b16` of the checkout the command runs in (the nearest directory at
/// or above the current one that has `assets/drafters`), else that of the checkout the binary
/// was built from. Example: `bundled_drafter("smollm2-135m")` run in `~/dflash-rs/crates/x` →
/// `~/dflash-rs/assets/drafters/smollm2-135m-b16`. The checkout is found at run time first: a
/// build directory shared by several clones may hold a binary compiled in another one.
pub fn bundled_drafter(alias: &str) -> Option<PathBuf> {
    bundled_drafter_places(alias)
        .into_iter()
        .find(|d| d.join("config.json").is_file() && d.join("model.safetensors").is_file())
}

/// Where [`bundled_drafter`] looks, in order (for a message when it finds none).
pub fn bundled_drafter_places(alias: &str) -> Vec<PathBuf> {
    places_from(alias, std::env::current_dir().ok().as_deref())
}

/// [`bundled_drafter_places`] for a command run in `cwd`.
fn places_from(alias: &str, cwd: Option<&Path>) -> Vec<PathBuf> {
    let name = format!("{alias}-b16");
    let checkout = cwd.and_then(|d| {
        d.ancestors()
            .map(|a| a.join("assets/drafters"))
            .find(|a| a.is_dir())
    });
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/drafters");
    // each directory once (the checkout is often the one the binary was built in)
    let mut dirs: Vec<PathBuf> = Vec::new();
    for d in [Some(dflash_home().join("drafters")), checkout, Some(built)]
        .into_iter()
        .flatten()
    {
        let d = d.canonicalize().unwrap_or(d);
        if !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    dirs.into_iter().map(|d| d.join(&name)).collect()
}

/// An alias or a path → the path to load.
pub fn resolve(spec: &str) -> Result<PathBuf> {
    if let Some((_, rel, asset)) = ALIASES.iter().find(|(a, _, _)| *a == spec) {
        let p = dflash_home().join(rel);
        if !p.exists() {
            bail!("target '{spec}' is not in the asset cache ({}): run scripts/fetch-assets.sh {asset}", p.display());
        }
        return Ok(p);
    }
    let p = PathBuf::from(spec);
    if !p.exists() {
        let known: Vec<&str> = ALIASES.iter().map(|a| a.0).collect();
        bail!(
            "target '{spec}' is neither an existing path nor a known alias ({})",
            known.join(", ")
        );
    }
    Ok(p)
}

pub struct LoadedTarget {
    pub target: Target,
    pub tokenizer: TextTokenizer,
    pub source: PathBuf,
    pub format: &'static str,
}

impl fmt::Display for LoadedTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.target.config;
        write!(
            f,
            "loaded {} ({}): architecture {}, {} layers, hidden {}, heads {}/{} (kv), head_dim {}, vocab {}, dtype {:?}, \
             {} tensors used, {} ignored{}",
            self.source.display(),
            self.format,
            self.target.spec.name,
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_kv_heads(),
            c.head_dim(),
            c.vocab_size,
            self.target.dtype,
            self.target.loaded_tensors.len(),
            self.target.ignored_tensors.len(),
            if self.target.ignored_tensors.is_empty() {
                String::new()
            } else {
                let shown: Vec<&str> = self.target.ignored_tensors.iter().take(8).map(|s| s.as_str()).collect();
                format!(" ({}{})", shown.join(", "), if self.target.ignored_tensors.len() > 8 { ", …" } else { "" })
            }
        )
    }
}

/// Config and weights of an HF directory (no tokenizer).
pub fn load_hf_weights(
    dir: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(TargetConfig, TensorStore)> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("reading {}", cfg_path.display()))?;
    let raw: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", cfg_path.display()))?;
    let cfg_value = raw.get("text_config").cloned().unwrap_or(raw);
    let config: TargetConfig = serde_json::from_value(cfg_value)
        .with_context(|| format!("{} is not a supported target config", cfg_path.display()))?;
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.exists() {
        let idx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index)?)
            .with_context(|| format!("parsing {}", index.display()))?;
        let map = idx
            .get("weight_map")
            .and_then(|m| m.as_object())
            .context("index has no weight_map")?;
        let mut shards: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        shards.sort();
        shards.dedup();
        shards.into_iter().map(|s| dir.join(s)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let mut store = TensorStore::from_safetensors(&files, dtype, device)?;
    store.rename_prefix("model.language_model.", "model.");
    Ok((config, store))
}

/// Load a target and its tokenizer from an alias, a GGUF or an HF directory.
pub fn load_target(spec: &str, dtype: DType, device: &Device) -> Result<LoadedTarget> {
    let path = resolve(spec)?;
    if path.is_dir() {
        let (config, store) = load_hf_weights(&path, dtype, device)?;
        let eos = config.eos_ids();
        let tokenizer = TextTokenizer::from_dir(&path, &eos)?;
        let mut target = Target::load(config, &store)?;
        drop(store); // its tensors, before the stacked copies exist
        target.stack_products()?;
        Ok(LoadedTarget {
            target,
            tokenizer,
            source: path,
            format: "safetensors",
        })
    } else {
        let g = gguf::load(&path, dtype, device)?;
        let tokenizer = TextTokenizer::from_gguf(&g.tokenizer)?;
        let mut target = Target::load(g.config, &g.store)?;
        drop(g.store); // its tensors, before the stacked copies exist
        target.stack_products()?;
        Ok(LoadedTarget {
            target,
            tokenizer,
            source: path,
            format: "gguf",
        })
    }
}

/// The identity of a target: sha256 over its weight and config files (GGUF: the file; HF
/// directory: config.json and the safetensors files, in name order). Training data and
/// drafters record it; the doctor and the trainer compare it.
pub fn identity_hash(source: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut files: Vec<PathBuf> = if source.is_dir() {
        std::fs::read_dir(source)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let n = p.file_name().unwrap_or_default().to_string_lossy();
                n == "config.json" || n.ends_with(".safetensors")
            })
            .collect()
    } else {
        vec![source.to_path_buf()]
    };
    files.sort();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for f in files {
        h.update(
            f.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .as_bytes(),
        );
        let mut r = std::fs::File::open(&f).with_context(|| format!("hashing {}", f.display()))?;
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command run inside a checkout finds that checkout's drafters, after the asset cache and
    /// before the checkout the binary was built in; outside any checkout it keeps the other two.
    #[test]
    fn the_bundled_drafter_is_looked_for_in_the_checkout_of_the_current_directory() {
        let t = dflash_testkit::tmp("places");
        std::fs::create_dir_all(t.join("clone/assets/drafters/x-b16")).unwrap();
        std::fs::create_dir_all(t.join("clone/crates/y")).unwrap();
        let inside = places_from("x", Some(&t.join("clone/crates/y")));
        assert_eq!(inside.len(), 3, "{inside:?}");
        let real = |d: PathBuf| d.canonicalize().unwrap_or(d).join("x-b16");
        assert_eq!(inside[0], real(dflash_home().join("drafters")));
        let clone = t.join("clone/assets/drafters").canonicalize().unwrap();
        assert_eq!(inside[1], clone.join("x-b16"));
        let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/drafters");
        assert_eq!(inside[2], real(built));
        let outside = places_from("x", Some(&t));
        assert_eq!(outside.len(), 2, "{outside:?}");
        assert!(!outside.iter().any(|p| p.starts_with(&t)));
    }
}
