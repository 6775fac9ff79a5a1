"""The attributes every write op takes (append, flush, write_layer: the struct
WriteAttrs, ffi/include/dsv4/attrs.h) as a raw call passes them, and bad
ones with the error each of those handlers gives, from the one check they
share."""

GOOD = {"kv_format": 0, "max_context": 256, "max_rows_per_slot": 0}

# (change to GOOD, None dropping the attribute; the error's pattern)
BAD = [
    ({"max_rows_per_slot": -1}, r"max_rows_per_slot: expected >= 0 \(0: no bound\), got -1"),
    ({"kv_format": 7}, r"kv_format: expected 0 \(ds_fp8\), 1 \(fp8_token\) or 2 \(bf16\), got 7"),
    ({"kv_format": -1}, r"kv_format: expected .* got -1"),
    ({"max_context": 0}, r"max_context: expected a positive multiple of 128, got 0"),
    ({"max_rows_per_slot": None}, r"attributes: expected 3 .*got 2"),
    ({"max_blocks": 2}, r"attributes: expected 3 .*got 4"),
]


def changed(change: dict) -> dict:
    """GOOD with `change` applied."""
    attrs = {**GOOD, **change}
    return {k: v for k, v in attrs.items() if v is not None}
