"""Config presets, state layout and memory_report (docs/design/overview.md,
docs/design/state.md)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import CacheConfig, init_state, memory_report
from dsv4_jax import config as C
from dsv4_jax.errors import NUM_ERROR_KINDS


def test_presets_follow_the_official_layer_patterns():
    flash, pro = CacheConfig.flash(), CacheConfig.pro()
    assert flash.num_layers == 43 and pro.num_layers == 61
    assert flash.compress_ratios[:3] == (0, 0, 4)
    assert flash.compress_ratios[3:] == (128, 4) * 20
    assert pro.compress_ratios[:2] == (128, 128) and pro.compress_ratios[-1] == 4
    assert (flash.num_csa, flash.num_hca) == (21, 20)
    assert (pro.num_csa, pro.num_hca) == (30, 31)
    assert flash.index_topk == 512 and pro.index_topk == 1024
    tiny = CacheConfig.tiny()
    assert set(tiny.layer_kinds) == {"swa", "csa", "hca"}


def test_config_is_hashable_and_static():
    a, b = CacheConfig.tiny(), CacheConfig.tiny()
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert CacheConfig.tiny(kv_format="bf16") != a


def test_derived_sizes():
    cfg = CacheConfig.flash(max_requests=2, max_context=1000)
    assert cfg.max_blocks_per_request == 8 and cfg.num_blocks == 16
    assert cfg.blocks_for_context(128) == 1 and cfg.blocks_for_context(129) == 2
    assert CacheConfig.entries_per_block("csa") == 32 and CacheConfig.entries_per_block("hca") == 1
    # per-kind index of each global layer, and -1 for other kinds
    csa = cfg.kind_index_table("csa")
    assert [csa[i] for i in cfg.layers_of("csa")] == list(range(cfg.num_csa))
    assert all(csa[i] == -1 for i in cfg.layers_of("hca"))
    assert cfg.kind_index(3) == 0 and cfg.kind_index(4, "csa") == 1


@pytest.mark.parametrize("bad", [dict(max_requests=0), dict(kv_format="fp16"),
                                 dict(compress_ratios=(0, 3))])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        CacheConfig.tiny().replace(**bad)


@pytest.mark.parametrize("kv_format", C.KV_FORMATS)
def test_init_state_layout_and_initial_values(kv_format):
    cfg = CacheConfig.tiny(kv_format=kv_format)
    st = init_state(cfg)
    R, N, MB, L = cfg.max_requests, cfg.num_blocks, cfg.max_blocks_per_request, cfg.num_layers
    assert st.block_table.shape == (R, MB) and np.all(np.asarray(st.block_table) == -1)
    assert st.swa.pos.shape == (L, R, 128) and np.all(np.asarray(st.swa.pos) == -1)
    assert st.csa.kv.nope.shape == (cfg.num_csa, N, 32, 448)
    assert st.csa.index.packed.shape == (cfg.num_csa, N, 32, 64)
    assert st.csa.index.scale.dtype == jnp.float8_e8m0fnu
    assert st.hca.kv.rope.shape == (cfg.num_hca, N, 1, 64) and st.hca.kv.rope.dtype == jnp.bfloat16
    assert st.errors.shape == (NUM_ERROR_KINDS,)
    for comp, width in ((st.csa.comp, 512), (st.csa.icomp, 128), (st.hca.comp, 512)):
        c = np.asarray(comp)
        assert c.shape[-2:] == (3, width)
        assert np.all(np.isneginf(c[..., 0, :])) and np.all(c[..., 1:, :] == 0)
    nope_dtype = {"ds_fp8": jnp.float8_e4m3fn, "fp8_token": jnp.float8_e4m3fn,
                  "bf16": jnp.bfloat16}[kv_format]
    assert st.swa.kv.nope.dtype == nope_dtype
    if kv_format == "ds_fp8":
        assert st.swa.kv.scale.shape[-1] == 7
        # blank scales are 1.0 (byte 0x7F), never the e8m0 NaN 0xFF
        assert np.all(np.asarray(st.csa.kv.scale).view(np.uint8) == 0x7F)
    elif kv_format == "fp8_token":
        assert st.swa.kv.scale.shape[-1] == 1 and st.swa.kv.scale.dtype == jnp.float32
    else:
        assert st.swa.kv.scale is None


def test_state_is_a_pytree_with_static_config():
    st = init_state(CacheConfig.tiny())
    leaves, treedef = jax.tree_util.tree_flatten(st)
    assert all(isinstance(x, jax.Array) for x in leaves)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again.config == st.config


def test_memory_report_reproduces_the_published_numbers():
    flash = memory_report(CacheConfig.flash())
    # CSA: 21 layers x (583 + 68) B / 4 tokens; HCA: 20 x 583 B / 128 tokens
    assert flash.per_token == pytest.approx(3508.84375)
    assert round(flash.per_token, 2) == 3508.84
    assert round(flash.window_per_request / 2**20, 2) == 3.08
    assert round(flash.compressor_per_request / 2**20, 2) == 0.42
    pro = memory_report(CacheConfig.pro())
    assert pro.per_token == pytest.approx((30 * (583 + 68) / 4) + 31 * 583 / 128)
    assert pro.window_per_request == 61 * 128 * (583 + 4)


def test_memory_report_matches_allocated_bytes():
    for fmt in C.KV_FORMATS:
        cfg = CacheConfig.tiny(kv_format=fmt)
        st = init_state(cfg)
        allocated = sum(x.nbytes for x in jax.tree_util.tree_leaves(st))
        rep = memory_report(cfg, num_shards=2)
        assert rep.total == allocated and rep.per_shard * 2 == allocated
        entry = {"ds_fp8": 583, "fp8_token": 580, "bf16": 1024}[fmt]
        assert rep.per_block == cfg.num_csa * 32 * (entry + 68) + cfg.num_hca * entry
    with pytest.raises(ValueError, match="num_shards"):
        memory_report(CacheConfig.tiny(), num_shards=3)
