"""A small continuous-batching serving engine on the dsv4_jax cache.

Where examples/decode_loop.py shows one model step, this shows the engine
around it, on the public API alone (`import dsv4_jax as dj`):

- admission and release: requests wait in a queue, take a slot when one
  and their blocks are free, and leave when they have their tokens;
- one step serves every running request: prompt chunks and decode tokens
  together, up to a token budget (`CacheManager.prepare_step`);
- three jitted, donated step programs, each compiled once: fixed pad sizes
  (`CacheManager.pad_sizes`) give every step of a kind the same shapes, and
  the fresh state is committed where the request moves leave it;
- preemption to host memory (`dj.preempt`) and back (`dj.resume`, under the
  same request id);
- prefix reuse: a request shares its first blocks (`dj.share_prefix`) and
  later requests with that prompt start there (`dj.admit_on_prefix`);
- a speculative step: each request's next token and drafts verified as one
  chunk, the drafts the model confirms kept, counted on the device
  (`dj.accepted_counts`) and told to the host (`manager.accepted_of`,
  `manager.commit_speculative`).

The step recipes (docs/api.md, "Step recipes"): a step holding prompt
chunks attends each layer before it appends (`flush`, `indexer_topk`,
`attention` with `chunk_kv`, `append`), since appending first overwrites
window rows the chunk's earlier queries still need (the cache counts such
reads as STALE_WINDOW); a step of decode tokens alone writes first
(`write_layer`, then the reads). The model is a toy: random weights, a
small hidden size; to stay short every layer reads the token embeddings
(no residual stream between layers, so what the cache stores depends on
the tokens alone), and the layers' attention outputs are summed into the
stream the next token is read from (the argmax of a random unembedding).

    python examples/serving_engine.py                  # tiny, on the CPU
    python examples/serving_engine.py --model flash    # V4-Flash, tokens/s on a GPU
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import time
from typing import Hashable

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as dj
from dsv4_jax import config as C


# ---- the toy model --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelSize:
    hidden: int = 64
    heads: int = 4
    vocab: int = 128


def make_weights(cfg: dj.CacheConfig, size: ModelSize, seed: int = 0):
    """(weights, compressor params): random, scaled for unit-sized activations."""
    rng = np.random.default_rng(seed)

    def mat(*shape):
        return jnp.asarray(rng.normal(0, 1 / math.sqrt(shape[0]), shape), jnp.float32)

    def comp(m, width, d):
        return dj.CompressorParams(jnp.asarray(rng.normal(0, 0.5, (m, width)), jnp.float32),
                                   jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32),
                                   jnp.asarray(dj.yarn_inv_freq()))
    H, D = size.hidden, C.HEAD_DIM
    weights = {"embed": jnp.asarray(rng.normal(0, 1, (size.vocab, H)), jnp.float32),
               "unembed": mat(H, size.vocab), "layers": []}
    params = {}
    for layer, kind in enumerate(cfg.layer_kinds):
        w = dict(wq=mat(H, size.heads, D), wkv=mat(H, D), wo=mat(D, H),
                 sink=jnp.asarray(rng.normal(0, 1, size.heads), jnp.float32))
        if kind != C.SWA:
            width = (2 if kind == C.CSA else 1) * D      # CSA windows overlap: two halves
            ratio = C.CSA_RATIO if kind == C.CSA else C.HCA_RATIO
            w.update(wc_kv=mat(H, width), wc_score=mat(H, width))
            params[layer] = comp(ratio, width, D)
        if kind == C.CSA:
            w.update(wi_kv=mat(H, 2 * C.INDEX_DIM), wi_score=mat(H, 2 * C.INDEX_DIM),
                     wi_q=mat(H, C.INDEX_HEADS, C.INDEX_DIM), wi_w=mat(H, C.INDEX_HEADS))
            params[layer] = dataclasses.replace(params[layer],
                                                index=comp(C.CSA_RATIO, 2 * C.INDEX_DIM,
                                                           C.INDEX_DIM))
        weights["layers"].append(w)
    return weights, params


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def inv_freq(kind):
    """Plain RoPE on SWA layers, the YaRN compress RoPE on CSA and HCA layers."""
    if kind == C.SWA:
        return jnp.asarray(1.0 / 10000.0 ** (np.arange(0, C.ROPE_DIM, 2) / C.ROPE_DIM),
                           jnp.float32)
    return jnp.asarray(dj.yarn_inv_freq())


def rope(x, pos, freq):
    """Interleaved RoPE on the trailing 64 channels of x [T, ..., 512], bf16 out."""
    ang = pos.astype(jnp.float32).reshape((-1,) + (1,) * (x.ndim - 1)) * freq
    r = x[..., C.NOPE_DIM:].reshape(x.shape[:-1] + (C.ROPE_DIM // 2, 2))
    a, b = r[..., 0], r[..., 1]
    r = jnp.stack([a * jnp.cos(ang) - b * jnp.sin(ang), a * jnp.sin(ang) + b * jnp.cos(ang)],
                  axis=-1).reshape(x.shape[:-1] + (C.ROPE_DIM,))
    return jnp.concatenate([x[..., :C.NOPE_DIM], r], axis=-1).astype(jnp.bfloat16)


def project(x, pos, w, kind):
    """One layer's projections of the step's rows (x f32[T, hidden])."""
    freq = inv_freq(kind)
    p = dict(kv=rope(rms_norm(x @ w["wkv"]), pos, freq),
             q=rope(rms_norm(jnp.einsum("td,dhc->thc", x, w["wq"])), pos, freq))
    if kind != C.SWA:
        p.update(comp_kv=x @ w["wc_kv"], comp_score=x @ w["wc_score"])
    if kind == C.CSA:
        p.update(index_kv=x @ w["wi_kv"], index_score=x @ w["wi_score"],
                 q_index=jnp.einsum("td,dhc->thc", x, w["wi_q"]).astype(jnp.bfloat16),
                 w_index=x @ w["wi_w"])
    return p


def compressor_args(p, kind, params, layer):
    """The compressor operands of flush / write_layer / verify_layer."""
    if kind == C.SWA:
        return (), {}
    extra = {}
    if kind == C.CSA:
        extra = dict(index_kv=p["index_kv"], index_score=p["index_score"])
    return (p["comp_kv"], p["comp_score"], params[layer]), extra


def read(state, layer, kind, slot, pos, p, w, chunk_kv=None):
    """indexer_topk (CSA) and attention of one layer: (state, out)."""
    topk = None
    if kind == C.CSA:
        topk, state = dj.indexer_topk(state, layer, slot, pos, p["q_index"], p["w_index"],
                                      state.config.index_topk)
    out, _, state = dj.attention(state, layer, p["q"], slot, pos, sink=w["sink"], topk=topk,
                                 chunk_kv=chunk_kv, rope_inv_freq=inv_freq(kind))
    return state, out


def mix(h, out, w):
    """The output stream after a layer: its heads' mean, projected back."""
    return h + rms_norm(jnp.mean(out.astype(jnp.float32), axis=1)) @ w["wo"]


