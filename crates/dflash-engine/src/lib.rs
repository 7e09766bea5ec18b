//! dflash-engine: the decoding loop (AR, DFlash chain and DDTree tree share one loop) and its
//! outcomes.

pub mod decode;
pub mod packed;

pub use decode::{generate, Generation, Mode, Request};
