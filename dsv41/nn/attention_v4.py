"""DeepSeek-V4 compat attention (DESIGN §4) behind the V4.1 layer's interface: every compressed layer is
its own source. CSA layers compress with overlap at ratio 4 and attend the top-k entries their own
indexer picks; HCA layers compress at ratio 128 and attend every visible entry. The window branch,
sink, query head norm and output path are `attention.Attention`'s; this module supplies the compressed
branch (its modules, its whole-sequence hand-off and its cached step, `cached_compressed`) and V4's stored
formats: with `quant: qat` the window rows and entries are `kv_store.RopeSplitFP8` records (FP8 NoPE
channels, UE8M0 per 64, BF16 RoPE channels) and the indexer keys MXFP4 after the Hadamard rotation, as V4's
official inference keeps them; the forward sees the same values as fake-quant.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41 import kv_store, quant
from dsv41.kv_store import LayerStore, dequant_keys, packed
from dsv41.nn import indexer as ix
from dsv41.nn.attend import Handoff
from dsv41.nn.attention import Attention
from dsv41.nn.compressor import CompressorV4
from dsv41.nn.policy import Policy
from dsv41.nn.rope import apply_rope
from dsv41.plan import CSA


class AttentionV4(Attention):
    """The V4 attention layer (this module's docstring)."""

    def _build_compressed_branch(self, cfg, builds_pool: bool, policy: Policy, rngs: nnx.Rngs):
        a, record, ixc = cfg.architecture, self.record, cfg.v4.indexer
        self.top_k = ixc.top_k
        self.every_entry = True  # V4 has no candidate pool
        self.query_block = 0  # the whole-sequence form at once: the blockwise one is V4.1's (`Attention._blockwise`)
        # V4's stored records (main entry, window row) under quant qat; the float cache stores the values.
        self.entry_record, self.window_record = kv_store.v4_records(cfg) if self.fake_quant else (None, None)
        self.compressor = (CompressorV4(a.hidden_size, a.head_dim, record.ratio, record.mode == CSA, a.norm_eps,
                                        policy=policy, rngs=rngs)
                           if record.stores_entries else None)
        self.indexer = (ix.IndexerV4(a.hidden_size, a.q_lora_rank, ixc.query_heads, ixc.head_dim, record.ratio,
                                     a.norm_eps, rotate=ixc.hadamard, policy=policy, rngs=rngs)
                        if record.mode == CSA else None)

    def window_fake_quant(self, kv_BSK):
        return self.window_record.fake_quant(kv_BSK)

    def encode_window(self, kv_BSK):
        """(record bytes [B,S,row], an empty scale leaf [B,S,0]): V4's ring rows hold whole records."""
        return self.window_record.encode(kv_BSK), jnp.zeros((*kv_BSK.shape[:-1], 0), jnp.uint8)

    def decode_window(self, values, scales):
        return self.window_record.decode(values)

    def kernel_impl(self, kind: str = "indexer") -> str:
        """The XLA path: the Pallas kernels read V4.1's stored formats, not V4's records."""
        return "reference"

    def _publish(self, x_BSD, qr_BSQ, positions_BS, published: dict, forced: dict | None = None) -> Handoff:
        rec = self.record
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        latent = self.compressor(x_BSD)  # [B, T, K] before RoPE
        entries = apply_rope(latent, ix.entry_positions(latent, rec.ratio), cinv)
        if self.fake_quant:
            entries = self.entry_record.fake_quant(entries)
        self.sow(nnx.Intermediate, "entries", entries)
        if self.indexer is None:
            return Handoff(entries=entries)
        index_keys = self.indexer.keys(x_BSD, cinv, self.fake_quant)
        self.sow(nnx.Intermediate, "index_keys", index_keys)
        picks = (forced or {}).get("picks")
        if picks is None:
            visible = ix.visible_entries(positions_BS, rec.ratio, latent.shape[1])
            scores = self.indexer.scores(x_BSD, qr_BSQ, positions_BS, index_keys, visible, cinv, self.fake_quant)
            picks = ix.top_k_indices(scores, self.top_k)
        self.sow(nnx.Intermediate, "picks", picks)
        return Handoff(entries=entries, index_keys=index_keys, picks=picks,
                       selected=ix.indices_to_mask(picks, latent.shape[1]))

    def cached_compressed(self, x_BSD, qr_BSQ, positions_BS, lengths_B, counts_B, published, stores,
                          entries_ready=False):
        """The compressed branch over the cache (the V4.1 layer's `cached_compressed` interface): the
        layer's own store gets the new tokens' entries (and a CSA layer its indexer keys, from the
        indexer's own compressor); CSA attends the top-k of its indexer, HCA every visible entry.
        Returns ((selected [B,S,k,K], their validity, None, None) for CSA or (None, None, (entries
        [B,T,K], visible [B,S,T]), None) for HCA, stores, None): V4 layers hand nothing on."""
        rec, indexer = self.record, self.indexer
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        store: LayerStore = stores[rec.index]
        quantised = packed(store.leaves["entries"])
        latent, entry, done, leftover = self.compressor.step(x_BSD, lengths_B, counts_B, store.get("leftover"))
        entries = apply_rope(latent, rec.ratio * entry, cinv)
        store = store.write("entries", self.entry_record.encode(entries) if quantised else entries, entry, done)
        store = store.put("leftover", leftover)
        if indexer is not None:
            latent, entry, done, index_left = indexer.compressor.step(x_BSD, lengths_B, counts_B,
                                                                   store.get("index_leftover"))
            keys = apply_rope(latent, rec.ratio * entry, cinv)
            if quantised:  # MXFP4 after the Hadamard rotation
                values, scales = quant.quantize_mxfp4(indexer.rotated(keys))
                store = (store.write("index_keys", quant.pack_fp4(values), entry, done)
                         .write("index_scales", quant.to_bytes(scales), entry, done))
            else:
                store = store.write("index_keys", keys, entry, done)
            store = store.put("index_leftover", index_left)
        stores = {**stores, rec.index: store}
        read = self.entry_record.decode if quantised else (lambda e: e)
        num = store.leaves["entries"].shape[-2]
        visible = ix.visible_entries(positions_BS, rec.ratio, num)
        if indexer is None:
            return (None, None, (read(store.get("entries")).astype(x_BSD.dtype), visible), None), stores, None
        q, w = indexer.query(x_BSD, qr_BSQ, positions_BS, cinv, self.fake_quant)
        keys = dequant_keys(store.get("index_keys"), store.get("index_scales"))
        picks = ix.top_k_indices(ix.lightning_scores(q, keys, w, visible, indexer.unroll), self.top_k)
        return (read(store.gather("entries", picks)).astype(x_BSD.dtype), picks >= 0, None, None), stores, None