def next_tokens(h, weights):
    """Greedy next token of every row: i32[T]."""
    return jnp.argmax(rms_norm(h) @ weights["unembed"], axis=-1).astype(jnp.int32)


# ---- the three step programs ------------------------------------------------------------------
def chunk_step(state, meta, rows, weights, params):
    """A step with prompt chunks (decode tokens may share it): per layer the
    entries the chunk closes, the reads over the ring before the chunk and
    the chunk's own rows (chunk_kv), then the append."""
    state = dj.apply_step(state, meta)
    slot, pos = meta.token_slot, meta.token_pos
    x = h = weights["embed"][rows]
    for layer, kind in enumerate(state.config.layer_kinds):
        w = weights["layers"][layer]
        p = project(x, pos, w, kind)
        comp, extra = compressor_args(p, kind, params, layer)
        if comp:
            state = dj.flush(state, layer, meta, *comp, **extra)
        state, out = read(state, layer, kind, slot, pos, p, w, chunk_kv=p["kv"])
        state = dj.append(state, layer, meta, p["kv"])
        h = mix(h, out, w)
    return state, next_tokens(h, weights)


def decode_step(state, meta, rows, weights, params):
    """A step of decode tokens alone: per layer write_layer, then the reads."""
    state = dj.apply_step(state, meta)
    slot, pos = meta.token_slot, meta.token_pos
    x = h = weights["embed"][rows]
    for layer, kind in enumerate(state.config.layer_kinds):
        w = weights["layers"][layer]
        p = project(x, pos, w, kind)
        comp, extra = compressor_args(p, kind, params, layer)
        state = dj.write_layer(state, layer, meta, p["kv"], *comp, **extra)
        state, out = read(state, layer, kind, slot, pos, p, w)
        h = mix(h, out, w)
    return state, next_tokens(h, weights)


