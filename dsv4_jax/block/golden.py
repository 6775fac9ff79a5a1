"""Runs the attention block over the golden set that tools/gen_hf_block_golden.py
writes from Hugging Face's DeepseekV4 (tests/data/hf_dsv4_block.*): the
same request, positions and layer inputs, in the same chunks (prefill chunks
through the prefill path, single tokens as decode steps), and compares the
block's output with Hugging Face's.

The comparison's bound, per token t and layer: the attention core within
2^-6 * M_t of Hugging Face's on every head (M_t: the largest |v| over the
rows HF's token attended, the scale `attention`'s own bound is stated in),
carried through the output projection exactly: |dy_t| <= |A| (2^-6 M_t) per
output channel, A the grouped projection as one [hidden, H * 512] matrix.
2^-6 counts the bf16 roundings (half an ulp, 2^-9, each) the library adds
to HF's float32 on the way to an output: q, the window row or the
compressor's three rounding points, P and the output. It is a count, not a
worst case (a rounding of q or a key moves a logit by up to 2^-9 of
sum |q_c v_c| / sqrt(512), more if all 512 channels' errors aligned, which
independent roundings do not); the measured worst is about 2.5e-3 M.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj

from .attention import jitted_step
from .config import BlockConfig
from .weights import from_tensors, load_safetensors

BOUND = 2.0 ** -6
WINDOW = 128
# the golden set in a checkout (not part of an installed wheel)
DEFAULT_STEM = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "hf_dsv4_block"
_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4,
          "heavily_compressed_attention": 128}


@dataclasses.dataclass
class Golden:
    """The golden run, read back: HF's config as the block's configs, the
    weights (weights.py's layout), and the arrays of the .npz."""
    cache: dj.CacheConfig
    block: BlockConfig
    weights: list
    data: dict

    @property
    def tokens(self) -> int:
        return int(sum(self.data["chunks"]))

    def bf16(self, key) -> np.ndarray:
        """A bf16 array stored as uint16 bits, as float64."""
        bits = self.data[key].astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)


