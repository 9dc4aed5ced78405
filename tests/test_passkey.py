"""dsv41.passkey and the demo's prompt: the evaluation prompts, and the shipped trained model's retrieval
through the compressed cache (its promise: the README main job retrieves the key)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from dsv41 import demo, passkey
from dsv41.errors import ConfigError


def test_examples_put_the_key_at_the_depth():
    for depth in (0.0, 0.5, 1.0):
        prompts, answers = passkey.examples(600, depth, 3, seed=5)
        for p, a in zip(prompts, answers):
            text = bytes(p)
            assert len(p) + len(a) == 600 and a.isdigit() and len(a) == passkey.DIGITS
            needle = text.find(b"The pass key is " + a)
            assert needle >= 0 and text.endswith(b"What is the pass key? The pass key is ")
            room = 600 - len(a) - len(b" The pass key is 00000. Remember it. ") - len(
                b" What is the pass key? The pass key is ")
            assert abs(needle - 1 - depth * room) <= 1, (needle, depth * room)
    # The same example index gives the same key at every depth: depths differ only in the needle's place.
    assert passkey.examples(600, 0.0, 3, seed=5)[1] == passkey.examples(600, 1.0, 3, seed=5)[1]
    with pytest.raises(ValueError, match="depth"):
        passkey.examples(600, 1.5, 1)


def test_demo_prompt_holds_its_key():
    tokens, key = demo.prompt_tokens(1000, depth=0.25, seed=3)
    assert tokens.shape == (1000,) and tokens.dtype == np.int32
    assert bytes(tokens.astype(np.uint8)).count(b"The pass key is " + key) == 1
    with pytest.raises(ValueError, match="prompt_tokens"):
        demo.prompt_tokens(50)


def test_table_and_cli():
    rows = [{"context": c, "depth": d, "accuracy": a} for c, d, a in
            ((2048, 0.0, 1.0), (2048, 1.0, 0.5), (4096, 0.0, 0.75), (4096, 1.0, 1.0))]
    text = passkey.format_table(rows, "t")
    assert "100.0%" in text and "50.0%" in text and "75.0%" in text and "87.5%" in text
    parser = argparse.ArgumentParser()
    passkey.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["passkey", "--contexts", "2048", "--depths", "0,1", "--n", "4", "--set", "quant=none"])
    assert (args.contexts, args.depths, args.n, args.set) == ("2048", "0,1", 4, ["quant=none"])


def test_bad_contexts_and_weights_are_errors_naming_them():
    """A fractional context is refused, not truncated to an int; one too short for the needle, the question
    and the answer names the context and the length it needs; a missing --weights file is named."""
    parser = argparse.ArgumentParser()
    passkey.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(ConfigError, match=r"'--contexts' = '2048.5'"):
        passkey.run(parser.parse_args(["passkey", "--contexts", "2048.5"]))
    with pytest.raises(ConfigError, match=r"'context' = 40: expected at least 81"):
        passkey.examples(40, 0.5, 1)
    with pytest.raises(ConfigError, match=r"'--weights' = '/nonexistent/w.safetensors': expected an existing"):
        passkey.run(parser.parse_args(["passkey", "--weights", "/nonexistent/w.safetensors"]))


@pytest.mark.slow
def test_shipped_model_retrieves_the_key_through_the_fp4_cache():
    """The trained weights beside configs/passkey.json load against the config, and greedy decoding after
    a chunked prefill through the FP4 / FP8 cache returns the key on at least 7 of 8 prompts at 2K and at
    4K tokens, needle in the middle. The prompts (seed 7) are not the README table's (seed 0), and the
    answers come from the data generator, not from the model."""
    if not passkey.weights_path().is_file():
        pytest.fail("configs/passkey.safetensors is missing: the README main job's model must ship")
    cfg, params = passkey.load_trained()
    assert cfg.quant == "qat"
    for context in (2048, 4096):
        r = passkey.accuracy(params, cfg, context, 0.5, 8, seed=7)
        assert r["accuracy"] >= 7 / 8, r
