"""The configuration schema: every field, its type and its default, per model family.

A config file is merged onto the schema of its family (`architecture.family`: "v41", the default,
or "v4"; a file with a top-level `kv_layout` block is a reference KV layout used only by the
report). Defaults are the full-size model of that family (DESIGN §2, §4). Fields of the user
schema (`kv_cache`, `csa2`, `swa_bounded_replay`, ...) keep their names and nesting exactly.
"""

from __future__ import annotations

import copy
import dataclasses


@dataclasses.dataclass(frozen=True)
class Nullable:
    """A field whose default is null; when set it must be of `type`."""

    type: type


V41, V4, LAYOUT = "v41", "v4", "layout"
FAMILIES = (V41, V4)


def _group(size: int, first: str) -> dict:
    return {"size": size, "modes": [first] + ["reuse"] * (size - 1)}


_PERSISTENT_CACHE = {
    "global_kv_ttl_hours": 72.0,
    "swa_kv_location": "host_dram_pool",
    "swa_kv_ttl_minutes": 5.0,
    # dsv41 addition: tokens per persisted block (a multiple of every compression ratio; DESIGN §7).
    "block_tokens": 256,
}

# Group records inside csa2.*.groups: `compression_ratio` is optional and, when given, must equal
# the stage's ratio (a group cannot change the ratio of its stage).
GROUP_FIELDS = {"size": int, "modes": list, "compression_ratio": int}
GROUP_REQUIRED = ("size", "modes")

_V41 = {
    "model": "DeepSeek-V4.1-Flash",
    "base_url": "http://127.0.0.1:8000/v1",
    "context_window": 1_000_000,
    "kv_cache": {
        "global_kv_dtype": "fp4_e2m1",
        "global_kv_scale": "e4m3_per_16_channel",
        "swa_kv_dtype": "fp8",
        "swa_window_size": 128,
        "persistent_cache": _PERSISTENT_CACHE,
        # dsv41 additions (absent from the user schema; defaults are V4.1's formats, DESIGN §3.8).
        "swa_kv_scale": "ue8m0_per_32_channel",
        "index_kv_dtype": "fp4_e2m1",
        "index_kv_scale": "ue8m0_per_32_channel",
        "global_kv_rope_dtype": Nullable(str),  # null: the RoPE dims are stored like the rest
        "global_kv_entry_align_bytes": 1,
        "swa_kv_rope_dtype": Nullable(str),  # null: the window's RoPE dims are stored like the rest
    },
    "csa2": {
        "encoder": {
            "layers": 20,
            "first_two_layers": "swa_only",
            "compression_ratio": 2,
            "groups": [_group(6, "full")] * 3,
        },
        "decoder": {
            "layers": 20,
            "first_two_layers": "grouped",
            "compression_ratio": 1,
            "groups": [_group(4, "full")] + [_group(4, "reindex")] * 4,
        },
        "indexer": {
            "query_heads": 32,
            "head_dim": 128,
            "top_k": 512,
            "hierarchical": {
                "enabled": True,
                "max_blocks": 2048,
                "positions_per_block": 8,
                "candidate_pool_size": 16384,
            },
        },
    },
    "swa_bounded_replay": {
        "encoder_replay_tokens": 128,
        "decoder_replay_tokens": 128,
        "enable_prefix_cache_global_only": True,
    },
    # Fake quantisation of the stored formats (DESIGN §3.8): "qat" is the model; "none" only for
    # comparisons and for parity with references that skip it.
    "quant": "qat",
    # The dtype policy (dsv41.nn.policy) and the prefill schedule (DESIGN §3.5): "full" runs every
    # prompt token through every layer (exact); "ced" runs them through the encoder and the decoder's
    # KV projections, and only the last decoder_replay_tokens through the decoder.
    # kernels (DESIGN §8, §11): auto = Pallas on TPU/GPU (the cached steps, and the training forward under qat),
    # the XLA reference on CPU. score_tile: the entries
    # the cached steps' XLA indexer scores per loop trip, over the filled tiles only (DESIGN §6). query_block:
    # the whole-sequence forward (training) runs a longer sequence's attention in blocks of this many queries,
    # in memory linear in its length (0: every query at once, memory quadratic). row_loop: "on" runs a prefill chunk's
    # attention layers as a loop over the rows each device holds, one row of each device a trip: their program is
    # emitted at one row's shapes (full size on v5p: 16 % fewer bundles, 31 % fewer temporaries, the compile time
    # within this machine's noise; on this CPU `small`'s batch-8 prefill 1.6× slower: docs/compile_time.md); "off"
    # (the default) every row at once. Decode steps always run every row at once. weight_format
    # (`dsv41.nn.weights`): "shipped" holds the matrices the release quantises as it ships them (FP8 E4M3 with
    # UE8M0 32×32 block scales, MXFP4 routed experts, FP8 Engram rows), dequantised inside each matmul, and the
    # other parameters as param_dtype; "f32" / "bf16" every parameter as that dtype; "" (unset) the one
    # param_dtype names.
    "runtime": {"param_dtype": "float32", "weight_format": "", "compute_dtype": "float32", "prefill_schedule": "full", "kernels": "auto",
                "score_tile": 1024, "query_block": 512, "row_loop": "off"},
    # Model dimensions (DESIGN §2): the block the user schema does not have.
    "architecture": {
        "family": V41,
        "vocab_size": 129280,
        "hidden_size": 5120,
        "num_heads": 64,
        "head_dim": 512,
        "rope_head_dim": 64,
        "q_lora_rank": 1280,
        "q_head_norm": False,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "norm_eps": 1e-20,
        # std of the normal init of every weight matrix and the embedding (transformers' initializer_range)
        "initializer_range": 0.02,
        "tie_embeddings": False,
        "rope": {
            "theta": 10000.0,
            "compressed_theta": 160000.0,
            # "yarn": the compressed branch's table is YaRN-scaled by the yarn_* fields below; "default":
            # plain RoPE at compressed_theta (transformers' rope_type names; the yarn_* fields unused).
            "compressed_rope_type": "yarn",
            "yarn_factor": 16.0,
            "yarn_original_max_position": 65536,
            "yarn_beta_fast": 32.0,
            "yarn_beta_slow": 1.0,
            "max_position": 1_048_576,
        },
        "moe": {
            "num_experts": 384,
            "top_k": 6,
            "num_shared_experts": 1,
            "intermediate_size": 2304,
            "score_func": "sqrtsoftplus",
            "route_scale": 1.5,
            "swiglu_limit": 10.0,
            "hash_layers": 0,
        },
        "mhc": {
            "streams": 4,
            "sinkhorn_iters": 20,
            "eps": 1e-6,
            "variant": "single_pass",
        },
        "engram": {
            "layers": [1, 14],
            "max_ngram": 4,
            "heads_per_ngram": 8,
            "row_dim": 256,
            "compressed_vocab_size": 99092,
            "prime_floor": 16_000_000,
            "pad_id": 2,
        },
    },
}

