"""The CED split in training (`batch["prompt_lengths"]`, DESIGN §3.5): a row's decoder runs from the replayed span
of its prompt on, as the `ced` prefill schedule serves it. The reference is that serving path: the prompt
prefilled with `runtime.prefill_schedule=ced` (encoder for every token, the decoder over the last
`decoder_replay_tokens`), the response decoded token by token; the training forward's logits at the last prompt
token and at each response token equal the served ones (`quant: none`, the float cache)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41
from dsv41 import model as model_lib
from dsv41 import steps, train
from dsv41.errors import ConfigError

import models

PROMPT, RESPONSE = 80, 6


def _cfg(*extra):
    return dsv41.load_config("passkey", overrides=["quant=none", "csa2.indexer.query_heads=16",
                                                   "runtime.prefill_schedule=ced", *extra])


def _served(cfg, variables, tokens):
    """[B, RESPONSE, V]: the logits at tokens PROMPT−1 … PROMPT+RESPONSE−2, served with the ced schedule."""
    bound = steps.bind(variables, cfg)
    cache = dsv41.init_cache(cfg, tokens.shape[0], PROMPT + RESPONSE)
    logits, cache = bound.prefill(cache, tokens[:, :PROMPT], final=True)
    out = [np.asarray(logits)]
    for t in range(PROMPT, PROMPT + RESPONSE - 1):
        logits, cache = bound.decode(cache, tokens[:, t])
        out.append(np.asarray(logits))
    return np.stack(out, 1)


@pytest.mark.slow
@pytest.mark.parametrize("block", [0, 32])
def test_ced_split_forward_equals_ced_serving(block):
    cfg = _cfg(f"runtime.query_block={block}")
    variables = model_lib.init_params(cfg, jax.random.key(0))
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (2, PROMPT + RESPONSE), 0, 256), np.int32)
    want = _served(cfg, variables, tokens)
    start = train.decoder_window_start(cfg, np.full((2,), PROMPT), tokens.shape)
    assert list(start) == [PROMPT - cfg.swa_bounded_replay.decoder_replay_tokens] * 2
    got = np.asarray(models.forward(cfg, variables, tokens, decoder_window_start=jnp.asarray(start)))
    got = got[:, PROMPT - 1:PROMPT + RESPONSE - 1]
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    # and the split matters: every layer over every token (the full forward) differs from the served logits
    full = np.asarray(models.forward(cfg, variables, tokens))[:, PROMPT - 1:PROMPT + RESPONSE - 1]
    assert np.max(np.abs(full - want)) > 1e-3 * scale
    # held-out scoring of such a batch runs the same split: its answer CE is the served logits' (NumPy, float64)
    mask = np.zeros((2, PROMPT + RESPONSE - 1), np.float32)
    mask[:, PROMPT - 1:] = 1.0
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask,
             "prompt_lengths": np.full((2,), PROMPT)}
    state = train.init_state(cfg, train.TrainConfig(), jax.random.key(0), variables)
    served = want.astype(np.float64)
    logp = served - np.log(np.sum(np.exp(served - served.max(-1, keepdims=True)), -1, keepdims=True)) \
        - served.max(-1, keepdims=True)
    ce = -np.mean(np.take_along_axis(logp, tokens[:, PROMPT:, None], -1))
    assert abs(train.evaluate(state, cfg, [batch])["answer_ce"] - ce) <= 1e-5 * ce
    unsplit = {k: v for k, v in batch.items() if k != "prompt_lengths"}
    assert abs(train.evaluate(state, cfg, [unsplit])["answer_ce"] - ce) > 1e-4 * ce


@pytest.mark.slow
def test_ced_split_training_batch():
    """A batch with prompt_lengths trains through the split (loss finite, differs from the full forward's);
    loss on a token before the decoder starts, or a prompt length outside [1, S], raises naming the field."""
    cfg = _cfg()
    tc = train.TrainConfig()
    variables = model_lib.init_params(cfg, jax.random.key(0))
    tok = np.asarray(jax.random.randint(jax.random.key(4), (2, PROMPT + RESPONSE + 1), 0, 256), np.int32)
    mask = np.zeros((2, PROMPT + RESPONSE), np.float32)
    mask[:, PROMPT - 1:] = 1.0  # the response's tokens (the last prompt token predicts the first)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:], "loss_mask": mask}
    split, _ = train.loss_and_grads(cfg, tc, variables, dict(batch, prompt_lengths=np.full((2,), PROMPT)))
    full, _ = train.loss_and_grads(cfg, tc, variables, batch)
    assert np.isfinite(float(split["loss"])) and abs(float(split["ce"]) - float(full["ce"])) > 1e-4
    early = mask.copy()
    early[1, 10] = 1.0
    with pytest.raises(ValueError, match=r"batch\['loss_mask'\]: 1.0 at \[1, 10\]: expected 0 before"):
        train.loss_and_grads(cfg, tc, variables, dict(batch, loss_mask=early, prompt_lengths=np.full((2,), PROMPT)))
    with pytest.raises(ValueError, match=r"batch\['prompt_lengths'\]: 0 at row 1"):
        train.loss_and_grads(cfg, tc, variables, dict(batch, prompt_lengths=np.array([PROMPT, 0])))
    v4 = dsv41.load_config("tiny_v4")
    with pytest.raises(ConfigError, match="architecture.family"):
        train.decoder_window_start(v4, np.array([3]), (1, 8))
