"""`kvpilot bench tuning grid|replay|confirm`: the tuning-quality benchmark's three steps.

    kvpilot bench tuning grid [--scenarios preempt,ttft,itl --repeats 3] --output-json grid.json
    kvpilot bench tuning replay --grid grid.json [--seeds 20] --output-json replay.json
    kvpilot bench tuning confirm --replay replay.json [--windows 3] --output-json confirm.json

Each prints a table and writes JSON. The defaults are small (the two-point `quick` scenario,
one repeat, 2 seeds, 1 window): the published run names its scenarios and repeats. Exit 0 when
done, 1 when the engine refused to run a point, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvpilot.engine.settings import BY_NAME
from kvpilot.tuner.benchmark import confirm, grid, render, replay
from kvpilot.tuner.benchmark.scenarios import SCENARIOS, Scenario
from kvpilot.tuner.benchmark.windows import DEFAULT_MODEL
from kvpilot.tuner.failures import TrialFailed

# grid axis -> its flag: the setting's own spelling, taking a comma-separated list of values
AXIS_FLAGS = {name: BY_NAME[name].flag for name in ("max_num_seqs", "max_num_batched_tokens")}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"write comma-separated integers, e.g. 2,256; got {text!r}") from None


def _span(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise argparse.ArgumentTypeError(f"write LOW:HIGH in tokens, e.g. 16:64; got {text!r}")
    return int(low), int(high)


def _add_grid(sub: Any) -> None:
    g = sub.add_parser("grid", help="measure every point of the scenarios' grids on the engine",
                       description=grid.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--scenarios", default="quick", help=f"comma-separated, from {','.join(SCENARIOS)}")
    g.add_argument("--repeats", type=int, default=1, help="windows per point (interleaved repeats)")
    g.add_argument("--model", default=DEFAULT_MODEL, help="builtin alias or HF directory")
    o = g.add_argument_group("overrides of every chosen scenario (default: the scenario's)")
    o.add_argument(BY_NAME["max_model_len"].flag, type=int, help="tokens")
    o.add_argument(BY_NAME["num_gpu_blocks_override"].flag, type=int, dest="kv_blocks", help="the KV cache, in blocks")
    for name, flag in AXIS_FLAGS.items():
        o.add_argument(flag, type=_ints, dest=name, metavar="N[,N...]", help="the grid's values")
    o.add_argument("--chunked-prefill", choices=("both", "on", "off"), help="the grid's chunked prefill values")
    o.add_argument("--num-requests", type=int, dest="requests", help="requests per window (plus one warm-up)")
    o.add_argument("--request-rate", type=float, dest="rate", help="requests/s; inf: all at once")
    o.add_argument("--prompt-len", type=_span, metavar="LOW:HIGH", help="ShareGPT prompts' tokens")
    o.add_argument("--output-len", type=int, help="tokens per reply (ignore_eos)")
    g.add_argument("--output-json", default="tuning-grid.json")
    g.add_argument("--resume", action="store_true", help="continue the windows --output-json holds")
    g.add_argument("--log-dir", default=None, help="the engine's logs (default: a temp dir)")
    g.set_defaults(run=run_grid, parser=g)


def _add_replay(sub: Any) -> None:
    r = sub.add_parser("replay", help="replay the tuner and other strategies on a measured grid",
                       description=replay.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--grid", nargs="+", required=True, metavar="GRID_JSON", help="grid files (scenarios merged)")
    r.add_argument("--scenarios", default=None, help="comma-separated (default: every one in the grids)")
    r.add_argument("--seeds", type=int, default=2, help="replays per strategy (the published run: 20)")
    r.add_argument("--output-json", default="tuning-replay.json")
    r.set_defaults(run=run_replay, parser=r)


def _add_confirm(sub: Any) -> None:
    c = sub.add_parser("confirm", help="the tuner's choice against the defaults, live",
                       description=confirm.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--replay", required=True, metavar="REPLAY_JSON")
    c.add_argument("--scenarios", default=None, help="comma-separated (default: every one in the replay)")
    c.add_argument("--windows", type=int, default=1, help="windows of each setting, interleaved (published: 3)")
    c.add_argument("--output-json", default="tuning-confirm.json")
    c.add_argument("--log-dir", default=None, help="the engine's logs (default: a temp dir)")
    c.set_defaults(run=run_confirm, parser=c)


def build_parser() -> argparse.ArgumentParser:
    """`kvpilot bench tuning`'s parser: the grid, replay and confirm steps as subcommands (one
    required), each with its own flags. Exits 2 on bad flags (argparse)."""
    p = argparse.ArgumentParser(prog="kvpilot bench tuning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True, metavar="{grid,replay,confirm}")
    _add_grid(sub)
    _add_replay(sub)
    _add_confirm(sub)
    return p


def grid_scenarios(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, Scenario]:
    """The chosen scenarios with the flags' overrides; exits 2 naming the flag to change."""
    names = [n.strip() for n in a.scenarios.split(",") if n.strip()]
    if not names or any(n not in SCENARIOS for n in names):
        p.error(f"--scenarios takes names from {','.join(SCENARIOS)}, got {a.scenarios!r}")
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    fields = ("max_model_len", "kv_blocks", "requests", "rate", "prompt_len", "output_len")
    given = {f: getattr(a, f) for f in fields if getattr(a, f) is not None}
    axes = {name: getattr(a, name) for name in AXIS_FLAGS if getattr(a, name) is not None}
    if a.chunked_prefill:
        axes["enable_chunked_prefill"] = {"both": [True, False], "on": [True], "off": [False]}[a.chunked_prefill]
    out = {}
    for name in names:
        try:
            out[name] = SCENARIOS[name].replace(**given, axes={**SCENARIOS[name].axes, **axes})
        except ValueError as e:
            p.error(str(e))
    return out


