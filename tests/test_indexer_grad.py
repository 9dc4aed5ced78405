"""The indexer scores' own derivative (`indexer.lightning_scores_trained`, which the dense warm-up KL trains the
indexer through) against NumPy in float64 (central differences of the scores' formula) and against JAX's derivative
of the plain head loop."""

import jax
import jax.numpy as jnp
import numpy as np

from dsv41.nn import indexer as ix


def _inputs(seed=0, b=2, s=24, heads=16, d=8, t=40):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, s, heads, d)).astype(np.float32)
    keys = rng.standard_normal((b, t, d)).astype(np.float32)
    w = rng.standard_normal((b, s, heads)).astype(np.float32)
    visible = np.arange(t)[None, None, :] < rng.integers(0, t + 1, (b, s))[..., None]  # rows with none too
    g = rng.standard_normal((b, s, t)).astype(np.float32)
    return (*(jnp.asarray(a) for a in (q, keys, w, visible)), g)


def _scores64(q, keys, w):
    """I[b, s, t] = Σ_j w_j · J^-½ · relu(q_j · k_t) · d^-½ in float64 (the formula, not the code)."""
    heads, d = q.shape[-2:]
    dots = np.einsum("bsjd,btd->bsjt", q, keys)
    return np.einsum("bsj,bsjt->bst", w, np.maximum(dots, 0.0)) * heads ** -0.5 * d ** -0.5


def test_values_are_the_head_loops():
    q, keys, w, visible, _ = _inputs()
    got = ix.lightning_scores_trained(q, keys, w, visible)
    want = ix.lightning_scores(q, keys, w, visible, group=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gradient_matches_numpy_central_differences():
    q, keys, w, visible, g = _inputs()
    loss = lambda q, keys, w: jnp.sum(jnp.where(visible, ix.lightning_scores_trained(q, keys, w, visible), 0.0) * g)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, keys, w)
    rng = np.random.default_rng(1)
    f64 = lambda a: np.asarray(a, np.float64)
    x = [f64(a) for a in (q, keys, w)]
    for _ in range(3):  # directional derivatives along random directions of all three inputs
        v = [rng.standard_normal(a.shape) for a in x]
        f = lambda e: np.sum(np.where(visible, _scores64(*(a + e * b for a, b in zip(x, v))), 0.0) * f64(g))
        eps = 1e-6
        numeric = (f(eps) - f(-eps)) / (2 * eps)
        analytic = sum(np.sum(f64(gr) * b) for gr, b in zip(grads, v))
        assert abs(analytic - numeric) <= 1e-4 * abs(numeric), (analytic, numeric)


def test_gradient_matches_jax_derivative_of_the_head_loop():
    q, keys, w, visible, g = _inputs(seed=3)

    def loss(fn):
        return lambda q, keys, w: jnp.sum(jnp.where(visible, fn(q, keys, w), 0.0) * g)

    got = jax.grad(loss(lambda q, k, w: ix.lightning_scores_trained(q, k, w, visible)), argnums=(0, 1, 2))(q, keys, w)
    want = jax.grad(loss(lambda q, k, w: ix.lightning_scores(q, k, w, visible, group=1)), argnums=(0, 1, 2))(q, keys, w)
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