_V4 = copy.deepcopy(
    {k: v for k, v in _V41.items() if k not in ("csa2", "swa_bounded_replay")}
)
_V4.update(
    model="DeepSeek-V4-Flash",
    context_window=1_048_576,
    # V4's own fake-quant formats (FP8/64 main KV with BF16 RoPE dims, Hadamard + FP4 indexer) are not
    # implemented; the released transformers V4, the compat reference, runs without them.
    quant="none",
    # V4 compat (DESIGN §4): per-layer types as in transformers' DeepseekV4Config.layer_types.
    v4={
        "layer_types": ["window"] * 2 + ["csa", "hca"] * 20 + ["csa"],
        "csa_ratio": 4,
        "hca_ratio": 128,
        "indexer": {"query_heads": 64, "head_dim": 128, "top_k": 512, "hadamard": True},
    },
)
_V4["kv_cache"].update(
    global_kv_dtype="fp8_e4m3",
    global_kv_scale="ue8m0_per_64_channel",
    global_kv_rope_dtype="bf16",
    global_kv_entry_align_bytes=8,
    # V4's window KV as its official inference keeps it: FP8 NoPE channels (UE8M0 per 64), BF16 RoPE channels.
    swa_kv_scale="ue8m0_per_64_channel",
    swa_kv_rope_dtype="bf16",
)
_V4["architecture"].update(
    family=V4, hidden_size=4096, q_lora_rank=1024, q_head_norm=True, norm_eps=1e-6,
)
_V4["architecture"]["moe"].update(num_experts=256, intermediate_size=2048, hash_layers=3)
_V4["architecture"]["mhc"].update(variant="classic")
_V4["architecture"]["engram"].update(layers=[])

# Reference layouts (DeepSeek-V1, V3.2): only what the KV report needs.
LAYOUT_PART_FIELDS = {"name": str, "dims": int, "dtype": str, "scale": str, "count": int, "role": str}
LAYOUT_PART_REQUIRED = ("name", "dims", "dtype")
_LAYOUT = {
    "model": "",
    "context_window": 0,
    "kv_layout": {"layers": 0, "entry_align_bytes": 1, "parts": []},
}


def defaults(family: str) -> dict:
    """A fresh copy of the schema (field -> default or Nullable) for `family`."""
    return copy.deepcopy({V41: _V41, V4: _V4, LAYOUT: _LAYOUT}[family])
