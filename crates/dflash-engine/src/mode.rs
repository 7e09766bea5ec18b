//! How each round proposes ([`Mode`]), and the one way a person names it ([`ModeName`]):
//! `ar`, `dflash`, `ddtree:N`, `auto` (`auto:N`: trees of at most N nodes). `generate --mode`, `eval --modes` and `bench decode --modes`
//! all parse through [`ModeName`]'s `FromStr`.
//!
//! Example: `"ddtree:8".parse::<ModeName>()` is `ModeName::Ddtree(8)`, which with the
//! drafter's block 16 is `Mode::Tree { block: 16, budget: 8, top_k: 0 }`; `"ddtree"` and
//! `"ddtree:0"` are refused with the grammar in the message.

use std::fmt;
use std::str::FromStr;

/// How each round proposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Mode {
    /// Plain autoregressive decoding: the same loop with block size 1.
    Ar,
    /// DFlash: the drafter's chain of `block - 1` tokens (its argmax; at T > 0 drawn from its
    /// distribution under `Acceptance::Residual`).
    Chain { block: usize },
    /// DDTree: the best `budget` prefixes of the drafter's `block - 1` distributions, from
    /// the top `top_k` tokens per depth (0: `min(budget, vocab)`, the paper's rule; 1 forces
    /// the argmax chain).
    Tree {
        block: usize,
        budget: usize,
        top_k: usize,
    },
    /// Each round the tree budget from 0 (an AR step) to `max_budget` with the most expected
    /// tokens for its cost here, or no draft while drafting does not pay
    /// ([`dflash_core::auto`]); greedy trees, walked by the exact match at T > 0.
    Auto { block: usize, max_budget: usize },
}

impl Mode {
    /// Rows of a round's draft block (AR: 1).
    pub fn block(&self) -> usize {
        match *self {
            Mode::Ar => 1,
            Mode::Chain { block } | Mode::Tree { block, .. } | Mode::Auto { block, .. } => block,
        }
    }

    /// The name a person uses for it ([`ModeName`]'s form).
    pub fn name(&self) -> String {
        match *self {
            Mode::Ar => "ar".into(),
            Mode::Chain { .. } => "dflash".into(),
            Mode::Tree { budget, .. } => format!("ddtree:{budget}"),
            Mode::Auto { max_budget, .. } => format!("auto:{max_budget}"),
        }
    }
}

/// A mode as a person names it, before a drafter gives it a block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeName {
    Ar,
    Dflash,
    /// DDTree with a node budget (non-root nodes per tree), ≥ 1.
    Ddtree(usize),
    /// The per-round choice, trees of at most this many nodes (`None`: the block's drafts).
    Auto(Option<usize>),
}

impl ModeName {
    /// Whether it needs a drafter.
    pub fn is_speculative(&self) -> bool {
        *self != ModeName::Ar
    }

    /// A comma-separated list: `"ar,dflash,ddtree:8"`.
    pub fn parse_list(s: &str) -> Result<Vec<ModeName>, String> {
        s.split(',').map(str::parse).collect()
    }

    /// The mode with the drafter's `block` (ignored by AR).
    pub fn with_block(self, block: usize) -> Mode {
        match self {
            ModeName::Ar => Mode::Ar,
            ModeName::Dflash => Mode::Chain { block },
            ModeName::Ddtree(budget) => Mode::Tree {
                block,
                budget,
                top_k: 0,
            },
            ModeName::Auto(most) => Mode::Auto {
                block,
                max_budget: most.unwrap_or(block.saturating_sub(1)).max(1),
            },
        }
    }
}

impl FromStr for ModeName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "ar" => Ok(ModeName::Ar),
            "dflash" => Ok(ModeName::Dflash),
            "auto" => Ok(ModeName::Auto(None)),
            x => {
                let n = |p: &str| x.strip_prefix(p).map(str::parse::<usize>);
                match (n("ddtree:"), n("auto:")) {
                    (Some(Ok(n)), _) if n > 0 => Ok(ModeName::Ddtree(n)),
                    (_, Some(Ok(n))) if n > 0 => Ok(ModeName::Auto(Some(n))),
                    _ => Err(format!(
                        "unknown mode '{x}': ar, dflash, ddtree:N (N = the tree's node budget, \
                         >= 1) or auto (auto:N: trees of at most N nodes)"
                    )),
                }
            }
        }
    }
}

impl fmt::Display for ModeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModeName::Ar => write!(f, "ar"),
            ModeName::Dflash => write!(f, "dflash"),
            ModeName::Ddtree(n) => write!(f, "ddtree:{n}"),
            ModeName::Auto(None) => write!(f, "auto"),
            ModeName::Auto(Some(n)) => write!(f, "auto:{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_print_and_take_a_block() {
        for s in ["ar", "dflash", "ddtree:8", "ddtree:512", "auto:4"] {
            let m: ModeName = s.parse().unwrap();
            assert_eq!(m.to_string(), s);
            assert_eq!(m.with_block(16).name(), s);
        }
        assert_eq!(
            "ddtree:8".parse::<ModeName>().unwrap().with_block(16),
            Mode::Tree {
                block: 16,
                budget: 8,
                top_k: 0
            }
        );
        assert_eq!(ModeName::Dflash.with_block(4).block(), 4);
        assert_eq!(
            ModeName::parse_list("ar, dflash,ddtree:4").unwrap(),
            [ModeName::Ar, ModeName::Dflash, ModeName::Ddtree(4)]
        );
        assert!(ModeName::parse_list("ar,ddtree:0").is_err());
        assert_eq!(ModeName::Ar.with_block(16).block(), 1);
        assert_eq!(
            "auto".parse::<ModeName>().unwrap().with_block(16),
            Mode::Auto {
                block: 16,
                max_budget: 15
            }
        );
        assert_eq!("auto".parse::<ModeName>().unwrap().to_string(), "auto");
        for bad in ["ddtree", "ddtree:0", "ddtree:x", "beam", "", "auto:0"] {
            let e = bad.parse::<ModeName>().unwrap_err();
            assert!(e.contains("ddtree:N"), "{bad}: {e}");
        }
    }
}
