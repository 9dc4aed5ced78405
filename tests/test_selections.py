"""Selection replay (`dsv41.selections`): prefill/decode return the routed experts and indexer picks they used,
and the training forward takes them (`batch["selections"]`).

The references: the whole-sequence forward's own choices (recorded), NumPy float64 for the router's weights at
forced experts, and a forward whose top-k reaches every entry (every visible entry is then the selection,
which NumPy writes down without scores). `quant: none`, 16 indexer heads (test_train_blockwise: with 4, a
near-tie pick flips under a reordered sum)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41
from dsv41 import model as model_lib
from dsv41 import selections, steps, train
from dsv41.errors import ConfigError
from dsv41.plan import layer_plan
from trees import global_rel

import models

HEADS = ["csa2.indexer.query_heads=16"]


def _cfg(name="passkey", *extra):
    return dsv41.load_config(name, overrides=["quant=none", *(HEADS if name == "passkey" else []), *extra])


def _tokens(cfg, b, s, seed=1):
    return np.asarray(jax.random.randint(jax.random.key(seed), (b, s), 0, cfg.architecture.vocab_size), np.int32)


def _forward(cfg, variables, tokens, forced=None):
    return models.forward(cfg, variables, tokens, record=True, forced=forced)


def nnx_merge(cfg, variables):
    from flax import nnx
    return nnx.merge(model_lib.graphdef(model_lib.config_key(cfg)), variables)


def _recorded(cfg, records) -> dict:
    """The selections value the forward's records hold (what it chose)."""
    flat = [selections.flat(r) for r in records]
    return {kind: {layer: np.asarray(flat[layer][kind]) for layer in layers}
            for kind, layers in selections.widths(cfg).items()}


@pytest.mark.parametrize("block", [0, 32])
def test_forced_own_choices_reproduce_the_forward(block):
    """Forced to the selections it made itself, the forward (every query at once, and blockwise) gives the same
    logits and records the same choices."""
    cfg = _cfg("tiny", f"runtime.query_block={block}")
    variables = model_lib.init_params(cfg, jax.random.key(0))
    tokens = _tokens(cfg, 2, 100)
    logits, records = _forward(cfg, variables, tokens)
    chosen = _recorded(cfg, records)
    assert all(chosen[k] for k in ("picks", "experts")), chosen.keys()
    forced_logits, forced_records = _forward(cfg, variables, tokens, selections.check(cfg, chosen, _pos(tokens)))
    np.testing.assert_array_equal(np.asarray(forced_logits), np.asarray(logits))
    again = _recorded(cfg, forced_records)
    for kind in selections.KINDS:
        for layer in chosen[kind]:
            np.testing.assert_array_equal(again[kind][layer], chosen[kind][layer], err_msg=f"{kind} {layer}")


def _pos(tokens):
    return np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)


def test_forced_picks_equal_a_top_k_over_every_entry():
    """Forcing every visible entry (written by NumPy) gives the forward of a model whose top-k reaches every
    entry (its own picks are then every visible entry, whatever the scores), and forcing changes the logits of a
    model whose top-k picks fewer: the forced picks are what the attention reads."""
    s = 96
    small_k = _cfg("passkey", "csa2.indexer.hierarchical.enabled=false")
    every = _cfg("passkey", "csa2.indexer.hierarchical.enabled=false", f"csa2.indexer.top_k={s}")
    variables = model_lib.init_params(small_k, jax.random.key(0))
    tokens = _tokens(small_k, 1, s)
    want, records = _forward(every, variables, tokens)
    own, own_records = _forward(small_k, variables, tokens)
    chosen = _recorded(small_k, own_records)
    pos = _pos(tokens)
    for layer in chosen["picks"]:
        ratio = layer_plan(small_k)[layer].ratio
        visible = (pos + 1) // ratio
        k = chosen["picks"][layer].shape[-1]
        # the k most recent visible entries: every visible entry for the first k·ratio tokens
        first = np.maximum(visible - k, 0)
        ids = first[..., None] + np.arange(k)
        chosen["picks"][layer] = np.where(ids < visible[..., None], ids, -1).astype(np.int32)
    forced, _ = _forward(small_k, variables, tokens, selections.check(small_k, chosen, pos))
    ratio = min(r.ratio for r in layer_plan(small_k) if r.ratio)
    k = small_k.csa2.indexer.top_k
    early = k * ratio  # tokens whose visible entries all fit in k: forced = every entry
    np.testing.assert_allclose(np.asarray(forced)[:, :early], np.asarray(want)[:, :early], rtol=0, atol=1e-5)
    assert np.max(np.abs(np.asarray(forced) - np.asarray(own))) > 1e-3


