//! The layers the models are built of; each holds weights only (caches, masks and positions
//! are arguments): attention over an explicit rule, Gated DeltaNet, the projections, the
//! SwiGLU MLP, RMSNorm and RoPE.

pub mod attention;
pub mod dynamic_conv;
pub mod gdn;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod rope;
