"""Continued training of the compressed architecture (DESIGN §10).

One optimiser step is the pure, jitted `train_step(state, batch) -> (state, metrics)`:
- next-token cross-entropy on the decoder outputs, the mean over tokens weighted by the batch's
  `loss_mask` (1 on the response of a prompt/response example, 0 or a small weight on its prompt; see
  `dsv41.data` for the split rules);
- the lightning indexer trained by a KL loss toward the main attention (V3.2's DSA recipe): for each
  Full/Reindex layer and query t, the target p[t, :] is the layer's main attention probability on each
  selectable compressed entry summed over heads and L1-normalised, under stop-gradient; the indexer
  sees a detached input, so this loss trains only the indexer and the indexer gets no other gradient
  (its top-k is not differentiable);
- fake quantisation with straight-through gradients (`quant = "qat"`, inside the model's forward);
- AdamW with linear warm-up and cosine decay, global-norm clipping, gradient accumulation by a scan
  over micro-batches (the accumulated gradient equals the whole batch's);
- the MoE selection bias (`BalanceBias`) moved outside the gradient after the step, as DeepSeek-V3:
  bias_e += γ · sign(mean load − load_e);
- rematerialisation: `remat="block"` recomputes each layer in the backward pass (jax.checkpoint per
  block; the blockwise forward's picks are kept), `"dots"` keeps only the matmul outputs of each block,
  `"none"` keeps everything;
- sequences longer than `runtime.query_block` run blockwise (`Attention._blockwise`, `_layer_kl_blocks`):
  memory linear in the length, the same loss and gradients as every query at once;
- on a mesh (`make_train_step(..., mesh=)`, `dsv41.sharding`'s `train` rules): FSDP parameters and
  optimiser state, rows over data × expert and each row's tokens over `context` (sequence parallel: the
  query blocks run one per device span at a time, the keys gathered whole per layer), the same loss and
  gradients as one device.
Only `nnx.Param` leaves are differentiated and updated by the optimiser; the other variables
(`BalanceBias`, V4's fixed `HashRoute` tables) travel in `TrainState.buffers`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsv41 import model as model_lib
from dsv41 import schema, selections, xla_options
from dsv41.errors import ConfigError
from dsv41.nn import indexer as ix
from dsv41.nn.attend import band_source, blocks_length, over_query_blocks, window_from, window_mask
from dsv41.nn.moe import BalanceBias
from dsv41.nn.rope import apply_rope
from dsv41.plan import FULL, REINDEX, layer_plan, layer_stacks

REMAT = ("none", "block", "dots")
SELECTION = ("picks", "pool_ids")  # the names `Attention.select_blocks` gives its results (jax.ad_checkpoint)
KL_OVER = ("selectable", "selected")
KL_PARTS = 8  # the dense warm-up KL's causal parts (`_layer_kl_blocks`)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimiser and loss settings (the model itself comes from the dsv41 config).

    kl_over: "selected" (the default) — the KL runs over the top-k each layer attends: V3.2's sparse stage, what
    continued training of a model whose indexer is trained runs (the shipped V4.1 and passkey weights), the main
    model and the indexer training together; "selectable" — over every entry the layer may select from (visible,
    and in the candidate pool for Reindex layers): V3.2's dense warm-up, which trains a fresh indexer while the
    main model stays frozen (`kl_over="selectable", freeze_main=True`). The dense KL's arithmetic grows as S·T
    (`_layer_kl_blocks`), the sparse one's as S·k.
    """
    # The passkey model (configs/passkey.json, S 96, batch 8, dense selection) reached held-out exact
    # match 1.0 at 1e-3 by step 750 on answers alone (600 with the filler at loss weight 0.2); at 3e-3
    # it stayed at answer CE 2.3 for 1450 steps (filler 0.2), and answers alone at 3e-3 for 2000 steps
    # then 1.5e-3 for 2500 ended at CE 1.7, "any digit of the key".
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    total_steps: int = 1000  # the cosine's horizon; training may stop earlier
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    grad_accum: int = 1
    indexer_kl_weight: float = 1.0
    kl_over: str = "selected"
    balance_rate: float = 1e-3  # γ of the bias update (DeepSeek-V3 uses 1e-3)
    remat: str = "none"
    freeze_main: bool = False  # V3.2's indexer warm-up: only the indexer trains, on the KL alone (`trainable`)
    # Parameters kept as they are, by name on their path (comma-separated: "engram", "engram,embed"): no gradient
    # is taken for them and the optimiser holds no moments for them (`trainable`). V4.1-Flash's Engram tables
    # are 197B of its 748B parameters: frozen, the full-size step's state per chip 46.6 -> 23.8 GiB (README).
    # The optimiser state's structure follows it: resume a run with the value it started with.
    frozen: str = ""

    def __post_init__(self):
        checks = [("warmup_steps", self.warmup_steps >= 0, "at least 0"),
                  ("total_steps", self.total_steps > 0, "a positive step count"),
                  ("grad_accum", self.grad_accum >= 1, "at least 1"),
                  ("learning_rate", self.learning_rate > 0, "a positive rate"),
                  ("clip_norm", self.clip_norm > 0, "a positive norm"),
                  ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                  ("indexer_kl_weight", self.indexer_kl_weight >= 0, "at least 0"),
                  ("balance_rate", self.balance_rate >= 0, "at least 0"),
                  ("remat", self.remat in REMAT, f"one of {REMAT}"),
                  ("kl_over", self.kl_over in KL_OVER, f"one of {KL_OVER}"),
                  ("frozen", all(self.frozen_names), "comma-separated parameter names, e.g. 'engram' or "
                                                     "'engram,embed'")]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"train.{name}", getattr(self, name), f"expected {expected}")

    @property
    def frozen_names(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.frozen.split(",")) if self.frozen.strip() else ()

    def replace(self, overrides: dict) -> "TrainConfig":
        """A copy with `{field: value}` overrides (strings from the command line are converted)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        out = {}
        for name, value in overrides.items():
            if name not in fields:
                raise ConfigError(f"train.{name}", value, f"unknown field; expected one of {sorted(fields)}")
            kind = type(getattr(self, name))
            try:
                out[name] = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"train.{name}", value, f"expected {kind.__name__}") from None
        return dataclasses.replace(self, **out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """params: the nnx.Param leaves; buffers: the other variables (BalanceBias, HashRoute)."""
    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    buffers: nnx.State


def schedule(tc: TrainConfig) -> optax.Schedule:
    """Linear warm-up to `learning_rate`, then cosine decay to `min_lr_ratio · learning_rate`."""
    return optax.warmup_cosine_decay_schedule(
        0.0, tc.learning_rate, tc.warmup_steps, max(tc.total_steps, tc.warmup_steps + 1),
        tc.learning_rate * tc.min_lr_ratio)


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW; matrices decay, vectors (norms, sinks, mHC bias/scale) do not."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(schedule(tc), tc.b1, tc.b2, tc.eps, weight_decay=tc.weight_decay,
                                   mask=decay_mask))


def split_variables(variables: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(Param leaves, everything else) of `init_params`' state."""
    return nnx.split_state(variables, nnx.Param, ...)