def test_forced_experts_weights_are_the_routers_scores():
    """MoE.route with forced experts: the weights are the router's scores at those experts (float64 NumPy),
    L1-normalised and scaled; the forced ids are kept as given."""
    cfg = _cfg("tiny")
    model = nnx_merge(cfg, model_lib.init_params(cfg, jax.random.key(0)))
    moe = model.layer(2).ffn
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, cfg.architecture.hidden_size)).astype(np.float32)
    forced = rng.integers(0, moe.num_experts, (9, moe.top_k)).astype(np.int32)
    weights, idx = moe.route(jnp.asarray(x), None, jnp.asarray(forced))
    logits = x.astype(np.float64) @ np.asarray(moe.gate[...], np.float64)
    scores = np.sqrt(np.log1p(np.exp(logits)))
    w = np.take_along_axis(scores, forced, -1)
    w = w / w.sum(-1, keepdims=True) * cfg.architecture.moe.route_scale
    np.testing.assert_array_equal(np.asarray(idx), forced)
    np.testing.assert_allclose(np.asarray(weights), w, rtol=1e-5)


@pytest.mark.slow
def test_prefill_and_decode_return_the_forwards_choices():
    """The selections a prefill chunk and the decode steps after it return are the whole-sequence forward's
    own over the same tokens (picks compared as sets; `quant: none`, the float cache)."""
    cfg = _cfg("passkey")
    variables = model_lib.init_params(cfg, jax.random.key(0))
    prompt, new = 40, 6
    tokens = _tokens(cfg, 2, prompt + new)
    bound = steps.bind(variables, cfg)
    cache = dsv41.init_cache(cfg, 2, 64)
    _, cache, first = bound.prefill(cache, tokens[:, :prompt], selections=True)
    parts = [first]
    for t in range(prompt, prompt + new):
        _, cache, chosen = bound.decode(cache, tokens[:, t], selections=True)
        parts.append(chosen)
    got = selections.concat(parts)
    _, records = _forward(cfg, variables, tokens)
    want = _recorded(cfg, records)
    assert set(got["picks"]) == set(want["picks"]) and set(got["experts"]) == set(want["experts"])
    for kind in selections.KINDS:
        for layer in want[kind]:
            a, b = np.sort(got[kind][layer], -1), np.sort(want[kind][layer], -1)
            np.testing.assert_array_equal(a, b, err_msg=f"{kind} {layer}")
    selections.check(cfg, got, _pos(tokens))


@pytest.mark.slow
def test_training_takes_replayed_selections():
    """loss_and_grads with the forward's own selections in the batch equals it without (loss to 1e-6, gradients
    to 1e-6 of their norm), blockwise; bad selections raise naming the field."""
    cfg = _cfg("passkey", "runtime.query_block=32")
    tc = train.TrainConfig().replace({"kl_over": "selected"})
    variables = model_lib.init_params(cfg, jax.random.key(0))
    tok = _tokens(cfg, 1, 81)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:], "loss_mask": np.ones((1, 80), np.float32)}
    _, records = _forward(cfg, variables, batch["inputs"])
    chosen = _recorded(cfg, records)
    m0, g0 = train.loss_and_grads(cfg, tc, variables, batch)
    m1, g1 = train.loss_and_grads(cfg, tc, variables, dict(batch, selections=chosen))
    for k in ("loss", "ce", "kl"):
        assert abs(float(m1[k]) - float(m0[k])) <= 1e-6 * max(abs(float(m0[k])), 1e-6), k
    assert global_rel(g0, g1) <= 1e-6

    layer = min(chosen["picks"])
    future = {**chosen, "picks": {**chosen["picks"], layer: chosen["picks"][layer].copy()}}
    future["picks"][layer][0, 3, 0] = 70  # an entry token 3 cannot see
    with pytest.raises(ValueError, match=rf"selections\['picks'\]\[{layer}\]: 70 at \[0, 3, 0\]"):
        train.loss_and_grads(cfg, tc, variables, dict(batch, selections=future))
    short = {**chosen, "experts": {**chosen["experts"], 0: chosen["experts"][0][:, :10]}}
    with pytest.raises(ValueError, match=r"selections\['experts'\]\[0\]: int32\[1, 10, 2\]: expected integers"):
        train.loss_and_grads(cfg, tc, variables, dict(batch, selections=short))
    missing = {**chosen, "picks": {}}
    with pytest.raises(ValueError, match=r"selections\['picks'\]: layers \[\]: expected"):
        train.loss_and_grads(cfg, tc, variables, dict(batch, selections=missing))


def test_ced_prefill_cannot_return_selections():
    cfg = _cfg("passkey", "runtime.prefill_schedule=ced")
    variables = model_lib.init_params(cfg, jax.random.key(0))
    cache = dsv41.init_cache(cfg, 1, 64)
    with pytest.raises(ConfigError, match="runtime.prefill_schedule"):
        steps.prefill(variables, cfg, cache, _tokens(cfg, 1, 40), selections=True)
