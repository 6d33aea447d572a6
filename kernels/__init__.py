"""Triton kernels for paged attention, with pure-PyTorch references.

- cache_write.write_kv_cache: a step's new K/V into their cache slots
- decode_attention.paged_decode_attention: one query token per sequence, split-KV, GQA
- extend_attention.paged_extend_attention: prefill/extend chunks over the paged cache
- reference: the same three in plain PyTorch (the tests' float64 ground truth)
- bench: GPU timings against the measured copy bandwidth (python -m kvpilot.kernels.bench)

Nothing is imported here, so that the references work without triton installed.
"""
