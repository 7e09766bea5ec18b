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
/// [`Isa::with`] changes it for one call on one thread (the tests run every available ISA; a
/// product's helper threads run the ISA its caller read).
/// Example: on an AVX-512 CPU `DFLASH_CPU_ISA=avx2` → `Isa::detect() == Some(Isa::Avx2)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
}

/// The selected ISA: 0 not chosen yet, 1 none, 2 AVX2, 3 AVX-512.
static SELECTED: AtomicU8 = AtomicU8::new(0);

thread_local! {
    /// This thread's ISA ([`Isa::with`]), over [`SELECTED`]; 0: none chosen here.
    static SCOPED: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

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
        let scoped = SCOPED.with(|s| s.get());
        let code = match if scoped != 0 {
            scoped
        } else {
            SELECTED.load(Ordering::Relaxed)
        } {
            0 => {
                let chosen = Self::choose(dflash_core::env::CPU_ISA.get().as_deref());
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

    fn code(isa: Option<Isa>) -> u8 {
        match isa {
            Some(Isa::Avx512) => 3,
            Some(Isa::Avx2) => 2,
            None => 1,
        }
    }

    /// `f()` with the kernels on `isa` on this thread, then this thread's ISA as it was (also
    /// when `f` panics); an ISA this CPU lacks is an error and runs nothing.
    pub fn with<T>(isa: Option<Isa>, f: impl FnOnce() -> T) -> Result<T, String> {
        if let Some(i) = isa {
            if !Self::available().contains(&i) {
                return Err(format!("this CPU does not run the {i:?} kernels"));
            }
        }
        struct Restore(u8);
        impl Drop for Restore {
            fn drop(&mut self) {
                SCOPED.with(|s| s.set(self.0));
            }
        }
        let _restore = Restore(SCOPED.with(|s| s.replace(Self::code(isa))));
        Ok(f())
    }

    /// The ISA asked for (`DFLASH_CPU_ISA`'s value) where the CPU runs it, else the best
    /// available.
    fn choose(asked: Option<&str>) -> Option<Isa> {
        let available = Self::available();
        let best = available.first().copied();
        let Some(v) = asked else {
            return best;
        };
        let asked = match v.to_ascii_lowercase().as_str() {
            "avx512" | "avx-512" => Some(Isa::Avx512),
            "avx2" => Some(Isa::Avx2),
            "none" | "" => None,
            other => {
                tracing::warn!(
                    "{}={other}: not avx512, avx2 or none; using {best:?}",
                    dflash_core::env::CPU_ISA.name
                );
                return best;
            }
        };
        match asked {
            Some(i) if !available.contains(&i) => {
                tracing::warn!(
                    "{}={v}: this CPU lacks it; using {best:?}",
                    dflash_core::env::CPU_ISA.name
                );
                best
            }
            a => a,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `DFLASH_CPU_ISA`'s value picks an available ISA, and an unknown value or a set the CPU
    /// lacks keeps the best one; `Isa::with` refuses an ISA the CPU lacks and scopes the rest.
    #[test]
    fn the_override_picks_an_available_isa() {
        let available = Isa::available();
        let best = available.first().copied();
        let want = available.contains(&Isa::Avx2).then_some(Isa::Avx2).or(best);
        assert_eq!(Isa::choose(Some("avx2")), want);
        assert_eq!(Isa::choose(Some("none")), None);
        assert_eq!(Isa::choose(Some("sse9")), best);
        assert_eq!(Isa::choose(None), best);
        if !available.contains(&Isa::Avx512) {
            assert!(Isa::with(Some(Isa::Avx512), || ()).is_err());
        }
        let before = Isa::detect();
        assert_eq!(Isa::with(None, Isa::detect).unwrap(), None);
        for isa in available {
            assert_eq!(Isa::with(Some(isa), Isa::detect).unwrap(), Some(isa));
        }
        assert_eq!(Isa::detect(), before);
    }
}
