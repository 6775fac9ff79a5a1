"""The workload of `python -m dsv4_jax demo`: several requests with different
prompt lengths, chunked prefill, then a jitted decode loop with the state
donated, and a replay of the same steps through the jnp reference to check the
cache.

One model step (`model_step`) does what a DSV4 model does to its cache:
`apply_step`, then per layer `append`, `flush` (CSA / HCA layers) and the
gathers its attention reads (window; top-k on CSA; all entries on HCA). The
projections and top-k indices are random, made on the device from a key and
the step number by one jitted function, so both runs get the same bits. The
gathered rows are reduced to one number per layer so XLA keeps the reads.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..config import CacheConfig
from ..errors import error_counts
from ..host.manager import CacheManager
from ..meta import StepMeta, bucket
from ..ops.append import append
from ..ops.apply_step import apply_step
from ..ops.flush import flush
from ..ops.gather import gather_all, gather_topk, gather_window
from ..ops.write_layer import write_layer
from ..speculative import verify_begin, verify_commit, verify_layer
from ..state import CacheState, init_state
from .workload import MAX_FLIP_FRACTION, Flips, compare_states, layer_params


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    prompts: tuple[int, ...]     # prompt length of each request
    chunk: int                   # prefill tokens per request per step
    decode_steps: int
    seed: int = 0
    corrupt_at_step: int | None = None   # test hook: damage the cache after this step
    preempt: int = 0             # requests moved to host memory mid-decode and back
    speculative: int = 0         # drafts each decode step verifies a request (0: plain decode)

    def parked_steps(self) -> range:
        """Decode steps the preempted requests sit out: from a quarter of the
        decode (at least one step in) to half of it (at least one step out)."""
        if not self.preempt:
            return range(0)
        start = max(1, self.decode_steps // 4)
        return range(start, max(start + 1, self.decode_steps // 2))


def prompt_lengths(cfg: CacheConfig, requests: int, decode_steps: int, seed: int,
                   speculative: int = 0) -> tuple:
    """Distinct-ish prompt lengths spread over the room the context leaves
    (a speculative decode step takes up to 1 + `speculative` positions)."""
    room = cfg.max_context - decode_steps * (1 + speculative)
    rng = np.random.default_rng(seed)
    lo = max(1, room // 8)
    return tuple(int(n) for n in np.sort(rng.integers(lo, room + 1, requests))[::-1])


def _pad_sizes(settings: DemoSettings) -> dict:
    """Minimum padded sizes so that every prefill step has one shape and every
    decode step another (two compilations per run)."""
    B = len(settings.prompts)
    return dict(min_new_blocks=bucket(B * (settings.chunk // C.BLOCK_TOKENS + 2)),
                min_resets=bucket(B))


def schedule(settings: DemoSettings):
    """(phase, tokens per request index) of every step."""
    left = list(settings.prompts)
    steps = []
    while any(left):
        take = [min(settings.chunk, n) for n in left]
        steps.append(("prefill", take))
        left = [n - t for n, t in zip(left, take)]
    parked = settings.parked_steps()
    verified = 1 + settings.speculative
    for k in range(settings.decode_steps):
        steps.append(("decode", [0 if k in parked and j < settings.preempt else verified
                                 for j in range(len(left))]))
    return steps


def acceptance(settings: DemoSettings, step: int, take) -> list:
    """Tokens each request keeps of a speculative decode step's 1 + K: drawn
    from the seed and the step, every count 0 .. 1 + K possible (0 for a
    request without rows)."""
    rng = np.random.default_rng([settings.seed, step])
    return [int(rng.integers(0, n + 1)) if n else 0 for n in take]


def move_points(settings: DemoSettings) -> dict:
    """{step index: "out" or "in"}: before that step the first `preempt`
    requests are preempted to host memory, or resumed (in reverse order, so
    that with several each comes back into another's slot)."""
    parked = settings.parked_steps()
    if not parked:
        return {}
    first_decode = len(schedule(settings)) - settings.decode_steps
    return {first_decode + parked.start: "out", first_decode + parked.stop: "in"}


def _move(state, manager, ids, parked, way, settings, events):
    """Preempt or resume the first `settings.preempt` requests (the run with
    the manager), recording each copy so a replay repeats it."""
    from ..requests.moves import preempt, resume
    order = range(settings.preempt) if way == "out" else reversed(range(settings.preempt))
    for j in order:
        if way == "out":
            slot, blocks = manager.slot_of(ids[j]), manager.blocks_of(ids[j])
            parked[j] = preempt(state, manager, ids[j])
            events.append(("out", j, slot, blocks))
        else:
            state, ids[j] = resume(state, manager, parked.pop(j))
            events.append(("in", j, manager.slot_of(ids[j]), manager.blocks_of(ids[j]),
                           manager.block_row(ids[j])))
    return state


def _replay_moves(state, events, parked):
    """The recorded preemptions and resumptions done again by numpy on the
    host, independently of requests/transfer.py: the slot's rows and the blocks'
    rows copied out, then into the recorded slot, blocks and block-table row."""
    slot_leaves = (".swa.", ".csa.comp", ".csa.icomp", ".hca.comp")
    block_leaves = (".csa.kv.", ".csa.index.", ".hca.kv.")
    for ev in events:
        leaves, tree = jax.tree_util.tree_flatten_with_path(state)
        names = [jax.tree_util.keystr(path) for path, _ in leaves]
        if ev[0] == "out":
            _, j, slot, blocks = ev
            parked[j] = {n: np.array(np.asarray(x)[:, slot] if n.startswith(slot_leaves)
                                     else np.asarray(x)[:, list(blocks)])
                         for n, (_, x) in zip(names, leaves)
                         if n.startswith(slot_leaves + block_leaves)}
            continue
        _, j, slot, blocks, row = ev
        saved = parked.pop(j)
        new = []
        for n, (_, x) in zip(names, leaves):
            a = np.array(x)
            if n in saved and n.startswith(slot_leaves):
                a[:, slot] = saved[n]
            elif n in saved:
                a[:, list(blocks)] = saved[n]
            elif n == ".block_table":
                a[slot] = row
            new.append(jax.device_put(a, x.sharding))
        state = jax.tree_util.tree_unflatten(tree, new)
    return state


def make_inputs(cfg: CacheConfig, topk: int, key, step, meta: StepMeta):
    """(per-layer random projections of the step's tokens, random visible top-k
    indices i32[T, topk]: -1 for padding tokens and where nothing is visible)."""
    key = jax.random.fold_in(key, step)
    T = meta.num_tokens
    out = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        ks = jax.random.split(jax.random.fold_in(key, layer), 5)
        x = {"kv": (2 * jax.random.normal(ks[0], (T, C.HEAD_DIM))).astype(jnp.bfloat16)}
        if kind != C.SWA:
            w = (2 if kind == C.CSA else 1) * C.HEAD_DIM
            x["ckv"] = 1.5 * jax.random.normal(ks[1], (T, w), jnp.float32)
            x["score"] = 2 * jax.random.normal(ks[2], (T, w), jnp.float32)
        if kind == C.CSA:
            x["ikv"] = 1.5 * jax.random.normal(ks[3], (T, 2 * C.INDEX_DIM), jnp.float32)
            x["iscore"] = 2 * jax.random.normal(ks[4], (T, 2 * C.INDEX_DIM), jnp.float32)
        out[layer] = x
    visible = (meta.token_pos + 1) // C.CSA_RATIO
    u = jax.random.uniform(jax.random.fold_in(key, 1 << 20), (T, topk))
    idx = jnp.floor(u * visible[:, None]).astype(jnp.int32)
    ok = (visible[:, None] > 0) & (meta.token_slot[:, None] >= 0)
    return out, jnp.where(ok, idx, -1)


def layer_groups(kinds) -> tuple[int, int, int]:
    """(start, period, repeats): layers [start, start + period * repeats) repeat
    a pattern of `period` kinds and run in one `lax.scan` (layer index traced);
    the layers before `start` are unrolled. V4-Flash: (3, 2, 20), V4-Pro:
    (1, 2, 30); repeats 0 = unroll everything. Compiling one scanned body
    instead of 40-odd unrolled layers keeps the demo's compile time short."""
    best = (len(kinds), 1, 0)
    for period in (1, 2):
        for start in range(len(kinds)):
            tail = kinds[start:]
            reps = len(tail) // period
            if len(tail) % period or reps < 2:
                continue
            if all(tail[i] == tail[i % period] for i in range(len(tail))):
                if period * reps > best[1] * best[2]:
                    best = (start, period, reps)
                break
    return best


def layer_ops(state, layer, kind, meta, x, p, topk, slots, impl):
    """One layer's cache calls: append, flush (CSA / HCA), then the gathers
    its attention reads, reduced to one number. `layer` is a Python int or a
    traced int32 (inside the scan); `kind` is static either way."""
    state = append(state, layer, meta, x["kv"], impl=impl)
    if kind == C.CSA:
        state = flush(state, layer, meta, x["ckv"], x["score"], p,
                      index_kv=x["ikv"], index_score=x["iscore"], impl=impl)
    elif kind == C.HCA:
        state = flush(state, layer, meta, x["ckv"], x["score"], p, impl=impl)
    return _reads(state, layer, kind, meta, topk, slots, impl)


def _reads(state, layer, kind, meta, topk, slots, impl):
    """The gathers a layer's attention reads for the step's rows, reduced to
    one number."""
    cfg = state.config
    kv, _, state = gather_window(state, layer, slots, impl=impl)
    total = jnp.sum(kv.astype(jnp.float32))
    if kind == C.CSA:
        kv, valid, state = gather_topk(state, layer, meta.token_slot, meta.token_pos, topk,
                                       impl=impl)
        total += jnp.sum(kv.astype(jnp.float32)) + jnp.sum(valid)
    elif kind == C.HCA:
        kv, count, state = gather_all(state, layer, slots, meta.lengths,
                                      cfg.max_blocks_per_request, impl=impl)
        total += jnp.sum(kv.astype(jnp.float32)) + jnp.sum(count)
    return state, total


def over_layers(state, kinds, per_layer, inputs, params, scan: bool = True):
    """`per_layer(state, layer, kind, x, p) -> (state, total)` on every layer,
    the repeating part in one `lax.scan` (`layer_groups`; `scan=False`
    unrolls every layer). Returns the state and the totals (f32[L])."""
    start, period, reps = layer_groups(kinds) if scan else (len(kinds), 1, 0)
    sums = []
    for layer in range(start):
        state, total = per_layer(state, layer, kinds[layer], inputs[layer], params.get(layer))
        sums.append(total)
    if reps:
        stack = lambda trees: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)
        group = [range(start + j, start + period * reps, period) for j in range(period)]
        xs = [stack([inputs[l] for l in layers]) for layers in group]
        ps = [stack([params[l] for l in layers]) if kinds[layers[0]] != C.SWA else None
              for layers in group]

        def body(state, per):
            i, xs_i, ps_i = per
            totals = []
            for j in range(period):
                layer = jnp.int32(start + j) + i * period
                state, total = per_layer(state, layer, kinds[start + j], xs_i[j], ps_i[j])
                totals.append(total)
            return state, jnp.stack(totals)
        state, ys = jax.lax.scan(body, state, (jnp.arange(reps, dtype=jnp.int32), xs, ps))
        sums.extend(ys.reshape(-1))
    return state, jnp.stack(sums)