def trainable(tc: TrainConfig, params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the parameters the optimiser trains, the frozen ones), split by the names on each leaf's path: those
    `tc.frozen` names (`engram` holds `engram.{k}.table` and the Engram projections) and, with `freeze_main`,
    every one outside an `indexer`. A frozen parameter is not differentiated and holds no optimiser moments. A
    name no parameter carries is an error."""
    names = tc.frozen_names
    if not names and not tc.freeze_main:
        return params, nnx.State({})
    flat = nnx.to_flat_state(params)
    keys = {str(k) for path, _ in flat for k in path}
    missing = [n for n in names if n not in keys]
    if missing:
        raise ConfigError("train.frozen", tc.frozen, f"no parameter path holds {missing[0]!r}; expected names such as "
                                                     "'engram', 'embed', 'head', 'ffn', 'attn'")
    hit = lambda path: (any(str(k) in names for k in path)
                        or (tc.freeze_main and not any(str(k) == "indexer" for k in path)))
    return (nnx.from_flat_state([(p, v) for p, v in flat if not hit(p)]),
            nnx.from_flat_state([(p, v) for p, v in flat if hit(p)]))


def check_trainable_format(cfg) -> None:
    """Training keeps master weights in float32 or bfloat16: a config of the `shipped` weight format is refused
    (a shipped checkpoint loads into the master dtype dequantised: `convert.load_params` with an f32/bf16 config)."""
    from dsv41.nn.policy import weight_format
    if weight_format(cfg) == "shipped":
        raise ConfigError("runtime.weight_format", "shipped",
                          "expected 'f32' or 'bf16' for training (the master weights; a shipped checkpoint loads "
                          "into them dequantised, --init-from)")


def init_state(cfg, tc: TrainConfig, key: jax.Array, variables: nnx.State | None = None) -> TrainState:
    """A fresh TrainState at step 0 with zero optimiser moments (for the `trainable` parameters), from
    `variables` (e.g. `load_params`, for continued training) or else `init_params(cfg, key)`."""
    check_trainable_format(cfg)
    params, buffers = split_variables(model_lib.init_params(cfg, key) if variables is None else variables)
    return _committed(TrainState(params, optimizer(tc).init(trainable(tc, params)[0]), jnp.zeros((), jnp.int32),
                                 buffers))


def _committed(tree):
    """`tree` with each uncommitted array committed to the device it is on. A state restored from a checkpoint
    is committed (`Checkpointer.restore`), and jit lowers committed and uncommitted arguments to different
    programs: with a fresh state left uncommitted, a resumed run compiled its train step again instead of
    loading the first run's from the persistent compile cache."""
    def commit(x):
        if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) or x.committed:
            return x
        return jax.device_put(x, x.sharding)

    return jax.tree.map(commit, tree)


def abstract_state(cfg, tc: TrainConfig) -> TrainState:
    """Shapes and dtypes of a TrainState, nothing allocated."""
    return jax.eval_shape(lambda: init_state(cfg, tc, jax.random.key(0)))


# ------------------------------------------------------------------------------------------------
# The forward with what the losses need


def _forward_records(model, tokens_BS, positions_BS, remat: str, engram_ids_BSLC=None, forced=None,
                     decoder_window_start=None):
    """(logits [B,S,V], per-layer records {name: array}): the model's own forward, each stack group
    rematerialised under `remat` ("block": save only the blockwise forward's picks, "dots": save the weight
    matmuls), forced to the selections `forced` when given (selection replay), the decoder's windows starting
    at decoder_window_start [B] when given (the CED split)."""
    # "block" keeps the blockwise forward's picks and pool ids (integers, `Attention.select_blocks`): the
    # backward pass then recomputes the layers without their selection.
    policy = {"none": None, "block": jax.checkpoint_policies.save_only_these_names(*SELECTION),
              "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[remat]
    logits, records = model(tokens_BS, positions_BS, engram_ids_BSLC, record=True, remat=policy, forced=forced,
                            decoder_window_start=decoder_window_start)
    return logits, [selections.flat(r) for r in records]


def indexer_kl(model, rows: list[dict], positions_BS, kl_over: str, decoder_window_start=None):
    """(Σ KL, number of query rows) over the Full/Reindex layers (V4.1), in fp32.

    Per layer and query t with at least one selectable entry:
      p = Σ_h softmax([window | selectable entries | sink])_h restricted to the entries, L1-normalised,
      KL(p ‖ softmax(I restricted to the same entries)).
    Everything on the main path is under stop-gradient; only the indexer's query, weights and keys
    (for the keys: of the kv_source's indexer) receive gradients. decoder_window_start: the forward's (the
    decoder layers' windows as the CED split truncates them).
    """
    total, count = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    sg = jax.lax.stop_gradient
    for i, row in enumerate(rows):
        rec = model.plan[i]  # the layer's own record (a stacked module holds its first group's)
        if rec.mode not in (FULL, REINDEX):
            continue
        block = model.layer(i)
        attn = block.attn
        if attn.indexer is None:
            continue
        start = decoder_window_start if rec.stage == "decoder" else None
        if 0 < attn.query_block < positions_BS.shape[1]:
            kl, has = _layer_kl_blocks(model, rows, i, positions_BS, kl_over, start)
            total += jnp.sum(kl)
            count += jnp.sum(has)
            continue
        cinv = np.asarray(attn.compressed_inv_freq, np.float32)
        x, qr, q = _kl_queries(block, row, positions_BS)
        b, s, _ = x.shape
        entries = sg(rows[rec.kv_source]["entries"]).astype(q.dtype)
        n = entries.shape[1]
        visible = ix.visible_entries(positions_BS, rec.ratio, n)
        if kl_over == "selected":
            allowed = ix.indices_to_mask(row["picks"], n)
        elif rec.candidate_source is not None:
            pool = rows[rec.candidate_source]["pool_blocks"]
            allowed = visible & ix.blocks_to_entries(pool, attn.pool_block_size, n)
        else:
            allowed = visible
        # Target: the main attention's own softmax (window keys, entries, sink) as `attend` computes it.
        window = row["window_kv"]
        scale = attn.head_dim ** -0.5
        hi = jax.lax.Precision.HIGHEST
        win_logits = jnp.einsum("bshk,btk->bhst", q, window, precision=hi, preferred_element_type=jnp.float32)
        ent_logits = jnp.einsum("bshk,btk->bhst", q, entries, precision=hi, preferred_element_type=jnp.float32)
        win_mask = window_mask(positions_BS, positions_BS, attn.window) & window_from(positions_BS, start)[:, None]
        sink = jnp.broadcast_to(attn.attn_sink[...].astype(jnp.float32)[None, :, None, None], (b, attn.heads, s, 1))
        logits = jnp.concatenate([jnp.where(win_mask[:, None], win_logits * scale, -jnp.inf),
                                  jnp.where(allowed[:, None], ent_logits * scale, -jnp.inf), sink], axis=-1)
        probs = jax.nn.softmax(logits, axis=-1)[..., s:s + n].sum(axis=1)  # [B, S, T]
        target = sg(probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30))
        # Prediction: the indexer on detached inputs; keys from the kv_source's indexer.
        source_block = model.layer(rec.kv_source)
        source = source_block.attn
        latent = sg(source.compressor(source_block.attn_norm(rows[rec.kv_source]["attn_input"])))
        keys = source.indexer.keys(latent, ix.entry_positions(latent, rec.ratio), cinv, attn.fake_quant)
        scores = attn.indexer.scores(x, qr, positions_BS, keys, allowed, cinv, attn.fake_quant)
        log_q = jax.nn.log_softmax(scores, axis=-1)
        has = allowed.any(-1)
        safe = lambda a: jnp.where(allowed, a, 0.0)
        kl = jnp.sum(safe(target * (jnp.log(jnp.maximum(target, 1e-30)) - log_q)), axis=-1)
        total += jnp.sum(jnp.where(has, kl, 0.0))
        count += jnp.sum(has)
    return total, count


