"""Training checkpoints (DESIGN §10): orbax CheckpointManager over the TrainState and the data position.

A step directory holds two items: "state" (the TrainState pytree: params, optimiser moments, step,
balance bias) and "data" (the data iterator's JSON state), so a resumed run sees exactly the batches
the uninterrupted run would have. Saves are asynchronous; orbax writes each step into a
`<step>.orbax-checkpoint-tmp*` directory and renames it when complete, so a run killed mid-save
leaves an unfinalised directory that `latest_step` ignores (the last complete step is resumed).
`restore` takes target shardings from an abstract state: a checkpoint written on one mesh is read
onto another (each array is read straight into its target sharding).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from dsv41 import stacking
from dsv41.plan import layer_stacks


class Checkpointer:
    """Save every `every` steps (async), keep the newest `keep`, resume from the newest complete one."""

    def __init__(self, directory: str | Path, every: int = 100, keep: int = 3):
        if every < 1:
            raise ValueError(f"every: {every}: expected a save interval of at least 1 step")
        if keep < 1:
            raise ValueError(f"keep: {keep}: expected to keep at least 1 checkpoint")
        options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=keep,
                                               enable_async_checkpointing=True, create=True)
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        """The newest complete (finalised) step, or None."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_state: dict, force: bool = False) -> bool:
        """Starts an async save when `step` is on the interval (or `force`); True if one started."""
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)

    def restore_data(self, step: int | None = None) -> dict:
        """The JSON saved beside the state at `step` (default: the newest complete one), without the state."""
        step = self.latest_step() if step is None else step
        return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]

    def restore(self, abstract_state, step: int | None = None, shardings=None, cfg=None):
        """(state, data_state) of `step` (default: the newest complete one).

        abstract_state: a pytree of jax.ShapeDtypeStruct (`train.abstract_state`) giving the structure;
        shardings: a matching pytree of jax.sharding.Sharding to place each array (default: the
        abstract leaves' own `.sharding`, else one device). cfg: the model config; with it, a checkpoint
        written before the layer stacks (per-layer paths `layers.{i}.…`), or stacked before a stack could have
        a lead (`plan.Stack.lead`), is read and stacked anew (`stacking.restack`), so old runs resume.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no complete checkpoint: expected at least one saved step")
        if shardings is not None:
            abstract_state = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
        else:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            abstract_state = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None) or device),
                abstract_state)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except ValueError:
            restacked = None if cfg is None else self._restack(step, abstract_state, cfg)
            if restacked is None:
                raise  # not an old layout: orbax's own message says what does not match
            return restacked
        return out["state"], out["data"]

    def _restack(self, step: int, abstract_state, cfg):
        """(state, data) of a step written in an older layout (per-layer paths, or the stacks without leads),
        read without a target and stacked; None when the step has neither."""
        raw = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
        if stacking.is_per_layer(raw["state"]):
            old = raw["state"]
        elif layer_stacks(cfg, leads=False) != layer_stacks(cfg):  # stacked before `plan.Stack.lead`
            old = stacking.unstacked(raw["state"], cfg, layer_stacks(cfg, leads=False))
            if old is None:
                return None
        else:
            return None
        state = stacking.restack(old, abstract_state, cfg)
        state = jax.tree.map(lambda x, a: jax.device_put(np.asarray(x, a.dtype), a.sharding), state, abstract_state)
        return state, raw["data"]

    def wait(self) -> None:
        """Blocks until the pending async save is finalised."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