def model_step(state: CacheState, meta: StepMeta, inputs, params, impl: str,
               scan: bool = True):
    """The cache work of one model step; returns the state and a checksum of
    the gathered rows per layer (f32[L]). `inputs` = (per-layer projections,
    top-k indices) from `make_inputs`. `scan=False` unrolls every layer."""
    cfg = state.config
    inputs, topk = inputs
    slots = jnp.arange(cfg.max_requests, dtype=jnp.int32)
    state = apply_step(state, meta, impl=impl)

    def per_layer(state, layer, kind, x, p):
        return layer_ops(state, layer, kind, meta, x, p, topk, slots, impl)
    return over_layers(state, cfg.layer_kinds, per_layer, inputs, params, scan)


def compressor_operands(kind, x, p):
    """(comp_kv, comp_score, params) and the indexer keywords of a layer's
    inputs (`make_inputs`' names), as write_layer and verify_layer take them."""
    if kind == C.SWA:
        return (), {}
    extra = {"index_kv": x["ikv"], "index_score": x["iscore"]} if kind == C.CSA else {}
    return (x["ckv"], x["score"], p), extra


def speculative_model_step(state: CacheState, meta: StepMeta, inputs, accepted, params,
                           impl: str, drafts: int, scan: bool = True):
    """The cache work of one speculative decode step (docs/design/speculative.md):
    apply_step, verify_begin, per layer verify_layer and the gathers the
    drafts' attention reads (the ring before the step, top-k entries the
    drafts themselves may have closed, every HCA entry up to the drafts'
    lengths), verify_commit with `accepted` (i32[R]), then write_layer of the
    kept rows on every layer. Returns the state and the reads' checksum."""
    cfg = state.config
    inputs, topk = inputs
    slots = jnp.arange(cfg.max_requests, dtype=jnp.int32)
    state = apply_step(state, meta, impl=impl)
    spec = verify_begin(state, meta, drafts=drafts, impl=impl)
    rows = spec.verified

    def verify(state, layer, kind, x, p):
        comp, extra = compressor_operands(kind, x, p)
        state = verify_layer(state, layer, spec, *comp, impl=impl, **extra)
        return _reads(state, layer, kind, rows, topk, slots, impl)
    state, sums = over_layers(state, cfg.layer_kinds, verify, inputs, params, scan)
    state, kept = verify_commit(state, spec, accepted, impl=impl)

    def write(state, layer, kind, x, p):
        comp, extra = compressor_operands(kind, x, p)
        state = write_layer(state, layer, kept, x["kv"], *comp, impl=impl, **extra)
        return state, jnp.float32(0)
    state, _ = over_layers(state, cfg.layer_kinds, write, inputs, params, scan)
    return state, sums


