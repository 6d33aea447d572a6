"""Run by the pinned upstream vLLM's Python (scripts/install-vllm.sh), never by the project's:
parses each command line given on stdin with `vllm serve`'s own argument parser, built as
vLLM's CLI builds it (vllm/entrypoints/cli/main.py: a FlexibleArgumentParser whose `serve`
subcommand is ServeSubcommand.subparser_init), then applies ServeSubcommand.validate,
EngineArgs.from_cli_args and the SchedulerConfig that EngineArgs.create_engine_config builds
(its limits' rules, where both limits are given; chunked prefill on unless turned off, as
in vLLM V1), which check values and combinations without loading a model (a
max_model_len of -1, the model's own, is taken as 2048 there).

stdin:  a JSON list of argv lists, each the words after the program (`serve MODEL --flag ...`)
stdout: a JSON list, per argv: {"ok": bool, "error": str} (error: argparse's message or the
        exception's, "" when ok)
"""
from __future__ import annotations

import contextlib
import io
import json
import sys


def main() -> None:
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers)
    results = []
    for argv in json.load(sys.stdin):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv)
                if getattr(args, "model_tag", None) is not None:
                    args.model = args.model_tag  # as ServeSubcommand.cmd does
                serve.validate(args)
                engine = EngineArgs.from_cli_args(args)
                max_model_len = engine.max_model_len if engine.max_model_len and engine.max_model_len > 0 else 2048
                if engine.max_num_batched_tokens is not None and engine.max_num_seqs is not None:
                    SchedulerConfig(runner_type="generate", max_num_batched_tokens=engine.max_num_batched_tokens,
                                    max_num_seqs=engine.max_num_seqs, max_model_len=max_model_len,
                                    enable_chunked_prefill=engine.enable_chunked_prefill is not False,
                                    is_encoder_decoder=False)
            results.append({"ok": True, "error": ""})
        except SystemExit:
            results.append({"ok": False, "error": err.getvalue().strip().splitlines()[-1] if err.getvalue() else "exit"})
        except Exception as exc:  # noqa: BLE001 (any refusal is the answer)
            results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