def speculative_step(state, meta, rows, forced, weights, params, *, drafts: int):
    """Each request's next token and its drafts verified as a chunk that is
    never appended; a draft is kept while the model's token after the row
    before it is the draft (on the device: `accepted_counts`), unless
    `forced` (i32[R], -1: no) says how many a slot keeps (a replay); then
    verify_commit and write_layer of the kept rows. Returns (state, next
    token of every row, accepted i32[R])."""
    state = dj.apply_step(state, meta)
    spec = dj.verify_begin(state, meta, drafts=drafts)
    slot, pos = spec.verified.token_slot, spec.verified.token_pos
    x = h = weights["embed"][rows]
    written = []
    for layer, kind in enumerate(state.config.layer_kinds):
        w = weights["layers"][layer]
        p = project(x, meta.token_pos, w, kind)
        comp, extra = compressor_args(p, kind, params, layer)
        state = dj.verify_layer(state, layer, spec, *comp, **extra)
        state, out = read(state, layer, kind, slot, pos, p, w, chunk_kv=p["kv"])
        written.append((p["kv"], comp, extra))
        h = mix(h, out, w)
    choice = next_tokens(h, weights)
    # row r holds a draft the model confirms when the token chosen after row
    # r - 1 (the same request's previous row) is that draft
    draft_ok = jnp.roll(choice, 1) == rows
    accepted = jnp.where(forced >= 0, forced, dj.accepted_counts(spec, draft_ok))
    state, kept = dj.verify_commit(state, spec, accepted)
    for layer, (kv, comp, extra) in enumerate(written):
        state = dj.write_layer(state, layer, kept, kv, *comp, **extra)
    return state, choice, accepted


