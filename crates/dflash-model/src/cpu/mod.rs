//! CPU inference kernels: weights as panels (AVX-512), the few-rows attention over each row's
//! own keys (AVX-512 or AVX2), vector `exp`, and the helper threads they run on.

pub mod helpers;
pub mod panels;
pub mod quant;
pub mod row_attention;
pub(crate) mod vexp;
