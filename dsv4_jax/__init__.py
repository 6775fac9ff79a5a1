"""dsv4_jax: the KV cache of DeepSeek-V4 hybrid attention for JAX.

State is a pytree of device buffers (`CacheState`); ops are functional and
update the buffers in place under `jax.jit(..., donate_argnames=...)`.
"""
from . import _ffi  # registers the FFI targets of the compiled modules
from . import sharding
from .config import CacheConfig
from .errors import CacheInputError, ErrorKind, check_errors
from .manager import CacheFullError, CacheManager
from .memory import memory_report
from .meta import StepMeta
from .ops._dispatch import default_impl
from .ops.append import append
from .ops.apply_step import apply_step
from .ops.flush import flush
from .ops.gather import gather_all, gather_topk, gather_window
from .ops.indexer import indexer_topk
from .ops.write_layer import write_layer
from .params import CompressorParams, yarn_inv_freq
from .state import CacheState, HCAState, CSAState, IndexerKeys, KVEntries, WindowState, init_state

__all__ = [
    "CacheConfig", "CacheState", "KVEntries", "IndexerKeys", "WindowState", "CSAState",
    "HCAState", "init_state", "StepMeta", "CacheManager", "CacheFullError", "CacheInputError",
    "ErrorKind", "check_errors", "memory_report", "CompressorParams", "yarn_inv_freq",
    "default_impl", "apply_step", "append", "flush", "gather_window", "gather_topk", "gather_all",
    "indexer_topk", "write_layer",
]
__version__ = "0.1.0"
