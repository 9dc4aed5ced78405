"""V4 (compat) in its own stored formats (`quant: qat`, DESIGN §4, §5): the cache's bytes against the closed
formula written out here, the stored bytes decoded with ml_dtypes in NumPy against the forward's fake-quant
values, and the first layer's values against a NumPy reference of V4's official quantisers (FP8 E4M3 NoPE
channels with UE8M0 scales per block, BF16 RoPE channels; indexer keys Hadamard-rotated, then MXFP4)."""

import jax
import ml_dtypes
import numpy as np
import pytest

import dsv41
from dsv41 import cache as cache_lib
from dsv41 import model
from test_quant import ref_fp8, sylvester

F32, F64 = np.float32, np.float64
# A CSA layer first, so that its input (the embedding) is the same with and without fake quantisation.
TYPES = 'v4.layer_types=["csa","window","hca"]'


def record_bytes(cfg, block: int, align: int) -> int:
    """One stored record: NoPE FP8 codes + BF16 RoPE channels + a UE8M0 byte per block, padded to `align`."""
    a = cfg.architecture
    nope, rope = a.head_dim - a.rope_head_dim, a.rope_head_dim
    raw = nope + 2 * rope + nope // block
    return -(-raw // align) * align


def closed_formula(cfg, capacity: int) -> int:
    """V4's packed cache, from the config: per CSA layer and entry a main record and an MXFP4 indexer key
    (d_I/2 + d_I/32 bytes), per HCA layer and entry a main record; per layer a ring of W window records and
    its window start; a CSA compressor's 2r − 1 leftover tokens of 4K fp32 and its indexer's 2r − 1 of 4·d_I, an
    HCA compressor's r − 1 of 2K; the row's length."""
    a, v4, kv = cfg.architecture, cfg.v4, cfg.kv_cache
    k, d_i, w = a.head_dim, v4.indexer.head_dim, kv.swa_window_size
    main = record_bytes(cfg, int(kv.global_kv_scale.split("_")[2]), kv.global_kv_entry_align_bytes)
    window = record_bytes(cfg, int(kv.swa_kv_scale.split("_")[2]), 1)
    types = list(v4.layer_types)
    csa, hca = types.count("csa"), types.count("hca")
    entries = (csa * capacity // v4.csa_ratio * (main + d_i // 2 + d_i // 32)
               + hca * capacity // v4.hca_ratio * main)
    rings = len(types) * (w * window + 4)
    leftovers = (csa * (2 * v4.csa_ratio - 1) * 4 * (k + d_i) + hca * (v4.hca_ratio - 1) * 2 * k) * 4
    return entries + rings + leftovers + 4


def test_v4_flash_cache_holds_3514_bytes_a_token():
    """DESIGN §5: 21 × (584 + 68)/4 + 20 × 584/128 = 3,514.25 B/token (584 = 448 FP8 + 128 BF16 RoPE + 7
    scales + 1 pad); the abstract V4-Flash cache at two capacities, and its whole size, against the formula."""
    cfg = dsv41.load_config("v4_flash", ["quant=qat"])
    assert record_bytes(cfg, 64, 8) == 584 and record_bytes(cfg, 64, 1) == 583
    sizes = {c: cache_lib.nbytes(cache_lib.abstract_cache(cfg, 1, c)) for c in (4096, 8192)}
    assert (sizes[8192] - sizes[4096]) / 4096 == 21 * (584 + 68) / 4 + 20 * 584 / 128 == 3514.25
    for c, n in sizes.items():
        assert n == closed_formula(cfg, c) == cache_lib.expected_bytes(cfg, 1, c)["total"]
    assert dsv41.kv_bytes_per_token(cfg)["total"] == 3514.25


def tiny(*overrides):
    return dsv41.load_config("tiny_v4", ["quant=qat", TYPES, *overrides])


def decode_record(row, cfg, block: int):
    """NumPy: a stored record [..., bytes] -> float32 [..., K] (ml_dtypes' E4M3 and BF16; scales 2^(byte − 127))."""
    a = cfg.architecture
    n, r = a.head_dim - a.rope_head_dim, a.rope_head_dim
    row = np.asarray(row, np.uint8)
    values = row[..., :n].view(ml_dtypes.float8_e4m3fn).astype(F64)
    rope = np.ascontiguousarray(row[..., n:n + 2 * r]).view(ml_dtypes.bfloat16).astype(F64)
    scales = np.exp2(row[..., n + 2 * r:n + 2 * r + n // block].astype(F64) - 127)
    nope = (values.reshape(*row.shape[:-1], n // block, block) * scales[..., None]).reshape(*row.shape[:-1], n)
    assert not row[..., n + 2 * r + n // block:].any()  # the pad is zero
    return F32(np.concatenate([nope, rope], axis=-1))


def decode_mxfp4(packed, scale_bytes):
    """NumPy: packed FP4 (even element in the low nibble) + UE8M0 bytes per 32 -> float32."""
    packed = np.asarray(packed, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    values = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(F64)
    scales = np.exp2(np.asarray(scale_bytes, np.uint8).astype(F64) - 127)
    return F32(values * np.repeat(scales, 32, axis=-1))


@pytest.fixture(scope="module")
def run():
    """tiny_v4 (qat) over 64 tokens: the forward with what each layer records, and one prefill of the same
    tokens into a 64-token cache."""
    cfg = tiny()
    params = model.init_params(cfg, jax.random.key(3))
    tokens = np.random.default_rng(3).integers(0, cfg.architecture.vocab_size, (2, 64))
    logits, rec = model.forward_with_intermediates(params, cfg, tokens)
    c = cache_lib.init_cache(cfg, 2, 64)
    last, c = dsv41.prefill(params, cfg, c, tokens)
    return cfg, params, tokens, np.asarray(logits), rec, c, np.asarray(last)


def test_cache_bytes_equal_the_closed_formula(run):
    cfg, *_, c, _ = run
    assert cache_lib.nbytes(c) == 2 * closed_formula(cfg, 64) == cache_lib.expected_bytes(cfg, 2, 64)["total"]


def same_codes(got, want, err_msg, exact: bool, block: int, fp4: bool = False):
    """Equal bit for bit, or (a deeper layer, whose input the chunked prefill and the forward compute in different
    float32 orders) equal but for a rounding-level flip: at most 1 element in 500, each one grid step from the
    forward's (the quantised model is threshold-chaotic: a 1e-7 difference can cross a tie). One step is at most
    2^-3 of an E4M3 value, and for E2M1 at most 2 · 2^ceil(log2(amax/6)) < amax of its block of 32."""
    got, want = np.asarray(got, F64), np.asarray(want, F64)
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
        return
    off = got != want
    assert off.sum() <= off.size / 500, (err_msg, int(off.sum()), off.size)
    if fp4:
        amax = np.abs(want).reshape(*want.shape[:-1], -1, block).max(-1)
        bound = np.repeat(amax, block, axis=-1)
    else:
        bound = 2.0**-3 * np.abs(want)
    assert (np.abs(got - want)[off] <= bound[off]).all(), err_msg


def test_stored_bytes_decode_to_the_forwards_fake_quant_values(run):
    """Every layer's window ring (the last W positions) and every CSA/HCA layer's entries and indexer keys, read
    from the cache's bytes with ml_dtypes, equal what the forward attends: bit for bit in the first layer, whose
    input is the embedding in both, and up to a rounding-level flip below it (`same_codes`)."""
    cfg, _, tokens, logits, rec, c, last = run
    np.testing.assert_allclose(last, logits[:, -1], rtol=0, atol=1e-4 * logits.std())
    w, block = cfg.kv_cache.swa_window_size, int(cfg.kv_cache.global_kv_scale.split("_")[2])
    wblock = int(cfg.kv_cache.swa_kv_scale.split("_")[2])
    rings = cache_lib.layer_rings(cfg, [np.asarray(x) for x in c.window])
    stores = cache_lib.layer_stores(cfg, jax.tree.map(np.asarray, c))
    s = tokens.shape[1]
    for i, r in enumerate(dsv41.layer_plan(cfg)):
        attn = rec[i]["attn"]
        want = np.asarray(attn["window_kv"])[:, s - w:]  # positions s-W..s-1 sit in slots p % W
        got = decode_record(rings[i], cfg, wblock)[:, np.arange(s - w, s) % w]
        same_codes(got, want, f"layer {i} window", i == 0, wblock)
        if not r.stores_entries:
            continue
        entries = np.asarray(attn["entries"])
        same_codes(decode_record(stores[i].entries, cfg, block)[:, :entries.shape[1]], entries,
                   f"layer {i} entries", i == 0, block)
        assert not np.asarray(stores[i].entry_scales).size  # the scales live in the record
        if r.mode == "csa":
            keys = np.asarray(attn["index_keys"])
            got = decode_mxfp4(stores[i].index_keys, stores[i].index_scales)[:, :keys.shape[1]]
            same_codes(got, keys, f"layer {i} indexer keys", i == 0, 32, fp4=True)


def ref_fp8_bf16(x, cfg, block: int):
    """V4's official `act_quant(kv[..., :-rd], block, "ue8m0")` (in place) in NumPy: the NoPE channels through the
    port's FP8 reference (`test_quant.ref_fp8`: UE8M0 scales per block, E4M3 values), the RoPE channels BF16."""
    rd = cfg.architecture.rope_head_dim
    x = np.asarray(x, F32)
    nope = ref_fp8(x[..., :-rd], block)[2]
    rope = x[..., -rd:].astype(ml_dtypes.bfloat16).astype(F32)
    return np.concatenate([nope, rope], axis=-1)


def ref_hadamard_mxfp4(x):
    """V4's official indexer keys: `rotate_activation` (Sylvester's Hadamard matrix / sqrt(d), float64 here), then
    `fp4_act_quant(…, 32)`: s = 2^ceil(log2(max(amax, 6·2^-126) / 6)), values E2M1 (nearest even) × s."""
    d = x.shape[-1]
    y = np.asarray(x, F64) @ sylvester(d).T / np.sqrt(d)
    b = y.reshape(*y.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(b).max(-1), 6 * 2.0**-126)
    s = np.exp2(np.ceil(np.log2(amax / 6)))[..., None]
    q = np.clip(b / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F64) * s
    return F32(q.reshape(y.shape))


def test_first_layer_against_v4s_official_quantisers(run):
    """Layer 0 (CSA) sees the embedding whether or not the model fake-quantises: its unquantised window keys,
    entries and indexer keys (quant none), quantised by the NumPy reference above, equal the qat forward's."""
    cfg, params, tokens, _, rec, _, _ = run
    plain = dsv41.load_config("tiny_v4", ["quant=none", TYPES])
    _, rec0 = model.forward_with_intermediates(params, plain, tokens)
    float_attn, qat_attn = rec0[0]["attn"], rec[0]["attn"]
    block = int(cfg.kv_cache.global_kv_scale.split("_")[2])
    wblock = int(cfg.kv_cache.swa_kv_scale.split("_")[2])
    np.testing.assert_array_equal(ref_fp8_bf16(float_attn["window_kv"], cfg, wblock), qat_attn["window_kv"])
    np.testing.assert_array_equal(ref_fp8_bf16(float_attn["entries"], cfg, block), qat_attn["entries"])
    np.testing.assert_array_equal(ref_hadamard_mxfp4(float_attn["index_keys"]), qat_attn["index_keys"])
    # The formats move the values (this is not the identity).
    assert not np.array_equal(np.asarray(float_attn["index_keys"]), np.asarray(qat_attn["index_keys"]))


def test_v4_formats_that_the_cache_cannot_hold_are_refused():
    with pytest.raises(dsv41.ConfigError) as e:
        tiny('kv_cache.swa_kv_rope_dtype="fp8"')
    assert "'kv_cache.swa_kv_rope_dtype'" in str(e.value) and "expected 'bf16'" in str(e.value)
    with pytest.raises(dsv41.ConfigError) as e:
        tiny("v4.indexer.head_dim=96")
    assert "'v4.indexer.head_dim'" in str(e.value) and "power of two" in str(e.value)
    with pytest.raises(dsv41.ConfigError) as e:
        tiny('kv_cache.global_kv_scale="e4m3_per_16_channel"')
    assert "'kv_cache.global_kv_scale'" in str(e.value) and "ue8m0_per_64_channel" in str(e.value)


def test_expected_bytes_describe_the_rounded_capacity():
    """A capacity off the compression ratios' multiple is rounded up (to 16 here: CSA 4, HCA 16), and the
    accounting describes the cache that holds it."""
    cfg = tiny()
    shapes = cache_lib.abstract_cache(cfg, 1, 33)
    assert cache_lib.nbytes(shapes) == closed_formula(cfg, 48) == cache_lib.expected_bytes(cfg, 1, 33)["total"]
