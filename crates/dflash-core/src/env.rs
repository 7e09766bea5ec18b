//! The environment, read in one place: every `DFLASH_*` variable the project reads is declared
//! here once, with its kind, its default and a sentence, and read through [`Var::get`]. Library
//! code takes its configuration as values ([`crate::runtime::RuntimeConfig`]); the registry only
//! supplies their defaults, and `docs/ENVIRONMENT.md` is [`markdown`] of [`ALL`] (a test keeps it
//! current; another fails on a `DFLASH_` read anywhere else).
//!
//! Example: `DFLASH_DISABLED_KERNELS=gemv,add-norm dflash-rs generate …` runs the composed ops in
//! place of those two fused kernels, as `--disable-kernels gemv,add-norm` does.

/// What a variable holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Set (to anything) or not.
    Flag,
    /// One of a few words.
    Choice(&'static [&'static str]),
    /// A positive whole number.
    Number,
    /// A whole number from 0.
    Index,
    /// A comma-separated list of names.
    List,
    /// A path or an address.
    Text,
}

/// Who sets a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// A user, as an alternative to a command-line flag or to measure a trade-off.
    User,
    /// `dflash-rs train --gpus N` for the ranks it starts.
    Launcher,
    /// The test suite.
    Tests,
}

/// One environment variable: declared once, read through [`Var::get`].
#[derive(Debug)]
pub struct Var {
    pub name: &'static str,
    pub kind: Kind,
    /// The value used when the variable is unset, in words.
    pub default: &'static str,
    pub audience: Audience,
    /// What it does, in a sentence or two.
    pub doc: &'static str,
}

impl Var {
    /// The variable's value, if set (non-UTF-8 values read as unset).
    pub fn get(&self) -> Option<String> {
        std::env::var(self.name).ok()
    }

    /// Whether the variable is set at all.
    pub fn is_set(&self) -> bool {
        std::env::var_os(self.name).is_some()
    }

    /// The value as a positive number; `None` when unset, with a warning when it is not one.
    /// Example: `DFLASH_DKV_BLOCKS=1024` → `Some(1024)`; `=lots` → `None` and a warning.
    pub fn number(&self) -> Option<usize> {
        let v = self.get()?;
        match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Some(n),
            _ => {
                eprintln!(
                    "warning: {}={v} is not a positive number; ignored",
                    self.name
                );
                None
            }
        }
    }
}

pub const HOME: Var = Var {
    name: "DFLASH_HOME",
    kind: Kind::Text,
    default: "~/.cache/dflash-rs",
    audience: Audience::User,
    doc: "Where models, tokenizers and datasets are fetched to and looked up \
          (`scripts/fetch-assets.sh` and every command that resolves an asset name).",
};

pub const CPU_QUANT: Var = Var {
    name: "DFLASH_CPU_QUANT",
    kind: Kind::Choice(&["exact", "q8", "f32"]),
    default: "exact",
    audience: Audience::User,
    doc: "How the CPU multiplies a GGUF target's weights when `--cpu-products` is not given: \
          `exact` streams the blocks into f32 multiply-adds, `q8` into 8-bit integer products, \
          `f32` lays the weights out as f32 panels (a reference for comparisons).",
};

pub const CPU_ISA: Var = Var {
    name: "DFLASH_CPU_ISA",
    kind: Kind::Choice(&["avx512", "avx2", "none"]),
    default: "the best this CPU runs",
    audience: Audience::User,
    doc: "The CPU kernels' instruction set; one the CPU lacks falls back to the best available.",
};

pub const DISABLED_KERNELS: Var = Var {
    name: "DFLASH_DISABLED_KERNELS",
    kind: Kind::List,
    default: "none",
    audience: Audience::User,
    doc: "Fused kernels and paths to turn off, comma-separated (`--disable-kernels` over it): \
          the composed ops run in their place, for A/B comparisons. The names are listed \
          below.",
};

pub const PROFILE: Var = Var {
    name: "DFLASH_PROFILE",
    kind: Kind::Flag,
    default: "unset",
    audience: Audience::User,
    doc: "Time every phase of the long loops (synchronising the device at each phase's edges: \
          slower, for attribution only) and print the totals.",
};

pub const WINDOW_CELLS: Var = Var {
    name: "DFLASH_WINDOW_CELLS",
    kind: Kind::Number,
    default: "2^22 on a GPU, 2^20 on the CPU",
    audience: Audience::User,
    doc: "Row × key cells per window of the drafter's windowed training attention (fewer \
          launches against fewer wasted cells).",
};

