"""kvpilot's kernels: the GPU kernels in Triton, the CPU kernels in C, each beside a PyTorch reference.

Triton (GPU; the tests run them on CPU under TRITON_INTERPRET=1):
- cache_write.write_kv_cache: a step's new K/V into their cache slots (slot_mapping)
- decode_attention.paged_decode_attention: one query token per sequence, split-KV, GQA
- extend_attention.paged_extend_attention: prefill/extend chunks over the paged cache
- paged_tiles: the paged K/V tile loop the decode and extend kernels share; _common: launcher checks
- bench: GPU timings against the measured copy bandwidth (python -m kvpilot.kernels.bench)

C (CPU; kernels/cpu, built ahead of time per x86 level and loaded through ctypes): paged decode and
prefill attention with fused RoPE and K/V writes, RMSNorm and SiLU*mul, decode-sized bf16 and GGUF
(Q4_1 / Q8_0) matmuls, the one-call decode stack; kernels/cpu/__init__.py lists them.

- reference: the attention and cache write in plain PyTorch (the tests' float64 ground truth)

Which kernels an engine runs is decided in one place, kvpilot.engine.cpu.kernel_path (CPU) and the
attention backend (GPU). Nothing is imported here, so that the references and the CPU kernels work
without triton installed; kernels import nothing else of kvpilot's (.importlinter).
"""
