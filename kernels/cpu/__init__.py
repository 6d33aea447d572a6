"""kvpilot's CPU kernels: C sources built ahead of time for every x86 level, loaded through ctypes.

csrc/ holds the C (one file per op family, as vLLM's csrc/cpu, with the shared header kvp.h);
build.py compiles every library once per x86 level when the project is installed (`pip install`,
`pip install -e`, `make install`, the image's build stage); loader.py loads the best level this
CPU runs. The ops, each with a docstring giving shapes, dtypes, errors and source:

- attention.py   paged_decode_attention, FusedDecode (RoPE + K/V write + decode attention)
- prefill.py     paged_prefill_attention, PrefillBatch
- norm_act.py    rms_norm (with vLLM's fused residual add), silu_and_mul
- bf16_gemm.py   pack, matmul: decode-sized bf16 matmuls with AVX512_BF16 (vdpbf16ps)
- gguf.py        gguf_matmul over Q4_1 / Q8_0 blocks, quantize_q8_1; amx_pack, the blocks' layout
                 for the 8-bit matmuls on AMX tiles (csrc/gguf_amx.c, amx build)
- decode_stack.py  the one-call decode step's library and C structs

Which of them a CPU engine runs is decided in one place, kvpilot.engine.cpu.kernel_path.
Nothing is imported here: cpu_flags.py and build.py are torch-free (the tuner and setup.py
read them).
"""
