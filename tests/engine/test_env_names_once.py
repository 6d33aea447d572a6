"""Every environment variable kvpilot reads or sets (KVPILOT_*, and the VLLM_* ones it reads or sets
for vLLM) is named once, in kvpilot.engine.settings.env (issue 51: "env-var names of the project
in one place"): the product code imports the constant and never spells the name as a string
literal. Two modules run without kvpilot importable and keep literal copies, which must be the
same names.

Like test_settings_single_source.py, the check reads each module's string literals with `ast`:
docstrings and other bare string statements are prose and are skipped, and so is a name inside
a sentence; a literal that is exactly a name fails."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvpilot.api import vllm
from kvpilot.engine.settings import env
from kvpilot.operator.render import vllm_cpu_launch

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "bench", "cli", "engine", "kernels", "loadgen", "operator", "tuner", "benchmarks")
NAME = re.compile(r"^(KVPILOT|VLLM)_[A-Z0-9_]+$")
ENV_MODULE = "engine/settings/env.py"
# Modules that cannot import kvpilot, so keep their own literals (held equal to env's below).
STANDALONE = {
    "operator/render/vllm_cpu_launch.py": "run by a vLLM image's own python3 -I from the ConfigMap, standard "
                                          "library only",
    "api/vllm.py": "read with runpy.run_path by the installer and the image build: plain assignments only",
}


def env_literals(path: Path) -> list[tuple[int, str]]:
    """(line, literal) for each non-prose string literal of `path` that is exactly an env name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
             and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                  and NAME.match(node.value))


def product_modules() -> list[Path]:
    return sorted(p for package in PACKAGES if (REPO / package).is_dir()
                  for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_but_the_env_module_spells_an_env_name():
    found = [f"{path.relative_to(REPO)}:{line}: {text!r}" for path in product_modules()
             if str(path.relative_to(REPO)) not in (ENV_MODULE, *STANDALONE)
             for line, text in env_literals(path)]
    assert not found, ("spell these through kvpilot.engine.settings.env (add the name there if it is new):\n"
                       + "\n".join(found))


def test_each_constant_is_its_own_name_and_the_set_lists_them():
    assert env.NAMES and all(getattr(env, name) == name and NAME.match(name) for name in env.NAMES)
    assert {line_name for _, line_name in env_literals(REPO / ENV_MODULE)} == env.NAMES


@pytest.mark.parametrize("relative", sorted(STANDALONE))
def test_the_standalone_modules_literals_are_env_names(relative):
    unknown = {text for _, text in env_literals(REPO / relative)} - env.NAMES
    assert not unknown, f"{relative} spells {sorted(unknown)}, which kvpilot.engine.settings.env lacks"


def test_the_launchers_copies_equal_the_env_modules():
    assert (vllm_cpu_launch.CPU_LIMIT_ENV, vllm_cpu_launch.MEMORY_LIMIT_ENV, vllm_cpu_launch.RANKS_ENV) == (
        env.KVPILOT_CPU_LIMIT_MILLICORES, env.KVPILOT_MEMORY_LIMIT_BYTES, env.KVPILOT_RANKS_PER_POD)
    assert set(vllm.VLLM_CPU_UNPINNED_ENVIRONMENT) == {env.VLLM_CPU_NUM_OF_RESERVED_CPU, env.VLLM_CPU_OMP_THREADS_BIND}