def corrupt(state: CacheState, block: int) -> CacheState:
    """Flip an exponent bit of the first stored byte of CSA entry 0 of
    `block` in the first CSA layer (host side; the demo's self-test hook)."""
    nope = np.array(state.csa.kv.nope)
    raw = nope.view(np.uint8) if nope.dtype.itemsize == 1 else nope.view(np.uint16)
    raw[0, block, 0, 0] ^= 0x20
    kv = dataclasses.replace(state.csa.kv, nope=jnp.asarray(nope))
    return dataclasses.replace(state, csa=dataclasses.replace(state.csa, kv=kv))


@dataclasses.dataclass
class PhaseStats:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0


@dataclasses.dataclass
class RunResult:
    state: CacheState
    metas: list
    phases: dict
    compile_seconds: float
    manager: CacheManager | None
    checksum: np.ndarray
    moves: dict = dataclasses.field(default_factory=dict)   # step -> recorded preempt / resume
    accepted: dict = dataclasses.field(default_factory=dict)  # step -> i32[R] kept tokens by slot


class _Stepper:
    """The jitted, donated step, compiled ahead of time once per shape so
    the timed loop holds no compilation."""

    def __init__(self, cfg, params, impl, topk, scan=True, drafts=0):
        self.fn = jax.jit(lambda s, m, x: model_step(s, m, x, params, impl, scan),
                          donate_argnums=0)
        self.spec_fn = jax.jit(lambda s, m, x, a: speculative_model_step(
            s, m, x, a, params, impl, drafts, scan), donate_argnums=0)
        self.inputs_fn = jax.jit(lambda k, i, m: make_inputs(cfg, topk, k, i, m))
        self.compiled = {}
        self.compile_seconds = 0.0

    def __call__(self, state, meta, key, step, pad_to=None, accepted=None):
        """One step (with `accepted`, i32[R], a speculative one); with
        `pad_to`, the step's inputs are made at their own size and then the
        tokens padded to `pad_to` rows (slot -1), so every step of a replay
        runs one compiled program a kind of step."""
        step = jnp.int32(step)
        make = self._compiled(("inputs", meta.num_tokens, meta.num_new_blocks, meta.num_resets),
                              lambda: self.inputs_fn.lower(key, step, meta).compile())
        inputs = make(key, step, meta)
        if pad_to is not None and pad_to != meta.num_tokens:
            meta = pad_meta(meta, pad_to)
            inputs = self._compiled(("pad", inputs[1].shape[0], pad_to),
                                    lambda: jax.jit(lambda x: _pad_rows(x, pad_to)).lower(
                                        inputs).compile())(inputs)
        shape = (meta.num_tokens, meta.num_new_blocks, meta.num_resets)
        if accepted is not None:
            fn = self._compiled(("spec",) + shape,
                                lambda: self.spec_fn.lower(state, meta, inputs, accepted).compile())
            return fn(state, meta, inputs, accepted)
        fn = self._compiled(("step",) + shape, lambda: self.fn.lower(state, meta, inputs).compile())
        return fn(state, meta, inputs)

    def _compiled(self, key, build):
        if key not in self.compiled:
            t0 = time.perf_counter()
            self.compiled[key] = build()
            self.compile_seconds += time.perf_counter() - t0
        return self.compiled[key]


