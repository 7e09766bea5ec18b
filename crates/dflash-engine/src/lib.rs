//! dflash-engine: the decoding loop (AR, DFlash chain and DDTree tree share one loop) and its
//! outcomes.

pub mod batched;
pub mod decode;
pub mod graph_cache;
pub mod mode;

pub use decode::{
    generate, generate_spec_batched, Acceptance, DecodeOptions, Generation, Request, Session,
    SlotRound, SpecBatch,
};
pub use graph_cache::GraphCache;
pub use mode::{Mode, ModeName};
