"""The two implementations of the Gated DeltaNet chunked rule the hybrid benchmarks set side by
side, found once: fla's `chunk_gated_delta_rule` (None when fla does not import) and
transformers' torch fallback `torch_chunk_gated_delta_rule` (the function under the decorator
that would route it to fla). Imported by bench/gdn_parity.py and bench/hybrid_hf_speed.py."""
from transformers.models.qwen3_5 import modeling_qwen3_5 as M

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
except ImportError:
    fla_chunk = None


def unwrap(f):
    """The innermost function under `functools.wraps` decorators."""
    while hasattr(f, "__wrapped__"):
        f = f.__wrapped__
    return f


torch_chunk = unwrap(M.torch_chunk_gated_delta_rule)
