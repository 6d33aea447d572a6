"""What `spec.engine.extraArgs` may say. They are untrusted: a flag the operator renders from
spec.engine (or decides itself: the API key, the admin routes, the listen address) must not
be set again through extraArgs in any spelling, or the pod would run with settings that its
spec, its resources and its status do not show (`-tp 3` on a pod with one GPU, `--api-k=`
turning authentication off).

- runtime kvpilot: `kvpilot serve`'s own parser (allow_abbrev=False, imported without torch)
  reads the arguments, so `-tp 3`, `--tensor-parallel-size=3`, `--no-enable-chunked-prefill`
  all resolve to the setting they change; anything that parser refuses (unknown flags,
  abbreviations, stray positionals, bad values) is refused too.
- runtime vllm: vLLM's parser is not available to the operator, so a deny-list: the flags
  below, their `--no-` forms, underscore spellings (vLLM accepts `--max_num_seqs`), any
  prefix of them (argparse abbreviations), and `--config` (a YAML file that can set any flag).
"""
from __future__ import annotations

from kvpilot.engine.settings import CRD_FIELDS, SETTINGS
from kvpilot.engine.settings.cli_args import ArgsError, explicit_dests, make_serve_parser

# argparse dests of `kvpilot serve` that the operator owns: every setting spec.engine carries
# (kvpilot.engine.settings), the model and its served name, the server's identity, and where the
# pod sits in its group.
# The multi-node flags too: the operator renders them per pod from spec.parallelism (group_builders).
MULTINODE_SETTINGS = ("nnodes", "node_rank", "master_addr", "master_port", "headless")
OWNED_SETTINGS = frozenset({*CRD_FIELDS, "model", "served_model_name", "host", "api_key", "enable_admin_routes",
                            *MULTINODE_SETTINGS})
VLLM_CONFIG_FLAG = "--config"  # vLLM only: a YAML file that can set any flag


def _flag_names() -> dict[str, str]:
    """dest -> the flag's long name, from `kvpilot serve`'s parser (for messages)."""
    names = {}
    for action in make_serve_parser()._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        names[action.dest] = longs[0] if longs else action.dest
    return names


def _long_flag(dest: str, names: dict[str, str]) -> str:
    flag = names.get(dest, "")
    return flag if flag.startswith("--") else "--" + dest.replace("_", "-")  # the positional model: --model


# The same settings as `vllm serve` spells them (vLLM's names; -tp/-pp are its short forms).
_NAMES = _flag_names()
VLLM_DENIED_FLAGS = (*(_long_flag(d, _NAMES) for d in sorted(OWNED_SETTINGS)), VLLM_CONFIG_FLAG)
VLLM_DENIED_SHORT = tuple(s.short for s in SETTINGS if s.crd and s.short)


def extra_args_problem(runtime: str, extra_args: list[str] | tuple[str, ...], model: str) -> str | None:
    """Why extraArgs cannot be used with this runtime, or None when they can."""
    if runtime == "kvpilot":
        return _kvpilot_problem(list(extra_args), model)
    return _vllm_problem(list(extra_args))


def _kvpilot_problem(extra_args: list[str], model: str) -> str | None:
    try:
        given = explicit_dests([model, *extra_args])
    except ArgsError as exc:
        return (f"extraArgs {extra_args!r} are not valid `kvpilot serve` flags: {exc} "
                "(flags must be written out in full; see `kvpilot serve --help`)")
    given.pop("model", None)  # the model we put first
    owned = sorted(OWNED_SETTINGS & set(given))
    if owned:
        return (f"extraArgs set {', '.join(_NAMES[d] for d in owned)}, which the operator sets from spec.engine "
                "(or owns: API key, admin routes, listen address, the multi-node flags from spec.parallelism); "
                "set the matching spec.engine field instead")
    return None


def _normalize(arg: str) -> str:
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
        if name.startswith("--no-"):
            name = "--" + name[len("--no-"):]
    return name


def _vllm_problem(extra_args: list[str]) -> str | None:
    denied = []
    for arg in extra_args:
        if not arg.startswith("-") or arg == "--":
            continue
        name = _normalize(arg)
        if name.startswith("--"):
            # exact, or an abbreviation of a denied flag (argparse's allow_abbrev)
            if len(name) > 2 and any(flag.startswith(name) for flag in VLLM_DENIED_FLAGS):
                denied.append(arg)
        elif any(name.startswith(short) for short in VLLM_DENIED_SHORT):
            denied.append(arg)
    if denied:
        return (f"extraArgs {denied!r} set flags that the operator owns for runtime vllm "
                f"({', '.join(VLLM_DENIED_FLAGS + VLLM_DENIED_SHORT)}, in any spelling or abbreviation); "
                "set the matching spec.engine field instead")
    return None