def _kl_queries(block, row: dict, positions_BS):
    """(x, qr, q) of a layer's KL: its normalised attention input and query latent (detached) and its main
    queries [B, S, H, K] (the target is detached where it is formed)."""
    sg, attn = jax.lax.stop_gradient, block.attn
    x = sg(block.attn_norm(row["attn_input"]))
    qr = sg(attn.q_norm(attn.wq_a(x)))
    b, s, _ = x.shape
    q = apply_rope(attn.wq_b(qr).reshape(b, s, attn.heads, attn.head_dim), positions_BS,
                   np.asarray(attn.inv_freq, np.float32))
    return x, qr, q


def _layer_kl_blocks(model, rows: list[dict], i: int, positions_BS, kl_over: str, window_start=None):
    """Layer i's term of `indexer_kl` per query (kl [B, S], has [B, S]), `query_block` queries at a time as
    the blockwise forward runs (`Attention._blockwise`), in memory linear in S: the main attention's logits
    over the query's window band and its candidate entries — its picks ("selected"), its candidate pool's
    entries (a Reindex layer, "selectable"), or every visible entry (a Full layer, "selectable", the only
    part whose arithmetic grows as S·T; its blocks run in up to `KL_PARTS` causal parts, each over the entries
    its last query sees) — and the indexer's scores over the same entries."""
    sg = jax.lax.stop_gradient
    rec, row = model.plan[i], rows[i]
    block = model.layer(i)
    attn = block.attn
    cinv = np.asarray(attn.compressed_inv_freq, np.float32)
    x, qr, q = _kl_queries(block, row, positions_BS)
    b, s, _ = x.shape
    qI, w = attn.indexer.query(x, qr, positions_BS, cinv, attn.fake_quant)
    entries = sg(rows[rec.kv_source]["entries"]).astype(q.dtype)
    source_block = model.layer(rec.kv_source)
    source = source_block.attn
    latent = sg(source.compressor(source_block.attn_norm(rows[rec.kv_source]["attn_input"])))
    keys = source.indexer.keys(latent, ix.entry_positions(latent, rec.ratio), cinv, attn.fake_quant)
    window, qb, scale = attn.window, attn.query_block, attn.head_dim ** -0.5
    seq = attn.policy.lowering.sequence  # sequence parallel: every lane reads the whole keys
    win_keys, win_pos, win_ok = band_source(sg(row["window_kv"]), positions_BS, window, blocks_length(s, qb, seq),
                                            window_start)
    if seq is not None:
        win_keys, win_pos, win_ok, entries, keys = (seq.whole(a) for a in (win_keys, win_pos, win_ok, entries, keys))
    if kl_over == "selected":
        chosen = row["picks"]
    elif rec.candidate_source is not None:
        chosen = rows[rec.candidate_source]["pool_ids"]
    else:
        chosen = None  # every visible entry
    sink = attn.attn_sink[...].astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    gather = jax.vmap(lambda t, ids: t[ids])

    def blocks_from(first: int, entries, keys):  # fn of the blocks first, first + 1, … over these entries
        def one(n, q_b, qI_b, w_b, pos_b, chosen_b):
            n = n + first
            span = qb + window
            keys_b, kpos_b, kok_b = (jax.lax.dynamic_slice_in_dim(a, n * qb, span, axis=1)
                                     for a in (win_keys, win_pos, win_ok))
            win_mask = kok_b[:, None, :] & window_mask(pos_b, kpos_b, window)
            if chosen_b is None:
                allowed = ix.visible_entries(pos_b, rec.ratio, entries.shape[1])
                ent = lambda q_h: jnp.einsum("bqk,btk->bqt", q_h, entries, precision=hi)
                scores = ix.lightning_scores_trained(qI_b, keys, w_b, allowed)
            else:
                if kl_over == "selected":
                    ids, allowed = chosen_b, chosen_b >= 0
                else:
                    ids, allowed = ix.pool_entries(chosen_b, attn.pool_block_size, (pos_b + 1) // rec.ratio)
                ids = jnp.maximum(ids, 0)
                chosen_entries = gather(entries, ids)  # [B, Q, C, K]
                ent = lambda q_h: jnp.einsum("bqk,bqck->bqc", q_h, chosen_entries, precision=hi)
                scores = ix.lightning_scores_per_query(qI_b, gather(keys, ids), w_b, allowed, group=1)

            def head(h, acc):  # one head's softmax over [window | entries | sink], its entries' part added up
                q_h = sg(jax.lax.dynamic_index_in_dim(q_b, h, axis=2, keepdims=False))  # [B, Q, K]
                lw = jnp.where(win_mask, jnp.einsum("bqk,btk->bqt", q_h, keys_b, precision=hi) * scale, -jnp.inf)
                le = jnp.where(allowed, ent(q_h) * scale, -jnp.inf)
                top = jnp.maximum(jnp.maximum(lw.max(-1), le.max(-1)), sink[h])[..., None]
                pe = jnp.exp(le - top)
                den = jnp.exp(sink[h] - top) + jnp.exp(lw - top).sum(-1, keepdims=True) + pe.sum(-1, keepdims=True)
                return acc + pe / den

            probs = jax.lax.fori_loop(0, attn.heads, head, jnp.zeros(allowed.shape, jnp.float32))  # [B, Q, C]
            target = sg(probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30))
            log_q = jax.nn.log_softmax(scores, axis=-1)
            kl = jnp.sum(jnp.where(allowed, target * (jnp.log(jnp.maximum(target, 1e-30)) - log_q), 0.0), axis=-1)
            has = allowed.any(-1)
            return jnp.where(has, kl, 0.0), has

        return one

    args, pads = (q, qI, w, positions_BS, chosen), (0, 0, 0, -1, -1)
    if chosen is not None or seq is not None:
        return over_query_blocks(blocks_from(0, entries, keys), qb, *args, pads=pads, sequence=seq)
    # Every visible entry (the dense warm-up): the blocks in causal parts, each part's queries scored against
    # the entries its last query sees only, so the S·T arithmetic is (parts + 1) / (2 · parts) of the whole.
    nb = -(-s // qb)
    parts = min(nb, KL_PARTS)
    cuts = [nb * j // parts for j in range(parts + 1)]
    out = []
    for b0, b1 in zip(cuts, cuts[1:]):
        t = max(1, min(entries.shape[1], b1 * qb // rec.ratio))
        part = [None if a is None else a[:, b0 * qb:b1 * qb] for a in args]
        out.append(over_query_blocks(blocks_from(b0, entries[:, :t], keys[:, :t]), qb, *part, pads=pads))
    return tuple(jnp.concatenate(o, axis=1) for o in zip(*out))


def expert_load(model, rows: list[dict]) -> dict[int, jax.Array]:
    """{layer: tokens routed to each expert [E] (fp32)} for the layers with a BalanceBias."""
    out = {}
    for i, row in enumerate(rows):
        ffn = model.layer(i).ffn
        if ffn.bias is not None:
            out[i] = jnp.zeros((ffn.num_experts,), jnp.float32).at[row["experts"].reshape(-1)].add(1.0)
    return out


def kl_rows(cfg, batch: int, seq: int) -> int:
    """Query rows the KL averages over: per Full/Reindex layer, positions p with (p + 1) // ratio ≥ 1."""
    if cfg.architecture.family != schema.V41:
        return 0
    return sum(batch * max(seq - r.ratio + 1, 0) for r in layer_plan(cfg) if r.mode in (FULL, REINDEX))


# ------------------------------------------------------------------------------------------------
# The step


def with_engram_ids(cfg, batch: dict) -> dict:
    """The batch with its host-side Engram hash ids ("engram_ids" [B, S, L_engram, C] int32, rows
    starting at position 0) when the config has Engram layers and the batch does not bring them."""
    if not list(cfg.architecture.engram.layers) or "engram_ids" in batch:
        return batch
    ids = model_lib.engram_ids(cfg, np.asarray(batch["inputs"]))
    return dict(batch, engram_ids=jnp.asarray(ids, jnp.int32))


def _check_batch(cfg, batch: dict) -> dict:
    """The batch, checked: its arrays [batch, seq]; its optional "selections" (selection replay: the choices
    the sampler made for these tokens, `dsv41.selections`) checked against the config and made int32; its
    optional "prompt_lengths" [batch] (the CED split, `decoder_window_start`) checked against the loss mask."""
    need = ("inputs", "targets", "loss_mask")
    missing = [k for k in need if k not in batch]
    if missing:
        raise ValueError(f"batch: missing {missing}: expected the keys {need} (each [batch, seq])")
    shape = batch["inputs"].shape
    for k in need:
        if batch[k].shape != shape or len(shape) != 2:
            raise ValueError(f"batch[{k!r}]: shape {batch[k].shape}: expected [batch, seq] = {shape}")
    optional = ("engram_ids", "selections", "prompt_lengths")
    extra = sorted(set(batch) - {*need, *optional})
    if extra:
        raise ValueError(f"batch: keys {extra}: expected {need}, and optionally {optional}")
    if "prompt_lengths" in batch:
        start = decoder_window_start(cfg, batch["prompt_lengths"], shape)
        before = np.arange(shape[1])[None, :] < start[:, None]
        bad = before & (np.asarray(batch["loss_mask"]) != 0)
        if bad.any():
            row, t = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"batch['loss_mask']: {np.asarray(batch['loss_mask'])[row, t]} at [{row}, {t}]: expected 0 "
                             f"before the CED split's decoder starts (row {row}: prompt_lengths "
                             f"{int(np.asarray(batch['prompt_lengths'])[row])} − decoder_replay_tokens = token "
                             f"{int(start[row])}): no decoder output exists there")
        batch = dict(batch, prompt_lengths=jnp.asarray(batch["prompt_lengths"], jnp.int32))
    if "selections" not in batch:
        return batch
    positions = np.broadcast_to(np.arange(shape[1]), shape)
    chosen = selections.check(cfg, batch["selections"], positions)
    return dict(batch, selections={kind: {layer: jnp.asarray(v) for layer, v in layers.items()}
                                   for kind, layers in chosen.items()})


def decoder_window_start(cfg, prompt_lengths_B, shape=None):
    """[B] int: the first token each row's decoder sees under the CED split (DESIGN §3.5): a row's prompt runs
    the encoder (and the decoder's KV source, whose entries come from the encoder's output); only its last
    `swa_bounded_replay.decoder_replay_tokens` run the decoder, as the `ced` prefill replays them, and the
    response after it. shape: the batch's [B, S], to check prompt_lengths against (host values)."""
    if cfg.architecture.family != schema.V41:
        raise ConfigError("architecture.family", cfg.architecture.family,
                          "expected 'v41' for batch['prompt_lengths']: the CED split needs V4.1's encoder and decoder")
    replay = int(cfg.swa_bounded_replay.decoder_replay_tokens)
    if shape is None:
        return jnp.maximum(prompt_lengths_B - replay, 0)
    lengths = np.asarray(prompt_lengths_B)
    b, s = shape
    if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"batch['prompt_lengths']: {lengths.dtype}{list(lengths.shape)}: expected integers [{b}]")
    if lengths.min() < 1 or lengths.max() > s:
        row = int(np.argmax((lengths < 1) | (lengths > s)))
        raise ValueError(f"batch['prompt_lengths']: {int(lengths[row])} at row {row}: expected a prompt length in "
                         f"[1, {s}]")
    return np.maximum(lengths - replay, 0)


def _loss_fn(cfg, tc: TrainConfig, lowering=None):
    """losses(params, buffers, batch, n_tokens, n_rows) -> (loss, (Σ ce, Σ kl, expert load)) of one (micro-)batch,
    the sums over the whole batch's denominators (so micro-batch gradients add up to the batch's). lowering:
    how the model is traced (`mesh_lowering` on a mesh)."""
    graphdef = model_lib.graphdef(model_lib.config_key(cfg), lowering)
    use_kl = tc.indexer_kl_weight > 0 and cfg.architecture.family == schema.V41

    def losses(params, buffers, mb, n_tokens, n_rows):
        model = nnx.merge(graphdef, params, buffers)
        s = mb["inputs"].shape[1]
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), mb["inputs"].shape)
        start = decoder_window_start(cfg, mb["prompt_lengths"]) if "prompt_lengths" in mb else None
        logits, rows = _forward_records(model, mb["inputs"], positions, tc.remat, mb.get("engram_ids"),
                                        mb.get("selections"), start)
        mask = mb["loss_mask"].astype(jnp.float32)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), mb["targets"][..., None], -1)[..., 0]
        ce_sum = jnp.sum(ce * mask)
        kl_sum = indexer_kl(model, rows, positions, tc.kl_over, start)[0] if use_kl else jnp.zeros(())
        loss = (0.0 if tc.freeze_main else ce_sum / n_tokens) + tc.indexer_kl_weight * kl_sum / n_rows
        return loss, (ce_sum, kl_sum, expert_load(model, rows))

    return losses


