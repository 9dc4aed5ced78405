"""The one softmax (`nn.attend`: `window_keys` + `attend_step`) against a float64 NumPy softmax with the sink,
written from the definition query by query: the window keys are the ones at positions (q - W, q] that are
valid, then the query's own selected entries and the entries every query of the row sees; the sink adds
exp(sink) to the denominator only. Banded chunks (S >= 2W, also S not a multiple of W), short chunks and
one-token steps, rows with no valid key at all (output 0)."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41.nn.attend import attend_step, window_keys


def reference(q, keys, key_pos, key_ok, pos, window, sel, sel_ok, shared, shared_ok, sink, scale):
    b, s, h, _ = q.shape
    out = np.zeros(q.shape)
    for i in range(b):
        for t in range(s):
            seen = [keys[i, j] for j in range(keys.shape[1])
                    if key_ok[i, j] and 0 <= pos[i, t] - key_pos[i, j] < window]
            if sel is not None:
                seen += [sel[i, t, j] for j in range(sel.shape[2]) if sel_ok[i, t, j]]
            if shared is not None:
                seen += [shared[i, j] for j in range(shared.shape[1]) if shared_ok[i, t, j]]
            if not seen:
                continue
            kv = np.stack(seen)
            for head in range(h):
                logits = kv @ q[i, t, head] * scale
                top = max(logits.max(), sink[head])
                e = np.exp(logits - top)
                out[i, t, head] = e @ kv / (e.sum() + np.exp(sink[head] - top))
    return out


@pytest.mark.parametrize("s, window, picks, with_shared", [
    (40, 8, 3, True),    # banded, 40 = 5 blocks of 8
    (37, 8, 0, False),   # banded, the last block padded
    (11, 8, 4, False),   # short chunk: every query against ring + chunk
    (1, 8, 2, True),     # a one-token step
])
def test_attend_step_equals_a_float64_softmax_with_sink(s, window, picks, with_shared):
    rng = np.random.default_rng(s)
    b, h, k = 2, 4, 16
    t = window + s  # [ring | new tokens]
    held = np.array([5, 0])  # row 1 starts empty: its ring holds nothing
    key_pos = held[:, None] - window + np.arange(t)[None]
    key_ok = (key_pos >= 0) & (rng.random((b, t)) > 0.15)
    key_ok[1, :] = False  # row 1 sees no window key at all
    pos = held[:, None] + np.arange(s)[None]
    q = rng.normal(size=(b, s, h, k))
    keys = rng.normal(size=(b, t, k))
    sel = rng.normal(size=(b, s, picks, k)) if picks else None
    sel_ok = rng.random((b, s, picks)) > 0.3 if picks else None
    if picks:
        sel_ok[1, 0] = False  # ... and its first query nothing selected either
    shared = rng.normal(size=(b, 6, k)) if with_shared else None
    shared_ok = rng.random((b, s, 6)) > 0.5 if with_shared else None
    if with_shared:
        shared_ok[1, 0] = False
    sink = rng.normal(size=(h,))
    scale = k ** -0.5

    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    keys_w, mask_w = window_keys(f32(keys), jnp.asarray(key_pos), jnp.asarray(key_ok), jnp.asarray(pos), window)
    assert keys_w.ndim == (4 if s >= 2 * window else 3)
    got = attend_step(f32(q), keys_w, mask_w, f32(sel), None if sel_ok is None else jnp.asarray(sel_ok), f32(sink),
                      scale, None if shared is None else (f32(shared), jnp.asarray(shared_ok)))
    want = reference(q, keys, key_pos, key_ok, pos, window, sel, sel_ok, shared, shared_ok, sink, scale)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(got[1, 0]), 0.0)  # nothing valid: 0