# ---- the engine -------------------------------------------------------------------------------
@dataclasses.dataclass
class Request:
    rid: Hashable
    tokens: list              # the prompt, then every token generated
    prompt_len: int
    max_new: int
    prefix: Hashable | None = None       # a cached prefix to start on
    share: tuple | None = None           # (tokens, key): cache a prefix when it holds that many
    parked: object = None                # its cache in host memory while preempted

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class Engine:
    """Requests in, tokens out: a queue, a cache (state + manager) and the
    jitted steps. `host` is what each step reads back from the device (the
    next tokens, the accepted counts), in order: a run replayed with
    `replay=` (that list of another run) takes its values from it instead,
    so both runs make the same steps, whatever their own values.
    `decode_recipe="chunk"` runs the steps of decode tokens alone with the
    chunk recipe too (decode rows are chunks of one), to time one recipe
    against the other."""

    def __init__(self, cfg: dj.CacheConfig, size: ModelSize = ModelSize(), *,
                 budget: int = 128, chunk: int = 64, drafts: int = 3, seed: int = 0,
                 replay: list | None = None, decode_recipe: str = "decode"):
        self.cfg, self.budget, self.chunk, self.drafts = cfg, budget, chunk, drafts
        self.weights, self.params = make_weights(cfg, size, seed)
        self.manager = dj.CacheManager(cfg)
        self.state = dj.init_state(cfg)
        R = cfg.max_requests
        # one shape per kind of step: each program compiles once
        self.pads = {"chunk": self.manager.pad_sizes(budget),
                     "decode": self.manager.pad_sizes(R),
                     "speculative": self.manager.pad_sizes(R * (1 + drafts))}
        self.programs = {
            "chunk": jax.jit(chunk_step, donate_argnums=0),
            "decode": jax.jit({"decode": decode_step, "chunk": chunk_step}[decode_recipe],
                              donate_argnums=0),
            "speculative": jax.jit(lambda *a: speculative_step(*a, drafts=drafts),
                                   donate_argnums=0)}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[Hashable, Request] = {}
        self.finished: dict[Hashable, Request] = {}
        self.parked: dict[Hashable, Request] = {}
        self.host: list = []
        self.device_values: list = []       # a replay's own values, beside the ones it took
        self._replay = None if replay is None else iter(replay)
        self.steps = collections.Counter()
        self.kept: list[dict] = []          # per speculative step: {request: rows kept}

    # ---- requests -------------------------------------------------------------------------
    def submit(self, rid, prompt, max_new: int, *, prefix=None, share=None):
        self.waiting.append(Request(rid, list(prompt), len(prompt), max_new, prefix, share))

    def preempt(self, rid):
        """The request's cache to host memory, its slot and blocks freed."""
        req = self.running.pop(rid)
        req.parked = dj.preempt(self.state, self.manager, rid)
        self.parked[rid] = req

    def resume(self, rid):
        """A preempted request back to the head of the queue: the next step
        brings its cache back (under the same id) and runs it."""
        self.waiting.appendleft(self.parked.pop(rid))

    def _admit(self):
        m = self.manager
        while self.waiting and m.free_slots:
            req = self.waiting[0]
            try:
                if req.parked is not None:       # back under its id, its cache as it left
                    self.state, rid = dj.resume(self.state, m, req.parked)
                    req.parked = None
                elif req.prefix is not None:
                    self.state, rid = dj.admit_on_prefix(self.state, m, req.prefix, req.rid)
                else:
                    rid = m.admit(req.rid)
            except dj.CacheFullError:
                return                           # wait for blocks
            assert rid == req.rid
            self.running[rid] = self.waiting.popleft()

    def _release_finished(self):
        for rid in [r for r, q in self.running.items() if q.generated >= q.max_new]:
            self.finished[rid] = self.running.pop(rid)
            self.manager.release(rid)

    def _to_host(self, x, taken=None) -> np.ndarray:
        """A device value the host acts on: recorded, or in a replay the
        recorded one (`taken`: already taken from the replay)."""
        if self._replay is None:
            value = np.asarray(x)
            self.host.append(value)
            return value
        self.device_values.append(np.asarray(x))
        return next(self._replay) if taken is None else taken

    # ---- steps ----------------------------------------------------------------------------
    def _rows(self, meta, tokens: dict, source) -> np.ndarray:
        """Token ids of the step's rows, request by request (0 on padding)."""
        rows = np.zeros(meta.num_tokens, np.int32)
        for rid, n in tokens.items():
            sl = self.manager.token_rows(rid)
            rows[sl] = source(rid, n)
        return rows

    def step(self) -> bool:
        """One step of every running request: the next prompt chunk of those
        still prefilling, one token of the others, within the budget.
        False when nothing runs."""
        self._admit()
        m = self.manager
        tokens, budget = {}, self.budget
        for rid, req in self.running.items():
            fed = m.length_of(rid)
            want = min(self.chunk, req.prompt_len - fed) if fed < req.prompt_len else 1
            n = min(want, budget)
            if n:
                tokens[rid] = n
                budget -= n
        if not tokens:
            return False
        before = {rid: m.length_of(rid) for rid in tokens}
        kind = "decode" if all(before[r] >= self.running[r].prompt_len for r in tokens) \
            else "chunk"
        meta = m.prepare_step(tokens, **self.pads[kind])
        rows = self._rows(meta, tokens,
                          lambda rid, n: self.running[rid].tokens[before[rid]:before[rid] + n])
        self.state, choice = self.programs[kind](self.state, meta, jnp.asarray(rows),
                                                 self.weights, self.params)
        self.steps[kind] += 1
        choice = self._to_host(choice)
        for rid, n in tokens.items():
            req = self.running[rid]
            if before[rid] + n == len(req.tokens):   # its last known token went in
                req.tokens.append(int(choice[m.token_rows(rid).stop - 1]))
            if req.share and m.length_of(rid) == req.share[0]:
                dj.share_prefix(self.state, m, rid, key=req.share[1])
        self._release_finished()
        return True

    def draft(self, req: Request, k: int) -> list:
        """k drafts by prompt lookup: what followed the last earlier
        occurrence of the last token (the last token again if none)."""
        t = req.tokens
        for i in range(len(t) - 2, -1, -1):
            if t[i] == t[-1]:
                follow = t[i + 1:i + 1 + k]
                return follow + [t[-1]] * (k - len(follow))
        return [t[-1]] * k

    def speculative_step(self) -> bool:
        """One speculative step of every decoding request: its pending token
        and up to `drafts` drafts, as many kept as the model confirms."""
        self._admit()
        m = self.manager
        plan = {}
        for rid, req in self.running.items():
            fed = m.length_of(rid)
            if fed >= req.prompt_len and fed == len(req.tokens) - 1:
                k = min(self.drafts, req.max_new - req.generated - 1)
                plan[rid] = [req.tokens[-1]] + self.draft(req, max(k, 0))
        if not plan:
            return False
        tokens = {rid: len(r) for rid, r in plan.items()}
        meta = m.prepare_step(tokens, speculative=True, **self.pads["speculative"])
        rows = self._rows(meta, tokens, lambda rid, n: plan[rid])
        # a replay keeps what the recorded run kept, whatever its model says
        forced = (np.full(self.cfg.max_requests, -1, np.int32) if self._replay is None
                  else next(self._replay))
        self.state, choice, accepted = self.programs["speculative"](
            self.state, meta, jnp.asarray(rows), jnp.asarray(forced), self.weights, self.params)
        self.steps["speculative"] += 1
        kept = m.accepted_of(self._to_host(accepted, None if self._replay is None else forced))
        choice = self._to_host(choice)
        m.commit_speculative(kept)
        self.kept.append(kept)
        for rid, a in kept.items():
            # the kept drafts are now tokens of the request, and the model's
            # token after the last kept row is its next one
            self.running[rid].tokens += plan[rid][1:a] + [int(choice[m.token_rows(rid).start + a - 1])]
        self._release_finished()
        return True


