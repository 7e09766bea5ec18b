//! CPU inference kernels: weights as panels (AVX-512 or AVX2), the few-rows attention over each
//! row's own keys (AVX-512 or AVX2), vector `exp`, and the helper threads they run on.

pub mod helpers;
pub mod panels;
pub mod q8;
pub mod quant;
pub mod row_attention;
pub mod screen;
pub mod swiglu;
pub(crate) mod vexp;

use std::sync::atomic::{AtomicU8, Ordering};

/// The vector ISA the CPU kernels ([`panels`], [`row_attention`]) run on: AVX-512F where the
/// CPU has it, else AVX2 + FMA + F16C, else none (candle's matmuls).
///
/// `DFLASH_CPU_ISA=avx2` runs the AVX2 kernels on an AVX-512 CPU (`avx512`, `none` likewise;
/// a set the CPU lacks, or another value, keeps the detected one, with a warning), read once;
/// [`Isa::set`] changes it in-process (the tests run every available ISA).
/// Example: on an AVX-512 CPU `DFLASH_CPU_ISA=avx2` → `Isa::detect() == Some(Isa::Avx2)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
}

/// The selected ISA: 0 not chosen yet, 1 none, 2 AVX2, 3 AVX-512.
static SELECTED: AtomicU8 = AtomicU8::new(0);

impl Isa {
    /// The ISAs this CPU runs, best first.
    pub fn available() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("f16c") {
                v.push(Isa::Avx512);
            }
            if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                v.push(Isa::Avx2);
            }
        }
        v
    }

    /// The ISA the kernels run on now (see the type's doc).
    pub fn detect() -> Option<Isa> {
        let code = match SELECTED.load(Ordering::Relaxed) {
            0 => {
                let chosen = Self::from_env();
                let code = Self::code(chosen);
                // the first caller's choice stays (a racing caller computed the same one)
                let _ = SELECTED.compare_exchange(0, code, Ordering::Relaxed, Ordering::Relaxed);
                SELECTED.load(Ordering::Relaxed)
            }
            c => c,
        };
        match code {
            3 => Some(Isa::Avx512),
            2 => Some(Isa::Avx2),
            _ => None,
        }
    }

    /// Run the kernels on `isa` (`None`: candle's paths) from now on; an ISA this CPU lacks is
    /// an error and changes nothing. Between forwards only: a product reads it once.
    pub fn set(isa: Option<Isa>) -> Result<(), String> {
        if let Some(i) = isa {
            if !Self::available().contains(&i) {
                return Err(format!("this CPU does not run the {i:?} kernels"));
            }
        }
        SELECTED.store(Self::code(isa), Ordering::Relaxed);
        Ok(())
    }

    fn code(isa: Option<Isa>) -> u8 {
        match isa {
            Some(Isa::Avx512) => 3,
            Some(Isa::Avx2) => 2,
            None => 1,
        }
    }

    /// `DFLASH_CPU_ISA` where the CPU runs it, else the best available.
    fn from_env() -> Option<Isa> {
        let available = Self::available();
        let best = available.first().copied();
        let Ok(v) = std::env::var("DFLASH_CPU_ISA") else {
            return best;
        };
        let asked = match v.to_ascii_lowercase().as_str() {
            "avx512" | "avx-512" => Some(Isa::Avx512),
            "avx2" => Some(Isa::Avx2),
            "none" | "" => None,
            other => {
                tracing::warn!("DFLASH_CPU_ISA={other}: not avx512, avx2 or none; using {best:?}");
                return best;
            }
        };
        match asked {
            Some(i) if !available.contains(&i) => {
                tracing::warn!("DFLASH_CPU_ISA={v}: this CPU lacks it; using {best:?}");
                best
            }
            a => a,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `DFLASH_CPU_ISA` picks an available ISA, and an unknown value or a set the CPU lacks
    /// keeps the best one; `Isa::set` refuses an ISA the CPU lacks.
    #[test]
    fn the_override_picks_an_available_isa() {
        let available = Isa::available();
        let best = available.first().copied();
        // SAFETY: this test's process (nextest runs each test alone) reads no other variable
        std::env::set_var("DFLASH_CPU_ISA", "avx2");
        let want = available.contains(&Isa::Avx2).then_some(Isa::Avx2).or(best);
        assert_eq!(Isa::from_env(), want);
        std::env::set_var("DFLASH_CPU_ISA", "none");
        assert_eq!(Isa::from_env(), None);
        std::env::set_var("DFLASH_CPU_ISA", "sse9");
        assert_eq!(Isa::from_env(), best);
        std::env::remove_var("DFLASH_CPU_ISA");
        assert_eq!(Isa::from_env(), best);
        if !available.contains(&Isa::Avx512) {
            assert!(Isa::set(Some(Isa::Avx512)).is_err());
        }
        Isa::set(None).unwrap();
        assert_eq!(Isa::detect(), None);
        for isa in available {
            Isa::set(Some(isa)).unwrap();
            assert_eq!(Isa::detect(), Some(isa));
        }
    }
}
