//! The runtime configuration as a value: which fused kernels and paths run, how the CPU
//! multiplies a GGUF target's weights, and the tuning integers. Built from the command line over
//! the environment's defaults ([`RuntimeConfig::from_env`], the registry in [`crate::env`]),
//! installed once by the binary ([`install`]), and read by the layers and kernels through
//! [`current`]. A test sets it for its own thread with [`with_config`] and never touches the
//! environment, so tests run side by side in one process.
//!
//! Example: `--disable-kernels gemv,attention` → `KernelPlan::parse("gemv,attention")` → every
//! one-row product and every fused attention kernel take their composed ops; `current()
//! .kernels.off(Kernel::VerifyAttention)` is then true.

use std::cell::Cell;
use std::sync::RwLock;

/// A fused kernel or a fast path that can be turned off to compare it with the composed ops it
/// replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Gemv,
    AddNorm,
    MaskedSoftmax,
    QkvRope,
    IntervalAttention,
    PrefillAttention,
    DecodeAttention,
    VerifyAttention,
    TreeAttention,
    TrainAttention,
    KeepRows,
    RuleSearch,
    TrainTape,
    DraftLastRows,
    OneSync,
    PromptVocab,
}

impl Kernel {
    pub const ALL: [Kernel; 16] = [
        Kernel::Gemv,
        Kernel::AddNorm,
        Kernel::MaskedSoftmax,
        Kernel::QkvRope,
        Kernel::IntervalAttention,
        Kernel::PrefillAttention,
        Kernel::DecodeAttention,
        Kernel::VerifyAttention,
        Kernel::TreeAttention,
        Kernel::TrainAttention,
        Kernel::KeepRows,
        Kernel::RuleSearch,
        Kernel::TrainTape,
        Kernel::DraftLastRows,
        Kernel::OneSync,
        Kernel::PromptVocab,
    ];

    /// Whether it is one of the fused attention kernels, which the name `attention` turns off
    /// together.
    pub fn is_attention(self) -> bool {
        matches!(
            self,
            Kernel::IntervalAttention
                | Kernel::PrefillAttention
                | Kernel::DecodeAttention
                | Kernel::VerifyAttention
                | Kernel::TreeAttention
                | Kernel::TrainAttention
        )
    }

    /// The name on the command line and in `DFLASH_DISABLED_KERNELS`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Gemv => "gemv",
            Kernel::AddNorm => "add-norm",
            Kernel::MaskedSoftmax => "masked-softmax",
            Kernel::QkvRope => "qkv-rope",
            Kernel::IntervalAttention => "interval-attention",
            Kernel::PrefillAttention => "prefill-attention",
            Kernel::DecodeAttention => "decode-attention",
            Kernel::VerifyAttention => "verify-attention",
            Kernel::TreeAttention => "tree-attention",
            Kernel::TrainAttention => "train-attention",
            Kernel::KeepRows => "keep-rows",
            Kernel::RuleSearch => "rule-search",
            Kernel::TrainTape => "train-tape",
            Kernel::DraftLastRows => "draft-last-rows",
            Kernel::OneSync => "one-sync",
            Kernel::PromptVocab => "prompt-vocab",
        }
    }

    /// What runs when it is off.
    pub fn doc(self) -> &'static str {
        match self {
            Kernel::Gemv => "GPU one-row products: candle's matmul",
            Kernel::AddNorm => "GPU residual add with its RMSNorm: the add, then the norm",
            Kernel::MaskedSoftmax => "GPU masked softmax: the mask added, then a softmax",
            Kernel::QkvRope => "GPU per-head norms, RoPE and cache writes: the composed ops",
            Kernel::IntervalAttention => {
                "GPU interval attention of a target's forward: masked products and softmax"
            }
            Kernel::PrefillAttention => "GPU prefill attention: the interval path",
            Kernel::DecodeAttention => "GPU batched one-row decode attention: the interval kernel",
            Kernel::VerifyAttention => {
                "GPU tensor-core verify attention (and the tree kernel): the interval kernel"
            }
            Kernel::TreeAttention => "GPU tree-verify attention: the interval kernel",
            Kernel::TrainAttention => "GPU training attention: the windowed block attention",
            Kernel::KeepRows => "GPU cache compaction kernel: index-select and copy",
            Kernel::RuleSearch => "GPU top-p cut by search: by bisection over the row",
            Kernel::TrainTape => "the drafter's written backward: candle's autograd",
            Kernel::DraftLastRows => {
                "the drafter's last layer on the rows a draft reads: on every block row"
            }
            Kernel::OneSync => "a round's one read of the device: the host's walk",
            Kernel::PromptVocab => "a draft vocabulary with the prompt's tokens: the subset alone",
        }
    }
}

