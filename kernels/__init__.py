"""Triton kernels, each with a pure-torch reference and a wrapper that checks its inputs.

- ``paged_attention``: decode attention over the paged KV cache (strided per-layer views).
- ``kv_pack``: pack/scatter a head range of whole KV blocks for the KV data plane, and the
  tensor-parallel reshard plan that drives it.

Modules import Triton; import them where they are used, not from here.
"""