TRAIN_RULES = ("train", "train_long")  # the `dsv41.sharding` presets a training mesh takes


def loss_and_grads(cfg, tc: TrainConfig, variables: nnx.State, batch: dict, *, mesh=None, rules="train"):
    """(metrics {loss, ce, kl}, gradients of the Param leaves) of one batch at `variables` (`init_params`'
    state), as `train_step` computes them before its update (no accumulation, no clipping): what the blockwise
    and whole-sequence forwards are compared by, and what a custom optimiser loop can start from (every
    parameter's, `train.frozen` ones too). mesh: run on it under `rules` (as `make_train_step`); the gradients
    come back sharded like the parameters."""
    batch = _check_batch(cfg, batch)
    batch = with_engram_ids(cfg, batch)
    rules_items = ()
    if mesh is not None:
        from dsv41 import sharding
        variables = jax.device_put(variables, sharding.param_shardings(cfg, mesh, rules))
        batch = shard_batch(cfg, batch, mesh, rules)
        rules_items = sharding.rules_key(rules)
    params, buffers = split_variables(variables)
    b, s = batch["inputs"].shape
    n_tokens = jnp.maximum(jnp.sum(jnp.asarray(batch["loss_mask"], jnp.float32)), 1.0)
    n_rows = float(max(kl_rows(cfg, b, s), 1))
    grads, (ce_sum, kl_sum, _) = _jitted_grads(model_lib.config_key(cfg), tc, mesh, rules_items)(
        params, buffers, batch, n_tokens, n_rows)
    ce, kl = ce_sum / n_tokens, kl_sum / n_rows
    return {"loss": (0.0 if tc.freeze_main else ce) + tc.indexer_kl_weight * kl, "ce": ce, "kl": kl}, grads


