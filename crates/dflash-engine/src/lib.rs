//! dflash-engine: the decoding loop (AR, DFlash chain and DDTree tree share one loop) and its
//! outcomes.

pub mod batched;
pub mod decode;

pub use decode::{generate, generate_with, DecodeOptions, Generation, Mode, Request};