# ---- the tiny run (the CPU, the tests) --------------------------------------------------------
@dataclasses.dataclass
class Settings:
    prompts: tuple = (300, 150)       # a and b
    shared: int = 256                 # c starts on a's first 256 tokens
    extra: int = 60                   # ... and has 60 prompt tokens of its own
    max_new: int = 12
    preempt_after: int = 3            # b leaves after this many of its tokens ...
    parked_steps: int = 2             # ... and comes back this many steps later
    kv_format: str = "ds_fp8"
    seed: int = 0


def run(settings: Settings = Settings(), *, replay=None, verbose: bool = True) -> Engine:
    """Three requests through a tiny cache: a shares its first 256 tokens
    as a prefix, c starts on it, b is preempted mid-decode and resumed, and
    once every prompt is in, one speculative step runs beside the plain
    ones."""
    s = settings
    cfg = dj.CacheConfig.tiny(max_requests=4, max_context=1024, kv_format=s.kv_format)
    eng = Engine(cfg, seed=s.seed, replay=replay)
    rng = np.random.default_rng(s.seed)
    vocab = ModelSize().vocab
    a, b = (rng.integers(0, vocab, n).tolist() for n in s.prompts)
    eng.submit("a", a, s.max_new, share=(s.shared, "system"))
    eng.submit("b", b, s.max_new)
    c_sent = speculated = False
    parked_for = None                            # steps b has spent parked
    while eng.running or eng.waiting or eng.parked:
        ran = eng.step()
        m = eng.manager
        if not c_sent and "system" in m.prefixes:
            eng.submit("c", a[:s.shared] + rng.integers(0, vocab, s.extra).tolist(), s.max_new,
                       prefix="system")
            c_sent = True
        b_req = eng.running.get("b")
        if parked_for is None and b_req is not None and b_req.generated >= s.preempt_after:
            eng.preempt("b")
            parked_for = 0
        elif "b" in eng.parked:
            parked_for += 1
            if parked_for >= s.parked_steps or not ran:
                eng.resume("b")
        decoding = [q for q in eng.running.values()
                    if m.length_of(q.rid) >= q.prompt_len and q.generated < q.max_new - 1]
        if not speculated and c_sent and len(decoding) == len(eng.running) >= 2 \
                and not eng.waiting and not eng.parked:
            speculated = eng.speculative_step()
    dj.check_errors(eng.state)
    if verbose:
        print(f"steps: {dict(eng.steps)}; compiles per program: "
              f"{ {k: p._cache_size() for k, p in eng.programs.items()} }")
        for rid, req in sorted(eng.finished.items()):
            print(f"request {rid}: prompt {req.prompt_len} tokens, generated "
                  f"{req.tokens[req.prompt_len:]}")
    return eng