def _pad_rows(tree, rows):
    return jax.tree_util.tree_map(
        lambda a: jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)), tree)


def pad_meta(meta: StepMeta, rows: int) -> StepMeta:
    """The same step with its token rows padded to `rows` (slot -1 = padding,
    which every op ignores)."""
    extra = rows - meta.num_tokens
    if extra < 0:
        raise ValueError(f"rows: expected at least {meta.num_tokens}, got {rows}")
    return StepMeta.build(
        token_slot=np.concatenate([np.asarray(meta.token_slot), np.full(extra, -1)]),
        token_pos=np.concatenate([np.asarray(meta.token_pos), np.zeros(extra)]),
        lengths=np.asarray(meta.lengths), new_blocks=np.asarray(meta.new_blocks),
        reset_slots=np.asarray(meta.reset_slots))


def run(cfg: CacheConfig, settings: DemoSettings, impl: str = "auto", metas=None,
        progress: Callable | None = None, scan: bool = True, moves=None,
        accepted=None) -> RunResult:
    """Run the demo's schedule through `impl`. With `metas` (from an earlier
    run) the same steps are replayed without a manager, every step padded to
    the largest one (one compilation instead of two a kind of step: the
    reference path compiles slowly), `moves` (that run's) repeats its
    preemptions and `accepted` its speculative steps' kept counts."""
    params = layer_params(cfg, seed=settings.seed)
    topk = cfg.index_topk
    step_fn = _Stepper(cfg, params, impl, topk, scan, settings.speculative)
    key = jax.random.key(settings.seed)
    state = init_state(cfg)
    jax.block_until_ready(state)
    manager, ids = None, []
    if metas is None:
        manager = CacheManager(cfg)
        ids = [manager.admit() for _ in settings.prompts]
    pads = _pad_sizes(settings)
    B = len(settings.prompts)
    chunk_rows = B * settings.chunk
    phases = {"prefill": PhaseStats(), "decode": PhaseStats()}
    recorded = []
    checksum = None
    plan = schedule(settings)
    replay_rows = None if metas is None else max(m.num_tokens for m in metas)
    current, t0 = None, 0.0
    points = move_points(settings)
    recorded_moves = {} if moves is None else moves
    recorded_accepted = {} if accepted is None else accepted
    parked = {}
    for i, (phase, take) in enumerate(plan):
        if phase != current:               # phase boundary: finish the previous timing
            if current is not None:
                jax.block_until_ready(state)
                phases[current].seconds += time.perf_counter() - t0
            current, t0 = phase, time.perf_counter()
        if i in points:                    # preemption: host copies, not timed
            jax.block_until_ready(state)
            t_move = time.perf_counter()
            if metas is None:
                recorded_moves[i] = []
                state = _move(state, manager, ids, parked, points[i], settings, recorded_moves[i])
            else:
                state = _replay_moves(state, recorded_moves[i], parked)
            jax.block_until_ready(state)
            t0 += time.perf_counter() - t_move
        speculative = phase == "decode" and settings.speculative > 0
        kept = take
        if metas is None:
            min_tokens = chunk_rows if phase == "prefill" else B
            meta = manager.prepare_step({r: n for r, n in zip(ids, take) if n or phase == "prefill"},
                                        min_tokens=min_tokens, speculative=speculative,
                                        **pads)
            if speculative:
                kept = acceptance(settings, i, take)
                recorded_accepted[i] = manager.commit_speculative(
                    {r: a for r, a, n in zip(ids, kept, take) if n})
        else:
            meta = metas[i]
            if speculative:
                kept = [int(np.sum(recorded_accepted[i]))]
        recorded.append(meta)
        before = step_fn.compile_seconds
        acc = jnp.asarray(recorded_accepted[i]) if speculative else None
        state, checksum = step_fn(state, meta, key, i, pad_to=replay_rows, accepted=acc)
        t0 += step_fn.compile_seconds - before     # compilation is reported on its own
        phases[phase].steps += 1
        phases[phase].tokens += sum(kept)
        if settings.corrupt_at_step == i and manager is not None:
            jax.block_until_ready(state)
            t_fix = time.perf_counter()
            state = corrupt(state, _first_block(manager, ids))
            t0 += time.perf_counter() - t_fix
        if progress is not None:
            progress()
    jax.block_until_ready(state)
    phases[current].seconds += time.perf_counter() - t0
    return RunResult(state, recorded, phases, step_fn.compile_seconds, manager,
                     np.asarray(checksum), recorded_moves, recorded_accepted)


