"""A request's cache as values that move (docs/design/state.md, docs/design/host.md).

types.py     RequestSnapshot, RequestBlocks, RequestIds: what moves, their
             shapes under a config, and the check that a snapshot fits one
copies.py    each move's copies as traced code: one take_rows or put_rows
             call (dsv4_jax/ops/copy_rows.py), per shard when sharded
transfer.py  the moves on a CacheState: snapshot, restore, read / write
             blocks, read / write a whole request, as cached programs
moves.py     the moves with the manager: prefix sharing, preemption and
             resume, export and import as numpy arrays

Every public name is importable from `dsv4_jax`. This file imports none of
them: the host manager (dsv4_jax/host/manager.py) takes `check_snapshot` from
types.py alone, and moves.py builds on that manager.
"""