def load(stem=DEFAULT_STEM, kv_format: str = "bf16", max_requests: int = 2,
         tensors=None) -> Golden:
    """The golden set at `stem` (.npz and .safetensors), with a cache config
    of `kv_format` that holds `max_requests` copies of its request.
    `tensors` (the .safetensors file's, already read) skips reading it."""
    stem = pathlib.Path(stem)
    for ext in (".npz", ".safetensors"):
        if not stem.with_suffix(ext).exists():
            raise FileNotFoundError(f"{stem.with_suffix(ext)} not found: the golden set lives in "
                                    f"the checkout's tests/data (tools/gen_hf_block_golden.py)")
    with np.load(stem.with_suffix(".npz")) as f:
        data = {k: f[k] for k in f.files}
    hf = json.loads(str(data["config_json"]))
    S = int(data["chunks"].sum())
    ratios = tuple(_RATIO[t] for t in hf["layer_types"])
    cache = dj.CacheConfig(ratios, max_requests=max_requests,
                           num_blocks=max_requests * -(-S // 128),
                           max_blocks_per_request=-(-S // 128), kv_format=kv_format,
                           index_topk=int(hf["index_topk"]), model="hf-tiny")
    block = BlockConfig.from_hf(hf)
    weights = (load_safetensors(stem.with_suffix(".safetensors"), cache, block)
               if tensors is None else from_tensors(tensors, cache, block))
    return Golden(cache, block, weights, data)


@dataclasses.dataclass
class Run:
    y: np.ndarray       # f32[L, S, hidden], the block's output of every token
    core: np.ndarray    # f32[L, S, H, 512], attention's output (after the inverse RoPE)
    picks: dict         # CSA layer -> i32[S, k], the picks attended
    state: dj.CacheState   # the cache after the last step
    slot: int           # the request's slot in it


def run(g: Golden, *, impl: str = "auto", hf_picks: bool = True, weights=None,
        schedules=None) -> Run:
    """The golden request through the block in HF's chunks; `run_requests`
    for the arguments. Returns the first request's `Run`."""
    return run_requests(g, schedules or [g.data["chunks"]], impl=impl, hf_picks=hf_picks,
                        weights=weights)[0]


def run_requests(g: Golden, schedules, *, impl: str = "auto", hf_picks: bool = True,
                 weights=None) -> list:
    """The golden request as len(schedules) requests of one cache, each fed
    in its own chunks (schedules[r]: tokens per step, summing to the
    golden's 200; a step runs the prefill path when any request takes more
    than one token, the decode path otherwise), jitted with the state
    donated: one `Run` per request. HF's picks are attended on CSA layers,
    or the library's indexer's with hf_picks=False; `weights` replaces the
    golden weights (a test's mutation)."""
    cfg, L = g.cache, g.cache.num_layers
    weights = jax.tree_util.tree_map(jnp.asarray, weights or g.weights)
    S, k, H = g.tokens, cfg.index_topk, g.block.num_heads
    schedules = [[int(n) for n in sched] for sched in schedules]
    if any(sum(sched) != S for sched in schedules):
        raise ValueError(f"schedules: each must feed the golden's {S} tokens, got "
                         f"{[sum(sched) for sched in schedules]}")
    state, manager = dj.init_state(cfg), dj.CacheManager(cfg)
    rids = [manager.admit() for _ in schedules]
    prefill = jitted_step(g.block, prefill=True, impl=impl)
    decode = jitted_step(g.block, prefill=False, impl=impl)
    csa = [i for i, kind in enumerate(cfg.layer_kinds) if kind == "csa"]
    xs = np.stack([g.data[f"x{i}"] for i in range(L)])
    y = np.zeros((len(rids), L, S, g.block.hidden_size), np.float32)
    core = np.zeros((len(rids), L, S, H, 512), np.float32)
    used = [{i: np.full((S, k), -1, np.int32) for i in csa} for _ in rids]
    done = [0] * len(rids)
    for step_no in range(max(len(sched) for sched in schedules)):
        take = {rid: (sched[step_no] if step_no < len(sched) else 0)
                for rid, sched in zip(rids, schedules)}
        many = max(take.values()) > 1
        meta = manager.prepare_step(take, min_tokens=256 if many else len(rids))
        T = meta.num_tokens
        x = np.zeros((L, T, xs.shape[-1]), np.float32)
        given = {i: np.full((T, k), -1, np.int32) for i in csa} if hf_picks else None
        spans = []
        for r, rid in enumerate(rids):
            rows, n, start = manager.token_rows(rid), take[rid], done[r]
            spans.append((rows, slice(start, start + n)))
            x[:, rows] = xs[:, start:start + n]
            for i in csa if hf_picks else ():
                given[i][rows] = g.data[f"picks{i}"][start:start + n]
            done[r] += n
        if given is not None:
            given = {i: jnp.asarray(p) for i, p in given.items()}
        state, ys, outs, picks = (prefill if many else decode)(state, meta, jnp.asarray(x),
                                                               weights, given)
        ys, outs = np.asarray(ys), np.asarray(outs)
        for r, (rows, positions) in enumerate(spans):
            y[r][:, positions] = ys[:, rows]
            core[r][:, positions] = outs[:, rows]
            for i in csa:
                used[r][i][positions] = np.asarray(picks[i])[rows]
    dj.check_errors(state)
    return [Run(y[r], core[r], used[r], state, manager.slot_of(rid))
            for r, rid in enumerate(rids)]


def seen_max(g: Golden, layer: int, picks=None) -> np.ndarray:
    """M_t, f64[S]: the largest |v| over the rows HF's token t attended in
    `layer` (its window rows, and its picks (HF's unless given) or the
    visible HCA entries)."""
    kind = g.cache.layer_kinds[layer]
    kv = np.abs(g.bf16(f"kv{layer}")).max(axis=-1)
    S = g.tokens
    M = np.array([kv[max(0, t - WINDOW + 1):t + 1].max() for t in range(S)])
    if kind == "swa":
        return M
    entries = np.abs(g.data[f"entries{layer}"].astype(np.float64)).max(axis=-1)
    for t in range(S):
        if kind == "csa":
            p = (picks if picks is not None else g.data[f"picks{layer}"])[t]
            p = p[p >= 0]
        else:
            p = np.arange((t + 1) // 128)
        if len(p):
            M[t] = max(M[t], entries[p].max())
    return M


def projection_abs(g: Golden, layer: int) -> np.ndarray:
    """|A| summed over each head's channels, f64[hidden, H]: A = o_b_proj
    after the grouped o_a_proj, as one [hidden, H * 512] matrix."""
    w, b = g.weights[layer], g.block
    wa = w["o_a_proj.weight"].astype(np.float64).reshape(b.o_groups, b.o_lora_rank, -1)
    wb = w["o_b_proj.weight"].astype(np.float64).reshape(b.hidden_size, b.o_groups, b.o_lora_rank)
    A = np.einsum("igr,grc->igc", wb, wa).reshape(b.hidden_size, b.num_heads, 512)
    return np.abs(A).sum(axis=-1)


def worst_ratio(g: Golden, result: Run, bound: float = BOUND) -> dict:
    """Per layer, the worst |y - y_HF| over its bound (<= 1 passes)."""
    out = {}
    for layer in range(g.cache.num_layers):
        M = seen_max(g, layer)
        limit = (projection_abs(g, layer) @ np.ones(g.block.num_heads))[None, :] \
            * (bound * M)[:, None]
        err = np.abs(result.y[layer].astype(np.float64) - g.data[f"y{layer}"])
        out[layer] = float((err / limit).max())
    return out
