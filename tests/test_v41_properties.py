"""V4.1 properties no oracle covers, over random weights and inputs."""

import jax
import numpy as np
import pytest

import dsv41
from dsv41 import model

pytestmark = pytest.mark.slow  # the 12-layer tiny model's forward with intermediates compiles


@pytest.fixture(scope="module")
def run():
    cfg = dsv41.load_config("tiny", overrides=["csa2.indexer.hierarchical.max_blocks=2",
                                               "csa2.indexer.hierarchical.candidate_pool_size=16"])
    params = model.init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.architecture.vocab_size, (2, 150))
    logits, inter = model.forward_with_intermediates(params, cfg, tokens)
    return cfg, params, tokens, np.asarray(logits), jax.tree.map(np.asarray, inter)


def picks(inter, layer):
    return inter[layer]["attn"]["picks"]


def test_no_selected_entry_holds_a_later_token(run):
    cfg, _, tokens, _, inter = run
    for r in dsv41.layer_plan(cfg):
        if r.mode not in ("full", "reindex"):
            continue
        p = picks(inter, r.index)  # [B, S, k]
        t = np.arange(tokens.shape[1])[None, :, None]
        last_token = r.ratio * p + r.ratio - 1  # the last token pooled into entry p
        assert np.all((p == -1) | (last_token <= t)), r
        if r.mode == "full":  # a Full layer picks min(visible, top_k) entries; Reindex ones fewer (the pool)
            visible = (t[..., 0] + 1) // r.ratio
            assert np.all((p != -1).sum(-1) == np.minimum(visible, cfg.csa2.indexer.top_k)), r


def test_reindex_picks_lie_inside_the_pool(run):
    cfg, _, _, _, inter = run
    plan = dsv41.layer_plan(cfg)
    source = plan[next(r.index for r in plan if r.mode == "reindex")].candidate_source
    blocks = inter[source]["attn"]["pool_blocks"]  # [B, S, n_blocks]
    block = cfg.csa2.indexer.hierarchical.positions_per_block
    assert blocks.sum(-1).max() <= cfg.csa2.indexer.hierarchical.max_blocks
    for r in plan:
        if r.mode != "reindex":
            continue
        p = picks(inter, r.index)
        b, s, _ = np.nonzero(p >= 0)
        assert blocks[b, s, p[p >= 0] // block].all(), r
        assert (p >= 0).any()


def test_logits_are_causal(run):
    """Changing the tokens after position t leaves the logits up to t unchanged, bit for bit."""
    cfg, params, tokens, logits, _ = run
    changed = tokens.copy()
    changed[:, 97:] = (changed[:, 97:] + 1) % cfg.architecture.vocab_size
    again = np.asarray(model.forward(params, cfg, changed))
    np.testing.assert_array_equal(again[:, :97], logits[:, :97])
    assert np.abs(again[:, 97:] - logits[:, 97:]).max() > 0