def _write(path: Path, data: dict[str, Any]) -> None:
    """Writes JSON through a temporary file, so an interrupted run leaves the last table whole."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _read(p: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        p.error(f"cannot read {path}: {e}")


def _chosen(p: argparse.ArgumentParser, found: dict[str, Any], names: str | None,
            what: str) -> dict[str, Any]:
    if names is None:
        return found
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if missing := [n for n in wanted if n not in found]:
        p.error(f"--scenarios {','.join(missing)}: not in {what} (it holds {','.join(found)})")
    return {n: found[n] for n in wanted}


def run_grid(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """Measures the grid into --output-json (after every window) and prints its table."""
    scenarios = grid_scenarios(p, a)
    out = Path(a.output_json)
    table = _read(p, a.output_json) if a.resume and out.exists() else {}
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="kvpilot-tuning-grid-"))
    try:
        grid.measure_grid(table, scenarios, a.model, a.repeats, log_dir, lambda: _write(out, table))
    except ValueError as e:
        p.error(str(e))
    print(render.grid_table(table))
    print(f"grid: {out}; engine logs: {log_dir}", file=sys.stderr)
    return 0


def run_replay(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """Replays every strategy on the grid files' scenarios; writes and prints the ratios."""
    if a.seeds < 1:
        p.error(f"--seeds must be >= 1, got {a.seeds}")
    entries, models = {}, {}
    for path in a.grid:
        table = _read(p, path)
        for name, entry in table.get("scenarios", {}).items():
            entries[name], models[name] = entry, table.get("model", DEFAULT_MODEL)
    entries = _chosen(p, entries, a.scenarios, "the grid files")
    try:
        replayed = {name: replay.replay_scenario(name, entry, models[name], a.seeds) for name, entry in entries.items()}
    except ValueError as e:
        p.error(str(e))
    _write(Path(a.output_json), replayed)
    print(render.replay_table(replayed))
    return 0


def run_confirm(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """Runs the replay's tuner choice against the defaults live; writes and prints the comparison."""
    if a.windows < 1:
        p.error(f"--windows must be >= 1, got {a.windows}")
    replayed = _chosen(p, _read(p, a.replay), a.scenarios, a.replay)
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="kvpilot-tuning-confirm-"))
    out, confirmed = Path(a.output_json), {}
    for name, r in replayed.items():
        confirmed[name] = confirm.confirm_scenario(name, r, r.get("model", DEFAULT_MODEL), a.windows, log_dir)
        _write(out, confirmed)
    print(render.confirm_table(confirmed))
    return 0


def main(argv: list[str]) -> int:
    """`kvpilot bench tuning STEP ...`: 0 when done, 1 when the engine failed, 2 on bad flags."""
    a = build_parser().parse_args(argv)
    try:
        return a.run(a.parser, a)
    except TrialFailed as e:
        print(f"kvpilot bench tuning {a.step}: the engine failed ({e.kind}): {e.message[-1500:]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
