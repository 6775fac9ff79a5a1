"""take_rows / put_rows (dsv4_jax/ops/copy_rows.py) against a numpy oracle:
random bytes in every leaf dtype of the state (NaN payloads included), row
axes 0, 1 and 2, rows of odd byte counts, ids outside the axis; a put
changes the chosen rows and no other byte."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4_jax.ops import copy_rows as cr
from support.marks import CUDA, cpu_target_built
from support.trees import as_bytes

IMPLS = ["reference", pytest.param("cpu", marks=cpu_target_built("dsv4_take_rows")),
         pytest.param("cuda", marks=CUDA)]

# (shape, dtype, row axis): a window leaf, scales of 7 bytes a row (the HCA
# e8m0 scales), f32 accumulators, positions, indexer bytes, a block table.
LEAVES = [((3, 6, 4, 40), ml_dtypes.float8_e4m3fn, 1),
          ((3, 6, 4, 8), jnp.bfloat16, 1),
          ((2, 6, 1, 7), ml_dtypes.float8_e8m0fnu, 1),
          ((2, 6, 2, 3, 5), np.float32, 1),
          ((3, 6, 4), np.int32, 1),
          ((2, 6, 32, 64), np.uint8, 1),
          ((6, 5), np.int32, 0),
          ((2, 3, 6, 3), jnp.bfloat16, 2)]


def random_leaves(seed):
    rng = np.random.default_rng(seed)
    out = []
    for shape, dtype, _ in LEAVES:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out.append(rng.integers(0, 256, size, np.uint8).view(dtype).reshape(shape))
    return out


def numpy_take(x, axis, ids):
    rows = np.take(x, np.clip(ids, 0, x.shape[axis] - 1), axis=axis).copy()
    raw = rows.view(np.uint8)     # the row axis is never the last one here
    for j, i in enumerate(ids):
        if not 0 <= i < x.shape[axis]:
            raw[(slice(None),) * axis + (j,)] = 0
    return rows


def numpy_put(x, axis, ids, rows):
    out = x.copy()
    for j, i in enumerate(ids):
        if 0 <= i < x.shape[axis]:
            out[(slice(None),) * axis + (i,)] = rows[(slice(None),) * axis + (j,)]
    return out


AXES = [a for _, _, a in LEAVES]
CASES = [np.array(ids, np.int32) for ids in ([2], [5, -1, 0, 3], [4, 6, 1, -7, 2, 0], [])]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_take_rows_copies_the_rows_bit_for_bit_and_zeros_ids_outside(impl, case):
    ids = CASES[case]
    leaves = random_leaves(case)
    got = jax.jit(lambda xs, i: cr.take_rows(xs, AXES, i, impl=impl))(
        [jnp.asarray(x) for x in leaves], jnp.asarray(ids))
    for k, (x, a, g) in enumerate(zip(leaves, AXES, got)):
        want = numpy_take(x, a, ids)
        assert g.shape == want.shape and g.dtype == want.dtype, k
        assert np.array_equal(as_bytes(g), as_bytes(want)), f"leaf {k}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_put_rows_writes_the_rows_in_place_and_no_other_byte(impl, case):
    ids = CASES[case]
    leaves = random_leaves(10 + case)
    rows = [numpy_take(y, a, ids) for y, a in zip(random_leaves(20 + case), AXES)]
    fn = jax.jit(lambda xs, i, r: cr.put_rows(xs, AXES, i, r, impl=impl), donate_argnums=0)
    got = fn([jnp.asarray(x) for x in leaves], jnp.asarray(ids), [jnp.asarray(r) for r in rows])
    for k, (x, a, r, g) in enumerate(zip(leaves, AXES, rows, got)):
        assert np.array_equal(as_bytes(g), as_bytes(numpy_put(x, a, ids, r))), f"leaf {k}"


@pytest.mark.parametrize("impl", IMPLS)
def test_put_then_take_round_trips_every_row(impl):
    leaves = [jnp.asarray(x) for x in random_leaves(3)]
    ids = jnp.asarray([1, 4, 0], jnp.int32)
    rows = cr.take_rows(leaves, AXES, ids, impl=impl)
    moved = cr.put_rows(leaves, AXES, jnp.asarray([5, 2, 3], jnp.int32), rows, impl=impl)
    back = cr.take_rows(moved, AXES, jnp.asarray([5, 2, 3], jnp.int32), impl=impl)
    for r, b in zip(rows, back):
        assert np.array_equal(as_bytes(r), as_bytes(b))


def test_bad_arguments_raise_before_any_call():
    x = jnp.zeros((2, 3, 4), jnp.float32)
    ids = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="row_axes"):
        cr.take_rows([x], [3], ids)
    with pytest.raises(ValueError, match="ids"):
        cr.take_rows([x], [1], ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"rows\[0\]"):
        cr.put_rows([x], [1], ids, [jnp.zeros((2, 3, 4), jnp.float32)])
    with pytest.raises(ValueError, match="leaves"):
        cr.take_rows([x] * 17, [1] * 17, ids)