def cpu_compiler_options(mesh=None) -> dict | None:
    """XLA options of the training programs on the CPU backend (None elsewhere; mesh: the devices the program
    is for, e.g. a TPU topology compiled ahead of time on this CPU).

    XLA:CPU's concurrency-optimised scheduler (its default) starts every rematerialised layer group's
    recomputation at the head of the backward pass, where they all stay live: at 16K tokens of the
    passkey config the step's temporaries were 4.77 GB with it and 2.23 GB with the memory-optimised
    scheduler (`compiled.memory_analysis()`, remat="block"). With the options every program has
    (`xla_options.compiler_options`)."""
    return xla_options.compiler_options(None if mesh is None else mesh.devices.flat[0].platform,
                                        xla_cpu_scheduler_type="CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED")


@functools.lru_cache(maxsize=8)
def _jitted_grads(key: str, tc: TrainConfig, mesh=None, rules_items: tuple = ()):
    """The jitted gradient of `_loss_fn`; on a mesh under the rules (rules_items: `sharding.rules_key`), the
    gradients sharded like the parameters."""
    cfg = model_lib.config_from_key(key)
    fn = jax.grad(_loss_fn(cfg, tc, None if mesh is None else mesh_lowering(cfg, mesh, dict(rules_items))),
                  has_aux=True)
    if mesh is None:
        return jax.jit(fn, compiler_options=cpu_compiler_options())
    from jax.sharding import NamedSharding, PartitionSpec

    from dsv41 import sharding
    params = split_variables(sharding.param_shardings(cfg, mesh, dict(rules_items)))[0]
    return jax.jit(fn, out_shardings=(params, NamedSharding(mesh, PartitionSpec())),
                   compiler_options=cpu_compiler_options(mesh))


# ------------------------------------------------------------------------------------------------
# On a mesh


def mesh_lowering(cfg, mesh, rules="train"):
    """How the training forward is traced on `mesh` under `rules`: experts expert-parallel over the rules'
    axes, and sequence parallel where they split "length" (`dsv41.sharding.lowering_for`)."""
    from dsv41 import sharding
    return sharding.lowering_for(cfg, mesh, rules, sequence=True)


