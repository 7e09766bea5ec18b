//! dflash-engine: the decoding loops (AR and DFlash chain share one loop) and their stats.

pub mod chain;

pub use chain::{generate, Generation, Request};
