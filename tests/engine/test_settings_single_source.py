"""Every engine setting's flag is spelled once, in kvpilot.engine.settings: the product code
(every kvpilot package and the benchmarks/ scripts; tests excepted) builds `kvpilot serve` /
`vllm serve` command lines and its own same-meaning options from the table (`to_flags`,
`flag_words`, `BY_NAME[name].flag`), never from a hand-written "--max-num-seqs". Issue 13:
"grep for each setting's flag spelling shows it in the settings module and its tests only".

The check reads each module's string literals with `ast` (docstrings and other bare string
statements are prose, not command lines, and are skipped; f-string parts are read like
literals) and fails on a literal that is a flag (`--max-num-seqs`, `-tp`,
`--no-enable-chunked-prefill`), starts with `--flag=`, or carries one behind another option
(`--engine-arg=--flag=...`). Help texts that mention a flag inside a sentence pass."""
from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from kvpilot.engine.settings import SETTINGS

REPO = Path(__file__).resolve().parents[2]
# pyproject's package-dir, and the scripts that reproduce the recorded benchmark results
PACKAGES = ("api", "bench", "cli", "engine", "kernels", "operator", "tuner", "benchmarks")
SETTINGS_MODULE = REPO / "engine" / "settings" / "table.py"
FLAGS = frozenset([s.flag for s in SETTINGS] + [s.short for s in SETTINGS if s.short]
                  + ["--no-" + s.flag[2:] for s in SETTINGS if s.type is bool])
_CARRIER = re.compile(r"^--[a-z][a-z0-9-]*=")  # `--engine-arg=` in `--engine-arg=--num-gpu-blocks-override=24`

# (file, flag): an option of our own tools that shares a setting's spelling with another meaning,
# or code that cannot import the table. Only literals in that file are exempt.
ALLOWED = {
    ("kernels/bench.py", "--dtype"): "the kernel micro-benchmark's tensor dtype; kernels import nothing of "
                                     "kvpilot (import-linter contract), so they cannot read the table",
    ("kernels/bench.py", "--block-size"): "the kernel micro-benchmark's KV block size; kernels import nothing of "
                                          "kvpilot (import-linter contract)",
    ("bench/harness/server_process.py", "--port"): "ServerProcess appends the port to any server's command: kvpilot serve, "
                                           "llama-server and llama_cpp.server all spell it --port",
    ("bench/compare.py", "--seed"): "the ShareGPT sampling seed of the benchmark (vllm bench serve's --seed), "
                                    "not the engine's sampling seed",
    ("bench/serve.py", "--seed"): "the ShareGPT / arrival seed of the client (vllm bench serve's --seed)",
    ("bench/sweep.py", "--seed"): "the ShareGPT / arrival seed of the workload, not the engine's",
    ("bench/throughput.py", "--seed"): "the ShareGPT sampling seed of the offline benchmark",
    ("bench/structured_outputs.py", "--seed"): "the ShareGPT sampling seed of the structured-outputs benchmark",
    ("bench/sampling_params_cost.py", "--seed"): "the ShareGPT sampling seed of the sampling-params benchmark",
    ("bench/shared_node.py", "--seed"): "the ShareGPT sampling seed of the shared-node benchmark",
    ("tuner/cli.py", "--seed"): "the Optuna sampler's seed, not the engine's",
    ("bench/reliability/fuzz_liveness.py", "--seed"): "the fuzz cases' seed (hypothesis / schemathesis), not the engine's",
    ("bench/reliability/fuzz_liveness.py", "--max-model-len"): "the fuzz's own option, which it passes on to the server "
                                                   "through the table (settings.to_flags)",
    ("tuner/cli.py", "--nnodes"): "the tuner's range of pods to search (LOW:HIGH), not one engine's node count",
    ("operator/render/vllm_cpu_launch.py", "--kv-cache-memory-bytes"): "the pod's launcher runs on the image's own "
        "python3 -I from the ConfigMap, standard library only: it reads vLLM's command line, cannot import the table",
    ("operator/render/vllm_cpu_launch.py", "--gpu-memory-utilization"): "the pod's launcher, standard library only (above)",
    ("tuner/cli.py", "--port"): "the tuner's option: a fixed port for the local engine, 0 (its default) = any "
                                "free port, which the engine's --port does not accept",
}


def _prose(tree: ast.AST) -> set[int]:
    """ids of the string constants that are statements of their own (docstrings, comments-as-strings)."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def flag_of(literal: str) -> str | None:
    """The setting flag `literal` spells as a command-line word, or None."""
    for text in (literal, _CARRIER.sub("", literal, count=1)):
        word = text.split("=", 1)[0]
        if word in FLAGS and (text == word or text.startswith(word + "=")):
            return word
    return None


def hand_written_flags(path: Path, relative: str) -> list[str]:
    """'file:line: "literal"' for each non-prose string literal of `path` that spells a setting's flag."""
    tree = ast.parse(path.read_text(), filename=str(path))
    prose = _prose(tree)
    strings = sorted((node.lineno, node.col_offset, node.value) for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose)
    return [f"{relative}:{line}: {text!r}" for line, _, text in strings
            if (flag := flag_of(text)) and (relative, flag) not in ALLOWED]


def product_sources() -> list[tuple[Path, str]]:
    return [(path, path.relative_to(REPO).as_posix()) for package in PACKAGES
            for path in sorted((REPO / package).rglob("*.py")) if path != SETTINGS_MODULE]


def test_no_product_module_spells_a_settings_flag_by_hand():
    found = [hit for path, relative in product_sources() for hit in hand_written_flags(path, relative)]
    assert not found, ("engine settings' flags written by hand outside engine/settings/table.py; build them from the "
                       "table (settings.to_flags / flag_words / BY_NAME[name].flag), or add a (file, flag) entry "
                       "with its reason to ALLOWED when the option only shares the spelling:\n" + "\n".join(found))


def test_the_check_catches_a_planted_flag_and_ignores_prose(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(textwrap.dedent('''\
        """Docstring: run with --max-num-seqs 4."""
        COMMAND = ["kvpilot", "serve", "--max-num-seqs", "4"]
        EQUALS = "--gpu-memory-utilization=0.5"
        NEGATED = ["--no-enable-chunked-prefill", "-tp", "2"]
        CARRIED = f"--engine-arg=--num-gpu-blocks-override={24}"
        HELP = "most requests at once, like the engine's --max-num-seqs"
        OTHER = ["--host", "127.0.0.1", "--max-num-seqsx", "--dtypes"]

        def f():
            """--block-size is prose here."""
        '''))
    hits = hand_written_flags(planted, "bench/planted.py")
    assert [h.split(": ", 1)[1] for h in hits] == [
        "'--max-num-seqs'", "'--gpu-memory-utilization=0.5'", "'--no-enable-chunked-prefill'", "'-tp'",
        "'--engine-arg=--num-gpu-blocks-override='"]
    assert hits[0].startswith("bench/planted.py:2: ")


def test_every_allowed_entry_is_still_needed():
    """An ALLOWED entry whose file no longer spells the flag is stale: remove it."""
    spelled = {(relative, flag) for path, relative in product_sources()
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               for flag in [flag_of(node.value)] if flag}
    assert set(ALLOWED) <= spelled, sorted(set(ALLOWED) - spelled)