/// Which kernels are off: a set over [`Kernel::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelPlan {
    off: u32,
}

impl KernelPlan {
    /// Every kernel on.
    pub const ALL_ON: KernelPlan = KernelPlan { off: 0 };

    /// Whether `k` is off.
    pub fn off(self, k: Kernel) -> bool {
        self.off & (1 << k as u32) != 0
    }

    /// This plan with `k` off too.
    pub fn without(self, k: Kernel) -> KernelPlan {
        KernelPlan {
            off: self.off | 1 << k as u32,
        }
    }

    /// The plan that turns off the listed names (comma-separated; `attention` names every
    /// fused attention kernel). Example: `"gemv, add-norm"` → those two off; `"gemm"` → an
    /// error listing the names.
    pub fn parse(list: &str) -> Result<KernelPlan, String> {
        let mut plan = KernelPlan::ALL_ON;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "attention" {
                let family = Kernel::ALL.into_iter().filter(|k| k.is_attention());
                plan = family.fold(plan, KernelPlan::without);
                continue;
            }
            let Some(k) = Kernel::ALL.iter().find(|k| k.name() == name) else {
                let names: Vec<_> = Kernel::ALL.iter().map(|k| k.name()).collect();
                return Err(format!(
                    "unknown kernel `{name}`: one of attention, {}",
                    names.join(", ")
                ));
            };
            plan = plan.without(*k);
        }
        Ok(plan)
    }

    /// The names turned off, comma-separated (`parse`'s inverse).
    pub fn names(self) -> String {
        let off: Vec<_> = Kernel::ALL
            .iter()
            .filter(|&&k| self.off(k))
            .map(|k| k.name())
            .collect();
        off.join(",")
    }
}

/// How the CPU multiplies a GGUF target's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuProducts {
    /// The blocks streamed into f32 multiply-adds: the f32 path's bits.
    #[default]
    Exact,
    /// Each input row quantized to 8 bits per block of 32, integer products (as llama.cpp).
    Q8,
    /// The weights dequantized once into f32 panels (the reference of comparisons).
    F32,
}

impl CpuProducts {
    /// `exact`, `q8` or `f32` (`0` is read as `f32`). Example: `"Q8"` → `Q8`.
    pub fn parse(s: &str) -> Result<CpuProducts, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "exact" => Ok(CpuProducts::Exact),
            "q8" => Ok(CpuProducts::Q8),
            "f32" | "0" => Ok(CpuProducts::F32),
            other => Err(format!("unknown CPU products `{other}`: exact, q8 or f32")),
        }
    }
}

/// The tuning integers of the GPU training attention (`None`: the kernels' own defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tuning {
    /// Row × key cells per window of the windowed training attention.
    pub window_cells: Option<usize>,
    /// Blocks the dK/dV kernel aims for.
    pub dkv_blocks: Option<usize>,
}

/// Everything a forward needs to know about how to run, beyond its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RuntimeConfig {
    pub kernels: KernelPlan,
    pub cpu_products: CpuProducts,
    pub tuning: Tuning,
}

impl RuntimeConfig {
    /// The defaults the environment gives ([`crate::env`]); an invalid value is reported and
    /// ignored. Example: `DFLASH_CPU_QUANT=q8` → `cpu_products: Q8`.
    pub fn from_env() -> RuntimeConfig {
        use crate::env;
        let warn = |var: &env::Var, e: String| eprintln!("warning: {}: {e}; ignored", var.name);
        let kernels = env::DISABLED_KERNELS
            .get()
            .map_or(Ok(KernelPlan::ALL_ON), |v| KernelPlan::parse(&v))
            .unwrap_or_else(|e| {
                warn(&env::DISABLED_KERNELS, e);
                KernelPlan::ALL_ON
            });
        let cpu_products = env::CPU_QUANT
            .get()
            .map_or(Ok(CpuProducts::Exact), |v| CpuProducts::parse(&v))
            .unwrap_or_else(|e| {
                warn(&env::CPU_QUANT, e);
                CpuProducts::Exact
            });
        RuntimeConfig {
            kernels,
            cpu_products,
            tuning: Tuning {
                window_cells: env::WINDOW_CELLS.number(),
                dkv_blocks: env::DKV_BLOCKS.number(),
            },
        }
    }
}

