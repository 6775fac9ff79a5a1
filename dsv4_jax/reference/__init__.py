"""Pure-jnp implementations of every cache op: the oracle the FFI kernels are
tested against and the portable path (any backend, under jit, donated)."""
from .apply_step import apply_step, pools_to_scrub as apply_step_pools, with_pools as apply_step_with_pools

__all__ = ["apply_step", "apply_step_pools", "apply_step_with_pools"]