pub const DKV_BLOCKS: Var = Var {
    name: "DFLASH_DKV_BLOCKS",
    kind: Kind::Number,
    default: "2048",
    audience: Audience::User,
    doc: "Blocks the training attention's dK/dV kernel aims for over all K/V heads.",
};

pub const RANK: Var = Var {
    name: "DFLASH_RANK",
    kind: Kind::Index,
    default: "unset: a single process",
    audience: Audience::Launcher,
    doc: "This process's rank among `DFLASH_WORLD` training ranks.",
};

pub const WORLD: Var = Var {
    name: "DFLASH_WORLD",
    kind: Kind::Number,
    default: "unset",
    audience: Audience::Launcher,
    doc: "The number of training ranks.",
};

pub const LOCAL_RANK: Var = Var {
    name: "DFLASH_LOCAL_RANK",
    kind: Kind::Index,
    default: "unset",
    audience: Audience::Launcher,
    doc: "This rank's device ordinal on its host.",
};

pub const RENDEZVOUS: Var = Var {
    name: "DFLASH_RENDEZVOUS",
    kind: Kind::Text,
    default: "unset",
    audience: Audience::Launcher,
    doc: "The address where the ranks meet.",
};

pub const BLESS: Var = Var {
    name: "DFLASH_BLESS",
    kind: Kind::Flag,
    default: "unset",
    audience: Audience::Tests,
    doc: "Tests that check a generated document (docs/CLI.md, docs/ENVIRONMENT.md) rewrite it \
          instead of failing.",
};

pub const ATOMIC_CHILD: Var = Var {
    name: "DFLASH_ATOMIC_CHILD",
    kind: Kind::Text,
    default: "unset",
    audience: Audience::Tests,
    doc: "The atomic-replace test's child process: the write it performs before it is killed.",
};

/// Every variable the project reads.
pub const ALL: &[&Var] = &[
    &HOME,
    &CPU_QUANT,
    &CPU_ISA,
    &DISABLED_KERNELS,
    &PROFILE,
    &WINDOW_CELLS,
    &DKV_BLOCKS,
    &RANK,
    &WORLD,
    &LOCAL_RANK,
    &RENDEZVOUS,
    &BLESS,
    &ATOMIC_CHILD,
];

/// The registry as a Markdown page: every variable, then the names `DFLASH_DISABLED_KERNELS`
/// takes.
pub fn markdown() -> String {
    let mut s = String::from(
        "# Environment variables\n\n\
         Generated from `crates/dflash-core/src/env.rs` (`DFLASH_BLESS=1 cargo test -p \
         dflash-core environment_doc` rewrites this file). The library takes its configuration as \
         a value built from the command line; the environment gives that value's defaults (for \
         scripts and comparisons) and carries a launcher's ranks to the processes it starts.\n\n\
         | variable | values | default | set by | what it does |\n|---|---|---|---|---|\n",
    );
    for v in ALL {
        let values = match v.kind {
            Kind::Flag => "set or unset".to_string(),
            Kind::Choice(c) => c.join(", "),
            Kind::Number => "a positive number".to_string(),
            Kind::Index => "a number from 0".to_string(),
            Kind::List => "names, comma-separated".to_string(),
            Kind::Text => "text".to_string(),
        };
        let who = match v.audience {
            Audience::User => "a user",
            Audience::Launcher => "`train --gpus N`",
            Audience::Tests => "the tests",
        };
        s += &format!(
            "| `{}` | {values} | {} | {who} | {} |\n",
            v.name, v.default, v.doc
        );
    }
    s += "\n## Kernels and paths `--disable-kernels` / `DFLASH_DISABLED_KERNELS` turn off\n\n\
          | name | what runs instead |\n|---|---|\n";
    for k in crate::runtime::Kernel::ALL {
        s += &format!("| `{}` | {} |\n", k.name(), k.doc());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variable_is_declared_once() {
        let mut names: Vec<_> = ALL.iter().map(|v| v.name).collect();
        names.sort();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a variable declared twice");
        assert!(names.iter().all(|n| n.starts_with("DFLASH_")));
    }

    #[test]
    fn the_page_lists_every_variable_and_kernel() {
        let page = markdown();
        for v in ALL {
            assert!(page.contains(&format!("`{}`", v.name)), "{}", v.name);
        }
        for k in crate::runtime::Kernel::ALL {
            assert!(page.contains(&format!("`{}`", k.name())), "{}", k.name());
        }
    }
}
