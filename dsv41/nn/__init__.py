"""The mechanisms of DeepSeek-V4.1 (and V4 compat) as Flax NNX modules, one file per mechanism.

Shape letters in names: B batch, S query tokens, T compressed entries (or keys), D hidden (or the
512-d latent where it says so), H attention heads, K head/latent dim, R rope dims, G output groups,
E experts, I expert width, N hyper-connection streams, J indexer heads, k top-k picks.
Weights are stored [in, out]; every parameter carries logical axis names (`out_sharding` metadata)
that `dsv41.sharding` (DESIGN §9) maps onto a mesh.
"""
