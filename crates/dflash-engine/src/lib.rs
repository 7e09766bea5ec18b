//! dflash-engine: the decoding loop (AR, DFlash chain and DDTree tree share one loop) and its
//! outcomes.

pub mod batched;
pub mod decode;
pub mod mode;

pub use decode::{generate, Acceptance, DecodeOptions, Generation, Request};
pub use mode::{Mode, ModeName};
