//! The models: the target (one decoder over every family, hybrids included), the DFlash
//! drafter that reuses its embedding and LM head, a drafter's vocabulary subset, and new
//! drafters (config + seeded random weights).

pub mod draft_vocab;
pub mod drafter;
pub mod drafter_init;
pub mod families;
pub mod selector;
pub mod target;
