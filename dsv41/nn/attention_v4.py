"""DeepSeek-V4 compat attention (DESIGN §4) behind the V4.1 layer's interface: every compressed layer is
its own source. CSA layers compress with overlap at ratio 4 and attend the top-k entries their own
indexer picks; HCA layers compress at ratio 128 and attend every visible entry. The window branch,
sink, query head norm and output path are `attention.Attention`'s; this module supplies the compressed
branch: its modules, its whole-sequence hand-off and its cached step (`cached_compressed`).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from dsv41.kv_store import LayerStore
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
        self.compressor = (CompressorV4(a.hidden_size, a.head_dim, record.ratio, record.mode == CSA, a.norm_eps,
                                        policy=policy, rngs=rngs)
                           if record.stores_entries else None)
        self.indexer = (ix.IndexerV4(a.hidden_size, a.q_lora_rank, ixc.query_heads, ixc.head_dim, record.ratio,
                                     a.norm_eps, policy=policy, rngs=rngs)
                        if record.mode == CSA else None)

    def _publish(self, x_BSD, qr_BSQ, positions_BS, published: dict) -> Handoff:
        rec = self.record
        cinv = np.asarray(self.compressed_inv_freq, np.float32)
        latent = self.compressor(x_BSD)  # [B, T, K] before RoPE
        entries = apply_rope(latent, ix.entry_positions(latent, rec.ratio), cinv)
        if self.indexer is None:
            return Handoff(entries=entries)
        index_keys = self.indexer.keys(x_BSD, cinv)
        visible = ix.visible_entries(positions_BS, rec.ratio, latent.shape[1])
        scores = self.indexer.scores(x_BSD, qr_BSQ, positions_BS, index_keys, visible, cinv)
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
        latent, entry, done, leftover = self.compressor.step(x_BSD, lengths_B, counts_B, store.get("leftover"))
        store = store.write("entries", apply_rope(latent, rec.ratio * entry, cinv), entry, done).put("leftover", leftover)
        if indexer is not None:
            latent, entry, done, index_left = indexer.compressor.step(x_BSD, lengths_B, counts_B,
                                                                   store.get("index_leftover"))
            store = store.write("index_keys", apply_rope(latent, rec.ratio * entry, cinv), entry, done)
            store = store.put("index_leftover", index_left)
        stores = {**stores, rec.index: store}
        entries = store.get("entries")
        visible = ix.visible_entries(positions_BS, rec.ratio, entries.shape[1])
        if indexer is None:
            return (None, None, (entries, visible), None), stores, None
        q, w = indexer.query(x_BSD, qr_BSQ, positions_BS, cinv)
        picks = ix.top_k_indices(ix.lightning_scores(q, store.get("index_keys"), w, visible, indexer.unroll), self.top_k)
        return (store.gather("entries", picks), picks >= 0, None, None), stores, None