def state_shardings(cfg, tc: TrainConfig, mesh, rules="train") -> TrainState:
    """NamedSharding per TrainState leaf: parameters and their optimiser moments as the rules shard the
    parameters, the rest (step, optimiser counters, buffers without axes) replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    from dsv41 import sharding
    params, buffers = split_variables(sharding.param_shardings(cfg, mesh, rules))
    whole = NamedSharding(mesh, PartitionSpec())
    opt_state = optax.tree_map_params(optimizer(tc), lambda _, spec: spec, abstract_state(cfg, tc).opt_state,
                                      trainable(tc, params)[0], transform_non_params=lambda _: whole)
    return TrainState(params, opt_state, whole, buffers)


def shard_state(state: TrainState, cfg, tc: TrainConfig, mesh, rules="train") -> TrainState:
    """A TrainState (e.g. `init_state`'s, or restored) placed on `mesh` as `state_shardings` says."""
    return jax.device_put(state, state_shardings(cfg, tc, mesh, rules))


def shard_batch(cfg, batch: dict, mesh, rules="train") -> dict:
    """A checked batch on `mesh`: each [B, S, …] array's rows over the rules' batch axes and its tokens over
    the length axes (`dsv41.sharding.sequence_sharding`); prompt_lengths [B] over the batch axes. B and S must
    divide evenly (the error names the array and the mesh axes)."""
    from dsv41 import sharding

    def place(path, x):
        x = np.asarray(x)
        name = "batch" + "".join(f"[{getattr(k, 'key', getattr(k, 'idx', k))!r}]" for k in path)
        return sharding.put(x, sharding.sequence_sharding(mesh, rules, x.shape, name))

    return jax.tree_util.tree_map_with_path(place, batch)


def make_train_step(cfg, tc: TrainConfig, *, mesh=None, rules="train"):
    """The jitted pure `train_step(state, batch) -> (state, metrics)` of a config.

    batch: {"inputs": int32 [B, S], "targets": int32 [B, S] (the next tokens), "loss_mask": [B, S]
    (1 where the target is trained on)}. With grad_accum = A, B must be a multiple of A and the step
    scans A micro-batches of B/A rows. metrics: loss (total), ce, kl, grad_norm, lr, tokens, and the
    mean |load − mean load| / mean load over the MoE layers (`imbalance`, before this step's update).

    mesh (`dsv41.sharding.make_mesh`, e.g. {"data": 2, "context": 4}): the step runs on it under `rules`
    (`train`: FSDP parameters and moments, rows over data × expert, each row's tokens over `context`); the
    state is placed there (`shard_state`) and donated, the batch's host arrays split as `shard_batch` says.
    """
    key = model_lib.config_key(cfg)
    lowering = None if mesh is None else mesh_lowering(cfg, mesh, rules)
    graphdef = model_lib.graphdef(key, lowering)
    opt = optimizer(tc)
    lr = schedule(tc)
    losses = _loss_fn(cfg, tc, lowering)
    # Only the trained parameters are differentiated: a frozen one gets no gradient buffer (`trainable`).
    grad_fn = jax.grad(lambda trained, kept, *rest: losses(nnx.merge_state(trained, kept), *rest), has_aux=True)
    placed = {}
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec
        shardings = state_shardings(cfg, tc, mesh, rules)
        placed = dict(out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())), donate_argnums=0)

    @functools.partial(jax.jit, compiler_options=cpu_compiler_options(mesh), **placed)
    def train_step(state: TrainState, batch: dict):
        b, s = batch["inputs"].shape
        a = tc.grad_accum
        n_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        n_rows = float(max(kl_rows(cfg, b, s), 1))
        micro = jax.tree.map(lambda v: v.reshape(a, b // a, *v.shape[1:]), batch)

        trained, kept = trainable(tc, state.params)

        def accumulate(carry, mb):
            grads, ce, kl, load = carry
            g, (c, k, l) = grad_fn(trained, kept, state.buffers, mb, n_tokens, n_rows)
            return (jax.tree.map(jnp.add, grads, g), ce + c, kl + k, jax.tree.map(jnp.add, load, l)), None

        zeros = jax.tree.map(jnp.zeros_like, trained)
        model = nnx.merge(graphdef, state.params, state.buffers)
        load0 = {i: jnp.zeros((model.layer(i).ffn.num_experts,), jnp.float32)
                 for i in range(model.num_layers) if model.layer(i).ffn.bias is not None}
        (grads, ce_sum, kl_sum, load), _ = jax.lax.scan(
            accumulate, (zeros, jnp.zeros(()), jnp.zeros(()), load0), micro)
        updates, opt_state = opt.update(grads, state.opt_state, trained)
        params = nnx.merge_state(optax.apply_updates(trained, updates), kept)
        buffers, imbalance = update_balance(cfg, state.buffers, load, tc.balance_rate)
        ce, kl = ce_sum / n_tokens, kl_sum / n_rows
        metrics = {"loss": (0.0 if tc.freeze_main else ce) + tc.indexer_kl_weight * kl, "ce": ce, "kl": kl,
                   "grad_norm": optax.tree.norm(grads), "lr": lr(state.step), "tokens": n_tokens,
                   "imbalance": imbalance}
        return TrainState(params, opt_state, state.step + 1, buffers), metrics

    def checked(state: TrainState, batch: dict):
        batch = _check_batch(cfg, batch)
        if batch["inputs"].shape[0] % tc.grad_accum:
            raise ConfigError("train.grad_accum", tc.grad_accum,
                              f"expected a divisor of the batch size {batch['inputs'].shape[0]}")
        batch = with_engram_ids(cfg, batch)
        if mesh is not None:
            state, batch = jax.device_put(state, shardings), shard_batch(cfg, batch, mesh, rules)
        return train_step(state, batch)

    checked.jitted = train_step
    return checked


def update_balance(cfg, buffers: nnx.State, load: dict[int, jax.Array], rate: float):
    """(buffers with bias_e += rate · sign(mean load − load_e) in every MoE layer, mean relative imbalance).
    load: {layer: tokens routed to each expert [E]}; a stacked bias [G, E] takes its G layers' loads."""
    flat = dict(nnx.to_flat_state(buffers))
    stacks = layer_stacks(cfg)
    imbalances = []
    for path, var in flat.items():
        if not isinstance(var, BalanceBias):
            continue
        grid = np.asarray(stacks[path[1]].grid(path[3]))  # the slot's layers [G] or [G, R]
        counts = jnp.stack([load[int(i)] for i in grid.flat]).reshape(*grid.shape, -1)  # [G, (R,) E]
        mean = jnp.mean(counts, axis=-1, keepdims=True)
        imbalances.extend((jnp.mean(jnp.abs(counts - mean), axis=-1) / jnp.maximum(mean[..., 0], 1.0)).reshape(-1))
        var = var.replace(var[...] + rate * jnp.sign(mean - counts))
        flat[path] = var
    out = nnx.from_flat_state(list(flat.items()))
    return out, (jnp.mean(jnp.stack(imbalances)) if imbalances else jnp.zeros(()))


@functools.lru_cache(maxsize=8)
def _cached_step(key: str, tc: TrainConfig, mesh=None, rules_items: tuple = ()):
    return make_train_step(model_lib.config_from_key(key), tc, mesh=mesh, rules=dict(rules_items) or "train")


def train_step_for(cfg, tc: TrainConfig, mesh=None, rules="train"):
    """`make_train_step`, compiled once per (config, TrainConfig, mesh, rules) in this process."""
    from dsv41 import sharding

    return _cached_step(model_lib.config_key(cfg), tc, mesh, () if mesh is None else sharding.rules_key(rules))


# ------------------------------------------------------------------------------------------------
# Evaluation and the training loop


@functools.partial(xla_options.jit, static_argnums=0)
def _score(key, params, buffers, inputs, targets, mask, engram_ids=None, forced=None, decoder_window_start=None):
    """Per row: (every response token is the argmax, Σ response-token CE, response tokens), of the forward the
    training loss runs (forced to a batch's selections, its decoder split where the batch says)."""
    model = nnx.merge(model_lib.graphdef(key), params, buffers)
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    logits = model(inputs, positions, engram_ids, forced=forced,
                   decoder_window_start=decoder_window_start).astype(jnp.float32)
    hit = (jnp.argmax(logits, -1) == targets) | (mask == 0)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    return jnp.all(hit, axis=-1), jnp.sum(ce * mask, axis=-1), jnp.sum(mask, axis=-1)


def _scores(state: TrainState, cfg, batch: dict):
    batch = _check_batch(cfg, batch)
    batch = with_engram_ids(cfg, batch)
    start = decoder_window_start(cfg, batch["prompt_lengths"]) if "prompt_lengths" in batch else None
    return _score(model_lib.config_key(cfg), state.params, state.buffers,
                  *(jnp.asarray(batch[k]) for k in ("inputs", "targets", "loss_mask")), batch.get("engram_ids"),
                  batch.get("selections"), start)


def answer_exact_match(state: TrainState, cfg, batch: dict) -> np.ndarray:
    """[B] bool: every response token is the argmax of the teacher-forced logits — the same as greedy
    decoding reproducing the whole answer (each greedy token is then the teacher's)."""
    return np.asarray(_scores(state, cfg, batch)[0])


def evaluate(state: TrainState, cfg, batches: list[dict]) -> dict:
    """Held-out scores over `batches`: exact_match (fraction of rows whose whole answer is the greedy
    one, `answer_exact_match`), answer_ce (mean cross-entropy per response token, nats) and rows.
    The response is where `loss_mask` > 0, so score rows built with prompt weight 0 (as `run` does)."""
    hits, ce, tokens = (np.concatenate(parts) for parts in zip(*(
        [np.asarray(x, np.float64) for x in _scores(state, cfg, b)] for b in batches)))
    return {"exact_match": float(hits.mean()), "answer_ce": float(ce.sum() / tokens.sum()), "rows": len(hits)}


_TRAINED_AS = "trained_as"  # the key of `fit`'s checkpoints' JSON that records tc.frozen and tc.freeze_main


def fit(cfg, tc: TrainConfig, data, steps: int, *, seed: int = 0, checkpointer=None, progress=None,
        initial: nnx.State | None = None, evaluator=None, eval_every: int = 0,
        mesh=None, rules="train") -> tuple[TrainState, list[dict]]:
    """Runs `steps` optimiser steps in total (resuming from `checkpointer`'s newest complete step if any).

    data: an iterator of batches with `state()` / `restore(dict)` (`dsv41.data`); progress: a
    callable(step, metrics) called after every step (e.g. a tqdm update). Returns (final state, the
    metrics of the steps run here, as floats). initial: the variables a fresh run starts from (`load_params`
    of an exported or converted checkpoint) instead of a random init; a resumed run ignores it.
    evaluator: a callable(state) -> {name: float} (e.g. `evaluate` on held-out batches) run after every
    `eval_every`-th step; its results join that step's metrics as `eval_<name>`. mesh: train on it under
    `rules` (`train`: FSDP, rows over data × expert, tokens over context; `train_long`: rows over data, tokens
    over expert × context; `make_train_step`).
    """
    # Which parameters train decides the optimiser state's structure (`trainable`): saved beside the data
    # iterator's state, so that a resume with other values says so instead of failing inside orbax.
    trained_as = {"frozen": tc.frozen, "freeze_main": tc.freeze_main}
    state, start = None, 0
    if checkpointer is not None and checkpointer.latest_step() is not None:
        saved = checkpointer.restore_data().get(_TRAINED_AS)  # None in checkpoints written before it was saved
        for name in trained_as if saved is not None else ():
            if saved.get(name) != trained_as[name]:
                raise ConfigError(f"train.{name}", trained_as[name], f"expected {saved.get(name)!r}, the value the "
                                  f"checkpoints in {checkpointer.directory} were written with")
        state, data_state = checkpointer.restore(abstract_state(cfg, tc), cfg=cfg)
        data.restore({k: v for k, v in data_state.items() if k != _TRAINED_AS})
        start = int(state.step)
    step_fn = train_step_for(cfg, tc, mesh, rules)
    if state is None:
        state = init_state(cfg, tc, jax.random.key(seed), initial)
    if mesh is not None:
        state = shard_state(state, cfg, tc, mesh, rules)
    history = []
    for step in range(start, steps):
        state, metrics = step_fn(state, next(data))
        metrics = {k: float(v) for k, v in metrics.items()}
        if evaluator is not None and eval_every and (step + 1) % eval_every == 0:
            metrics.update({f"eval_{k}": v for k, v in evaluator(state).items()})
        history.append(metrics)
        if checkpointer is not None:
            checkpointer.save(step + 1, state, {**data.state(), _TRAINED_AS: trained_as}, force=step + 1 == steps)
        if progress is not None:
            progress(step + 1, metrics)
    if checkpointer is not None:
        checkpointer.wait()
    return state, history


# ------------------------------------------------------------------------------------------------
# Command line: `dsv41 train` (wired by dsv41.cli)


def add_parser(subparsers):
    """Registers `train` on an argparse subparsers object."""
    import argparse

    p = subparsers.add_parser(
        "train", help="train on a synthetic long-context task or a token file",
        description="Continued training (DESIGN §10): optax AdamW, orbax checkpoints (--ckpt-dir), the indexer's KL "
                    "beside the language-model loss.",
        epilog="examples (from the repository root):\n"
               "  dsv41 train --config passkey --task passkey --init-from configs/passkey.safetensors --seq 512 "
               "--batch 2 --steps 10 --set train.learning_rate=5e-5 --export w.safetensors\n"
               "  dsv41 train --config tiny --task passkey --steps 200 --seq 256 --ckpt-dir /tmp/run "
               "--set train.learning_rate=1e-3",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", help="config name in configs/ or a .json/.toml/.py path")
    p.add_argument("--task", default="passkey", help="passkey | kv_recall | a .npy/.bin token file")
    p.add_argument("--token-dtype", default=None, help="dtype of a raw .bin token file, e.g. uint16")
    p.add_argument("--steps", type=int, default=100,
                   help="optimiser steps (0: only score the starting weights on the held-out rows)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256, help="tokens per row (the task's context length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--key-digits", type=int, default=5,
                   help="passkey: digits per key (a longer key gives more retrieval targets per row)")
    p.add_argument("--ckpt-dir", default=None, help="save here every --save-every steps; resume from it")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (e.g. quant=none) or a train field (train.remat=block)")
    p.add_argument("--prompt-loss-weight", type=float, default=0.0, metavar="W",
                   help="synthetic tasks: loss weight of the prompt (filler) tokens, the answer's being 1 (default 0: "
                        "answer only); held-out scores stay answer-only")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="synthetic tasks: held-out batches scored for exact-match accuracy and answer CE at the end")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="synthetic tasks: also score the held-out batches after every N-th step (0: only at the end)")
    p.add_argument("--init-from", default=None, metavar="PATH",
                   help="start from these weights (a safetensors file of --export / dsv41 convert for the same "
                        "config) instead of a random init; optimiser state and step start fresh")
    p.add_argument("--export", default=None, metavar="PATH",
                   help="write the trained variables (parameters and balance biases) to one safetensors file "
                        "that dsv41.convert.load_params reads")
    p.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="train on a mesh of the local devices, e.g. context=8 or data=2,context=4 (rules `train`: "
                        "FSDP over data × expert, rows over data × expert, each row's tokens over context: "
                        "sequence parallel); --batch must divide over data × expert and --seq over context")
    p.add_argument("--rules", choices=TRAIN_RULES, default=None,
                   help="how --mesh splits a step: train (rows over data × expert, each row's tokens over context) "
                        "or train_long (rows over data only, each row's tokens over expert × context: fewer, longer "
                        "rows; --batch must divide over data and --seq over expert × context); needs --mesh")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return p


def run(args) -> int:
    from dsv41 import data as data_lib
    from dsv41.config import load_config, parse_override

    train_sets = dict(parse_override(s[len("train."):]) for s in args.set if s.startswith("train."))
    cfg = load_config(args.config, [s for s in args.set if not s.startswith("train.")])
    if args.steps < 0:
        raise ConfigError("--steps", args.steps, "expected a step count of 0 or more (0: score the starting weights)")
    if args.rules is not None and args.mesh is None:
        raise ConfigError("--rules", args.rules, "expected --mesh as well: the rules say how a mesh splits a step")
    tc = TrainConfig(total_steps=max(args.steps, 1)).replace(train_sets)
    synthetic = args.task in data_lib.TASKS
    if args.eval_every < 0 or (args.eval_every and not (synthetic and args.eval_batches > 0)):
        raise ConfigError("--eval-every", args.eval_every,
                          "expected 0 (score only at the end) or a positive step count; held-out rows exist only "
                          "for the synthetic tasks with --eval-batches > 0")
    if args.eval_batches < 0:
        raise ConfigError("--eval-batches", args.eval_batches, "expected a batch count of 0 or more")
    if not 0 <= args.prompt_loss_weight <= 1 or (args.prompt_loss_weight and not synthetic):
        raise ConfigError("--prompt-loss-weight", args.prompt_loss_weight,
                          "expected a weight in [0, 1], and 0 for a token file (every token there is trained on)")
    if synthetic:
        data = data_lib.Synthetic(args.task, args.batch, args.seq, seed=args.seed, key_digits=args.key_digits,
                                  prompt_weight=args.prompt_loss_weight)
    else:
        data = data_lib.PackedTokens(data_lib.load_tokens(args.task, args.token_dtype), args.batch, args.seq,
                                     seed=args.seed, vocab_size=cfg.architecture.vocab_size)
    held_out = []
    if synthetic and args.eval_batches:  # a stream no training row comes from
        stream = data_lib.Synthetic(args.task, args.batch, args.seq, seed=args.seed + 1_000_003,
                                    key_digits=args.key_digits)
        held_out = [next(stream) for _ in range(args.eval_batches)]
    initial = None
    if args.init_from:
        from dsv41.convert import load_params, weights_file

        initial = load_params(weights_file("--init-from", args.init_from), cfg)
    ckpt = None
    if args.ckpt_dir:
        from dsv41.checkpoint import Checkpointer
        ckpt = Checkpointer(args.ckpt_dir, every=args.save_every, keep=args.keep)
    from dsv41 import progress as progress_lib

    bar = progress_lib.bar(total=args.steps, desc="train", unit="step", disable=args.json)
    if ckpt is not None and ckpt.latest_step():
        bar.update(ckpt.latest_step())

    def progress(step, m):
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.3f}", ce=f"{m['ce']:.3f}", kl=f"{m['kl']:.4f}")
        if "eval_exact_match" in m and not args.json:
            bar.write(f"step {step}: held-out exact match {m['eval_exact_match']:.3f}, "
                      f"answer CE {m['eval_answer_ce']:.4f} ({m['eval_rows']} rows)")

    mesh = None
    if args.mesh is not None:
        from dsv41 import sharding
        mesh = sharding.make_mesh(sharding.parse_mesh(args.mesh))
    t0 = time.time()
    state, history = fit(cfg, tc, data, args.steps, seed=args.seed, checkpointer=ckpt, progress=progress,
                         initial=initial, evaluator=lambda st: evaluate(st, cfg, held_out), eval_every=args.eval_every,
                         mesh=mesh, rules=args.rules or "train")
    bar.close()
    if ckpt is not None:
        ckpt.close()
    out = {"steps": args.steps, "seconds": time.time() - t0, "final": history[-1] if history else None}
    if args.export:
        from dsv41.convert import save_params
        out["exported_bytes"] = save_params(nnx.merge_state(state.params, state.buffers), cfg, args.export,
                                            args.export_dtype)
    if held_out:
        last = history[-1] if history else {}
        scores = ({k[len("eval_"):]: v for k, v in last.items() if k.startswith("eval_")}
                  or evaluate(state, cfg, held_out))
        out.update(exact_match=scores["exact_match"], answer_ce=scores["answer_ce"])
    if args.json:
        print(json.dumps(out))
    else:
        final = out["final"] or {}
        print(f"{args.steps} steps in {out['seconds']:.1f} s; final loss {final.get('loss', float('nan')):.4f}"
              + (f"; held-out exact match {out['exact_match']:.3f}, answer CE {out['answer_ce']:.4f}"
                 if "exact_match" in out else ""))
    return 0
