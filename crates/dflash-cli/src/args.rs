//! Argument groups shared by several subcommands.

use anyhow::Result;
use clap::Args;
use dflash_core::sampling::SamplingParams;

/// An `--out` that a command writes whole: anything already there is refused by name unless
/// `--force` replaces it.
pub const OUT_REPLACEABLE: dflash_model::io::outputs::Output<'static> =
    dflash_model::io::outputs::Output {
        flag: "--out",
        own: &dflash_model::io::outputs::nothing_own,
        forceable: true,
    };

/// The target's sampling rule (greedy by default).
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f64,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f64,
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub top_k: i64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// Checked parameters: temperature >= 0, top-p in (0, 1], top-k >= 0.
    pub fn params(&self) -> Result<SamplingParams> {
        Ok(SamplingParams::new(
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
        )?)
    }
}

/// Where and in which precision the target runs.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// How the CPU multiplies GGUF weights: `exact` (f32 multiply-adds: the f32 path's bits) or
    /// `q8` (each input row quantized to 8 bits per block of 32, integer products as llama.cpp's;
    /// faster, near the f32 outputs; an LM head keeps the exact arg-max) or `f32` (the weights
    /// dequantized once into f32 panels: the reference of comparisons). Default:
    /// `DFLASH_CPU_QUANT`, else exact.
    #[arg(long, value_parser = ["exact", "q8", "f32"])]
    pub cpu_products: Option<String>,
}

/// How a drafter multiplies on the CPU (its products are chosen apart from the target's).
#[derive(Args, Debug, Clone)]
pub struct DraftProducts {
    /// How the CPU multiplies the drafter's weights: `q8` (8-bit rows against Q8_0 blocks of
    /// its weights, integer products: a round's draft ≈ 30 % cheaper) or `exact` (f32
    /// multiply-adds). The drafter only proposes, so its products can move τ but never the
    /// output, which is the target's either way. On a GPU the drafter runs as the target does.
    #[arg(long, value_parser = ["exact", "q8"], default_value = "q8")]
    pub draft_products: String,
}

impl DraftProducts {
    /// [`DraftProducts::load`], saying on stderr what was loaded and any notes of the loader.
    pub fn load_noted(
        &self,
        dir: &std::path::Path,
        target: &dflash_model::Target,
    ) -> Result<dflash_model::models::drafter::Drafter> {
        let d = self.load(dir, target)?;
        eprintln!(
            "loaded drafter {}: {} layers, block {}, taps {:?}, mask token {}",
            dir.display(),
            d.num_layers(),
            d.block_size,
            d.target_layer_ids,
            d.mask_token_id
        );
        for n in &d.notes {
            eprintln!("note: {n}");
        }
        Ok(d)
    }

    /// The drafter in `dir` for `target`, its CPU weights laid out for these products.
    pub fn load(
        &self,
        dir: &std::path::Path,
        target: &dflash_model::Target,
    ) -> Result<dflash_model::models::drafter::Drafter> {
        dflash_model::cpu::q8::with_choice(self.draft_products == "q8", || {
            dflash_model::models::drafter::Drafter::load_dir(dir, target)
        })
    }
}

/// `--cuda-graphs` on a CPU: say that the fixed-shape forwards run without graphs (the same
/// tokens, no speed-up).
pub fn note_cuda_graphs(on: bool, device: &candle_core::Device) {
    if on && device.is_cpu() {
        eprintln!("--cuda-graphs on the CPU: fixed-shape forwards without graphs (same output, no speed-up)");
    }
}

impl DeviceArgs {
    /// The dtype and the device (opened; phase profiling synchronises it).
    pub fn parse(&self) -> Result<(candle_core::DType, candle_core::Device)> {
        if let Some(p) = &self.cpu_products {
            use dflash_core::runtime::{self, CpuProducts, RuntimeConfig};
            let cpu_products = CpuProducts::parse(p).map_err(anyhow::Error::msg)?;
            runtime::install(RuntimeConfig {
                cpu_products,
                ..runtime::installed()
            });
        }
        let device = dflash_model::device(&self.device)?;
        dflash_model::profile::sync_on(&device);
        Ok((dflash_model::dtype(&self.dtype)?, device))
    }
}

/// The mode and the drafter directory of a decoding command: `--mode` (default: auto where a
/// drafter is given or ships for the target, else ar) and `--drafter` (default for a
/// speculative mode: the drafter that ships for the target). Example: `--target smollm2-135m`
/// alone → auto with the bundled SmolLM2 drafter; `--mode dflash` for a target without one →
/// an error naming where a drafter would be found.
pub fn resolve_drafter(
    target: &str,
    drafter: Option<&std::path::Path>,
    mode: Option<dflash_engine::ModeName>,
) -> Result<(dflash_engine::ModeName, Option<std::path::PathBuf>)> {
    use dflash_engine::ModeName;
    use dflash_model::io::loader::{bundled_drafter, bundled_drafter_places};
    // looked up once: it decides the default mode and, without --drafter, the drafter
    let bundled = match drafter {
        Some(_) => None,
        None => bundled_drafter(target),
    };
    let mode = mode.unwrap_or(match drafter.is_some() || bundled.is_some() {
        true => ModeName::Auto(None),
        false => ModeName::Ar,
    });
    let dir = match (drafter, mode) {
        (Some(d), _) => Some(d.to_path_buf()),
        (None, ModeName::Ar) => None,
        (None, _) => match bundled {
            Some(d) => {
                eprintln!("using the bundled drafter {}", d.display());
                Some(d)
            }
            None => anyhow::bail!(
                "--mode {mode} needs --drafter DIR: no drafter for target '{target}' in {} (a \
                 drafter directory copied to the first of these is found from anywhere)",
                bundled_drafter_places(target)
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        },
    };
    Ok((mode, dir))
}
