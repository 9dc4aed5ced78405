"""Comparing pytrees of arrays (gradients) in the tests."""

import jax
import numpy as np


def global_rel(want_tree, got_tree) -> float:
    """‖got − want‖ / ‖want‖ over all leaves at once (float64), the trees' structures equal."""
    want, got = jax.tree.leaves(want_tree), jax.tree.leaves(got_tree)
    assert jax.tree.structure(want_tree) == jax.tree.structure(got_tree)
    num = sum(float(np.sum((np.asarray(g, np.float64) - np.asarray(w, np.float64)) ** 2)) for w, g in zip(want, got))
    return np.sqrt(num) / np.sqrt(sum(float(np.sum(np.asarray(w, np.float64) ** 2)) for w in want))
