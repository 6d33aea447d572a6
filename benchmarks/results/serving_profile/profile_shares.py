"""Where `kvpilot serve`'s time goes under load, from a py-spy sample file (`py-spy record
--threads --idle -f raw`; run.sh in this folder makes one at 64 concurrent ShareGPT requests).

Prints, for the engine thread (`engine-loop`), each sample's class as a share of its busy
samples (not idle in its command queue): the C kernels and torch ops of the forward (a sample
whose leaf frame is the call into one), and the Python around them by phase (scheduling, step
input, the forward's own Python, sampling, detokenizing and outputs, delivering to the
streams); and for the event-loop thread (`MainThread`: HTTP, SSE, the OpenAI layer) its busy
share of the wall time. Usage: python -P profile_shares.py SAMPLES.raw [--json OUT]."""
from __future__ import annotations

import argparse
import collections
import json

# leaf frames that are a call into native code (torch op dispatch, the ctypes C kernels, and the
# lines of this commit whose one statement is a torch tensor op or a C kernel call: py-spy
# without --native charges native time to the calling Python line)
NATIVE = {
    "decode stack (all layers in one C call)": ("DecodeStack.forward (engine/models/cpu_decode_stack.py:209)",),
    "matmul (torch ops: oneDNN / bf16 / GGUF kernels)": ("OpOverloadPacket.__call__",
                                                         "matmul (kernels/cpu/bf16_gemm.py:86)"),
    "sampling noise (torch uniform_, log_)": ("Sampler._exponential_noise (engine/sample/sampler.py:147)",
                                              "Sampler._exponential_noise (engine/sample/sampler.py:150)",
                                              "Sampler._exponential_noise (engine/sample/sampler.py:151)"),
    "sampling (C kernel)": ("sample_from_logits (kernels/cpu/sample.py:57)",),
    "RoPE and K/V write (C kernel, prefill rows)": ("PrefillRope.__call__ (kernels/cpu/attention.py:225)",),
    "torch.cat of a mixed step's decode and prefill rows": (
        "TorchAttentionBackend.forward_qkv (engine/attention/torch_backend.py:151)",),
    "RoPE (torch ops, prefill rows)": ("apply_rotary (engine/layers/rotary_embedding.py:18)",
                                       "apply_rotary (engine/layers/rotary_embedding.py:19)"),
    "attention prefill (C kernel)": ("paged_prefill_attention (kernels/cpu/prefill.py",),
    "attention decode (C kernel)": ("_run_rows (kernels/cpu/attention.py",),
    "norm / activation (C kernels)": ("silu_and_mul (kernels/cpu/norm_act.py", "rms_norm (kernels/cpu/norm_act.py"),
}
# Python phases by the outermost engine frame under LLMEngine.step / the engine loop
PHASES = (
    ("python: scheduling", ("Scheduler.schedule", "Scheduler.update_from_output", "BlockManager")),
    ("python: step input", ("ModelRunner._prepare", "StepInput", "ModelRunner._copy_blocks")),
    ("python: sampling", ("Sampler", "logits_adjust", "grammar_bitmask")),
    ("python: forward (layers' own Python)", ("Module._call_impl",)),
    ("python: detokenize and outputs", ("LLMEngine._process", "LLMEngine._detokenize", "LLMEngine._make_output")),
    ("python: deliver to streams and metrics", ("AsyncLLMEngine._dispatch", "AsyncLLMEngine._publish_state",
                                               "record_step", "stat_loggers")),
)
IDLE_LEAVES = ("_drain_commands", "Selector.select (selectors", "wait (threading", "get (queue", "sleep")


def idle(leaf: str) -> bool:
    """Whether a sample's leaf frame waits (a selector, a queue, a lock, a sleep)."""
    return any(name in leaf for name in IDLE_LEAVES)


def classify(frames: list[str]) -> str:
    """The class of one engine-thread sample: a NATIVE group by its leaf, else its phase."""
    leaf = frames[-1]
    if idle(leaf):
        return "idle"
    for group, prefixes in NATIVE.items():
        if leaf.startswith(prefixes):
            return group
    for phase, names in PHASES:
        if any(name in frame for frame in frames for name in names):
            return phase
    return "python: other"


def shares(path: str) -> dict:
    """{'engine_thread': {class: share of busy samples}, 'engine_busy': share of wall,
    'main_thread_busy': share of wall, 'samples': n}."""
    engine: collections.Counter = collections.Counter()
    main = collections.Counter()
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        if "engine-loop" in frames[0]:
            engine[classify(frames)] += n
        elif "MainThread" in frames[0]:
            main["idle" if idle(frames[-1]) else "busy"] += n
    wall = sum(engine.values())
    busy = wall - engine["idle"]
    out = {k: v / busy for k, v in engine.most_common() if k != "idle"}
    native = sum(v for k, v in out.items() if not k.startswith("python"))
    return {"engine_thread": out, "engine_native_share": native, "engine_python_share": 1 - native,
            "engine_busy_of_wall": busy / wall, "main_thread_busy_of_wall": main["busy"] / max(1, sum(main.values())),
            "samples": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("samples")
    p.add_argument("--json")
    a = p.parse_args()
    result = shares(a.samples)
    print(f"engine thread busy {result['engine_busy_of_wall']:.1%} of the wall time; "
          f"event-loop thread busy {result['main_thread_busy_of_wall']:.1%}")
    print("| engine thread, share of its busy time | % |\n|---|---:|")
    for k, v in result["engine_thread"].items():
        print(f"| {k} | {v:.1%} |")
    print(f"| **native (kernels, torch ops)** | **{result['engine_native_share']:.1%}** |")
    print(f"| **Python and scheduling** | **{result['engine_python_share']:.1%}** |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
