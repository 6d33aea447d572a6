"""`kvpilot serve`'s parser lives in the torch-free kvpilot.engine.settings.cli_args (the operator parses
extraArgs with it); its defaults must be EngineArgs' and it must not accept abbreviations."""
from __future__ import annotations

import dataclasses

import pytest

from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.attention import BACKENDS
from kvpilot.engine.settings.cli_args import ATTENTION_BACKENDS, make_serve_parser


def test_parser_defaults_are_the_engine_args_defaults():
    ns = make_serve_parser().parse_args([])
    assert EngineArgs.from_cli_args(ns) == EngineArgs()
    assert {f.name for f in dataclasses.fields(EngineArgs)} <= set(vars(ns))
    assert ATTENTION_BACKENDS == BACKENDS


@pytest.mark.parametrize("argv", [["--max-num-seq", "9"], ["--api-k=x"], ["--disable-log-stat"]])
def test_abbreviations_are_refused(argv):
    with pytest.raises(SystemExit) as info:
        make_serve_parser().parse_args(argv)
    assert info.value.code == 2


def test_the_api_key_from_a_key_file_loses_its_newline_and_a_blank_key_is_refused():
    """A Secret made with `kubectl create secret generic --from-file=api-key=f` keeps the file's
    trailing newline; an Authorization header cannot carry it, so the key is stripped (the
    in-cluster tuner strips it the same way: tests/tuner/test_tuner_api_key.py)."""
    from kvpilot.engine.entrypoints.serve import resolve_secrets

    parser = make_serve_parser()
    ns = parser.parse_args([])
    assert resolve_secrets(parser, ns, {"VLLM_API_KEY": "0f3a9c\n"}) == ("0f3a9c", None)
    assert resolve_secrets(parser, ns, {}) == (None, None)
    with pytest.raises(SystemExit) as stopped:
        resolve_secrets(parser, ns, {"VLLM_API_KEY": " \n"})
    assert stopped.value.code == 2



def test_serve_help_lists_vllms_newest_flags_with_their_meaning():
    """`kvpilot serve --help` documents --performance-mode, --max-model-len auto and
    --kv-cache-memory-bytes (issue 33), as the console script prints it."""
    import subprocess
    import sys

    text = subprocess.run([sys.executable, "-m", "kvpilot.cli.main", "serve", "--help"], capture_output=True,
                          text=True, check=True).stdout
    flat = " ".join(text.split())
    assert "--performance-mode {balanced,interactivity,throughput}" in flat
    assert "--max-model-len N|auto" in flat and "auto or -1" in flat
    assert "--kv-cache-memory-bytes BYTES" in flat and "gpu_memory_utilization" in flat