# ---- the GPU timing (--model flash) -----------------------------------------------------------
FLASH_SIZE = ModelSize(hidden=256, heads=64, vocab=1024)


def timed(B: int, context: int, *, steps: int = 32, budget: int = 4096, drafts: int = 3,
          seed: int = 0, model: str = "flash", size: ModelSize = FLASH_SIZE,
          decode_recipe: str = "decode") -> dict:
    """V4-Flash (or `model`) with B requests of `context` prompt tokens:
    prefill through the engine (chunks of up to `budget` tokens a step),
    then `steps` decode steps timed after one warm-up step. Tokens/s of the
    decode steps."""
    preset = {"flash": dj.CacheConfig.flash, "tiny": dj.CacheConfig.tiny}[model]
    cfg = preset(max_requests=B, max_context=context + steps + 128)
    eng = Engine(cfg, size, budget=budget, chunk=budget, drafts=drafts, seed=seed,
                 decode_recipe=decode_recipe)
    rng = np.random.default_rng(seed)
    for i in range(B):
        eng.submit(i, rng.integers(0, size.vocab, context).tolist(), steps + 2)
    t0 = time.perf_counter()
    while any(eng.manager.length_of(r) < q.prompt_len for r, q in eng.running.items()) \
            or eng.waiting:
        eng.step()
    jax.block_until_ready(eng.state)
    prefill_s = time.perf_counter() - t0
    eng.step()                                   # compiles the decode program
    jax.block_until_ready(eng.state)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    jax.block_until_ready(eng.state)
    decode_s = time.perf_counter() - t0
    dj.check_errors(eng.state)
    return dict(B=B, context=context, prefill_s=prefill_s, prefill_tokens=B * context,
                decode_steps=steps, decode_s=decode_s, tokens_per_s=B * steps / decode_s,
                ms_per_step=1e3 * decode_s / steps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "flash"], default="tiny")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (flash)")
    ap.add_argument("--decode-recipe", choices=["decode", "chunk"], default="decode",
                    help="the recipe of steps of decode tokens alone (flash)")
    args = ap.parse_args(argv)
    if args.model == "tiny":
        run()
        return
    print(f"V4-Flash, toy model (hidden 256, 64 heads): decode through the engine "
          f"({args.decode_recipe} recipe)")
    for B, context in ((64, 4096), (1, 65536)):
        r = timed(B, context, steps=args.steps, decode_recipe=args.decode_recipe)
        print(f"B = {B:3d}, context {context:6,}: prefill {r['prefill_tokens']:,} tokens in "
              f"{r['prefill_s']:.1f} s (compiles included); decode {r['tokens_per_s']:,.0f} "
              f"tokens/s ({r['ms_per_step']:.2f} ms a step)")


if __name__ == "__main__":
    main()