/// The process's configuration ([`install`]); `None` until installed or first read.
static INSTALLED: RwLock<Option<RuntimeConfig>> = RwLock::new(None);

thread_local! {
    /// This thread's configuration ([`with_config`]), over the installed one.
    static SCOPED: Cell<Option<RuntimeConfig>> = const { Cell::new(None) };
}

/// Make `config` the process's configuration (the binary does, once its flags are read).
pub fn install(config: RuntimeConfig) {
    *INSTALLED.write().unwrap_or_else(|e| e.into_inner()) = Some(config);
}

/// The configuration in force on this thread: [`with_config`]'s, else [`installed`].
pub fn current() -> RuntimeConfig {
    SCOPED.with(Cell::get).unwrap_or_else(installed)
}

/// The process's configuration: the installed one, else the environment's defaults (read once).
pub fn installed() -> RuntimeConfig {
    if let Some(c) = *INSTALLED.read().unwrap_or_else(|e| e.into_inner()) {
        return c;
    }
    let mut w = INSTALLED.write().unwrap_or_else(|e| e.into_inner());
    *w.get_or_insert_with(RuntimeConfig::from_env)
}

/// Whether `k` is off in the configuration in force.
pub fn off(k: Kernel) -> bool {
    current().kernels.off(k)
}

/// `f()` under `config` on this thread, then this thread's configuration as it was, even if `f`
/// panics. Example: `with_config(RuntimeConfig { cpu_products: CpuProducts::Q8, ..current() },
/// || Drafter::load_dir(dir, &target))` lays the drafter's weights out for integer products.
pub fn with_config<T>(config: RuntimeConfig, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<RuntimeConfig>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SCOPED.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SCOPED.with(|s| s.replace(Some(config))));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_attention_names_the_family() {
        let plan = KernelPlan::parse("gemv, add-norm,").unwrap();
        assert!(plan.off(Kernel::Gemv) && plan.off(Kernel::AddNorm));
        assert!(!plan.off(Kernel::QkvRope));
        assert_eq!(KernelPlan::parse(&plan.names()).unwrap(), plan);
        let att = KernelPlan::parse("attention").unwrap();
        assert_eq!(
            att.names(),
            "interval-attention,prefill-attention,decode-attention,verify-attention,\
             tree-attention,train-attention"
        );
        let every: Vec<_> = Kernel::ALL.iter().map(|k| k.name()).collect();
        let all = KernelPlan::parse(&every.join(",")).unwrap();
        assert!(Kernel::ALL.iter().all(|&k| all.off(k)));
        let err = KernelPlan::parse("gemm").unwrap_err();
        assert!(err.contains("`gemm`") && err.contains("gemv"), "{err}");
    }

    #[test]
    fn products_parse() {
        assert_eq!(CpuProducts::parse("Q8"), Ok(CpuProducts::Q8));
        assert_eq!(CpuProducts::parse("0"), Ok(CpuProducts::F32));
        assert!(CpuProducts::parse("int4").unwrap_err().contains("int4"));
    }

    #[test]
    fn a_scoped_configuration_is_this_threads_and_ends_with_its_scope() {
        let base = current();
        let q8 = RuntimeConfig {
            cpu_products: CpuProducts::Q8,
            kernels: KernelPlan::ALL_ON.without(Kernel::Gemv),
            ..base
        };
        with_config(q8, || {
            assert_eq!(current(), q8);
            assert!(off(Kernel::Gemv));
            // another thread keeps the process's configuration
            std::thread::spawn(move || assert_eq!(current(), base))
                .join()
                .unwrap();
        });
        assert_eq!(current(), base);
        let _ = std::panic::catch_unwind(|| with_config(q8, || panic!("inside the scope")));
        assert_eq!(current(), base);
    }
}
