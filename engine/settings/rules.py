"""The rules between engine settings: each a Python check and the same check in CEL (Kubernetes'
x-kubernetes-validations on spec.engine), which tests/engine/test_settings.py evaluates against
each other. The table (`table.py`) applies them in `problems`; the CRD generator renders `cel`.

`SPEC_RULES` hold the rules that reach outside spec.engine (`NNODES_RULE`: spec.parallelism.nnodes
must divide the engine's tensor x pipeline ranks): the CRD renders them on spec, and the engine,
the operator and the tuner apply their check (`nnodes_divides`) with messages of their own.

Standard library only, like the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["NNODES_RULE", "RULES", "Rule", "SPEC_RULES", "nnodes_divides", "rule_problems"]


@dataclass(frozen=True)
class Rule:
    """A rule between settings. check(values) -> bool over resolved values (every name in
    `names` present and not None; the rule is skipped otherwise). message(show) -> str, where
    show(name) spells a setting (snake_case or camelCase, with or without its value). cel: the
    same check over `self` = spec.engine after CRD defaulting (with on="spec", over `self` = spec,
    the settings spelled by their paths there, `SPEC_PATHS`); field: the setting it blames."""

    names: tuple[str, ...]
    check: Callable[[Mapping[str, Any]], bool]
    message: Callable[[Callable[[str], str]], str]
    cel: str
    field: str
    optional: tuple[str, ...] = ()  # names the check reads even when None (unset: no flag)
    on: str = "engine"  # the CRD object cel's `self` is: "engine" (spec.engine) or "spec"


RULES: tuple[Rule, ...] = (
    Rule(("max_num_batched_tokens", "max_num_seqs"),
         lambda v: v["max_num_batched_tokens"] >= v["max_num_seqs"],
         lambda n: (f"{n('max_num_batched_tokens')} must be >= {n('max_num_seqs')}: each running sequence needs one "
                    f"token per step; raise {n('max_num_batched_tokens:')} or lower {n('max_num_seqs:')}"),
         "self.maxNumBatchedTokens >= self.maxNumSeqs", "max_num_batched_tokens"),
    Rule(("enable_chunked_prefill", "max_num_batched_tokens", "max_model_len"),
         lambda v: v["enable_chunked_prefill"] or v["max_num_batched_tokens"] >= v["max_model_len"],
         lambda n: (f"{n('max_num_batched_tokens')} is smaller than {n('max_model_len')} with chunked "
                    f"prefill off ({n('enable_chunked_prefill:')} false): a prompt longer than the budget can never "
                    f"be scheduled; raise {n('max_num_batched_tokens:')}, lower {n('max_model_len:')} or enable "
                    f"chunked prefill"),
         "self.enableChunkedPrefill || self.maxNumBatchedTokens >= self.maxModelLen", "max_num_batched_tokens"),
    Rule(("preemption_mode", "swap_space"),
         lambda v: v["preemption_mode"] != "swap" or v["swap_space"] > 0,
         lambda n: f"{n('preemption_mode:')} swap needs {n('swap_space:')} > 0",
         "self.preemptionMode != 'swap' || self.swapSpace > 0.0", "swap_space"),
    # vLLM's `vllm serve` refuses it at start ("--enable-auto-tool-choice requires --tool-call-parser")
    Rule(("enable_auto_tool_choice",),
         lambda v: not v["enable_auto_tool_choice"] or v.get("tool_call_parser") is not None,
         lambda n: f"{n('enable_auto_tool_choice:')} needs {n('tool_call_parser:')} (e.g. hermes) to find the calls",
         "!has(self.enableAutoToolChoice) || !self.enableAutoToolChoice || has(self.toolCallParser)",
         "enable_auto_tool_choice", optional=("tool_call_parser",)),
)


def nnodes_divides(world_size: int, nnodes: int) -> bool:
    """Whether `nnodes` nodes (pods; vLLM's --nnodes, spec.parallelism.nnodes) can share a world of
    `world_size` = tensor_parallel_size x pipeline_parallel_size ranks: every node runs the same
    number, world_size / nnodes (vLLM's multi-node executor), so nnodes must be >= 1 and divide it."""
    return nnodes >= 1 and world_size % nnodes == 0


# Over spec: nnodes is spec.parallelism's, the sizes spec.engine's. nnodes < 1 passes the CEL (the
# field's minimum refuses it; the guard keeps the modulo from dividing by zero).
NNODES_RULE = Rule(
    ("nnodes", "tensor_parallel_size", "pipeline_parallel_size"),
    lambda v: nnodes_divides(v["tensor_parallel_size"] * v["pipeline_parallel_size"], v["nnodes"]),
    lambda n: (f"{n('nnodes')} must divide {n('tensor_parallel_size')} x {n('pipeline_parallel_size')} (the "
               f"engine's ranks are spread evenly over the pods)"),
    "self.parallelism.nnodes < 1 || (self.engine.tensorParallelSize * self.engine.pipelineParallelSize) "
    "% self.parallelism.nnodes == 0", "nnodes", on="spec")
SPEC_RULES: tuple[Rule, ...] = (NNODES_RULE,)


def rule_problems(values: Mapping[str, Any], spell: Callable[[str], str] = lambda name: name) -> list[str]:
    """The messages of the rules `values` breaks (rules missing a value of `names` are skipped;
    `optional` names are read as None).
    spell(name) names a setting in the caller's spelling (`CRD_FIELDS.get` for spec.engine)."""
    def show(key: str) -> str:  # 'name' shows the value, 'name:' only the name
        name = key.rstrip(":")
        return spell(name) if key.endswith(":") else f"{spell(name)} ({values[name]})"
    return [rule.message(show) for rule in RULES
            if all(values.get(n) is not None for n in rule.names) and not rule.check(values)]
