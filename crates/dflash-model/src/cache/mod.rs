//! What a forward leaves for the next one: per layer K/V rows (or a linear-attention state),
//! grown, truncated, compacted to a tree's accepted path, or of a fixed capacity.

pub mod kv_cache;