def _first_block(manager, ids):
    """A block holding a written CSA entry 0: the one the hook damages."""
    if manager is None:
        raise ValueError("corrupt_at_step: needs the run that owns the manager")
    for r in sorted(ids, key=manager.length_of, reverse=True):
        if manager.length_of(r) >= C.CSA_RATIO:
            return manager.blocks_of(r)[0]
    raise ValueError("corrupt_at_step: no CSA entry written yet at that step")


@dataclasses.dataclass
class Check:
    ok: bool
    message: str
    flips: Flips


def check_against(got: CacheState, want: CacheState) -> Check:
    """The demo's verdict: pools equal up to the documented one-code flips
    (few of them), and no op counted bad input in either run."""
    flips = Flips()
    try:
        compare_states(got, want, flips)
    except AssertionError as e:
        first = str(e).strip().splitlines()
        return Check(False, "pools differ: " + " ".join(first[:3]), flips)
    if flips.fraction >= MAX_FLIP_FRACTION:
        return Check(False, f"too many one-code flips: {flips}", flips)
    for name, s in (("run", got), ("reference", want)):
        counts = error_counts(s)
        if counts:
            return Check(False, f"{name} counted bad input: "
                         + ", ".join(f"{k.name.lower()}={v}" for k, v in counts.items()), flips)
    n = flips.fp8 + flips.e2m1 + flips.bf16
    return Check(True, f"pools equal to the reference up to {n:,} one-code "
                 f"flip{'' if n == 1 else 's'} of {flips.total:,} codes", flips)


def entries_emitted(cfg: CacheConfig, lengths) -> dict:
    """Compressed entries the cache holds after requests of `lengths` tokens,
    all layers: CSA entries, indexer keys, HCA entries."""
    csa = sum(n // C.CSA_RATIO for n in lengths) * cfg.num_csa
    hca = sum(n // C.HCA_RATIO for n in lengths) * cfg.num_hca
    return {"csa": csa, "index": csa, "hca": hca}
