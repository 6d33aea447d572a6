"""The README's structured-outputs and tool-call example (section "Structured outputs and tool
calls") runs as written against the shared server, only its URL and key swapped in, and prints
what it promises: a JSON object valid for its schema, a required tool call, one of the choices."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
from server_harness import API_KEY

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_python_block(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readmes_structured_outputs_example_runs_as_shown(server, capsys):
    text = README.read_text()
    section = text[text.index("### Structured outputs and tool calls"):]
    serve = re.search(r"```bash\n(kvpilot serve .*?)```", section, re.S).group(1)
    flags = shlex.split(serve.replace("\\\n", " "))[3:]
    assert " ".join(flags) in " ".join(server.flags)  # the shared server runs with the README's flags
    code = readme_python_block("### Structured outputs and tool calls")
    assert 'base_url="http://localhost:8000/v1", api_key="EMPTY"' in code
    code = code.replace('base_url="http://localhost:8000/v1", api_key="EMPTY"',
                        f'base_url="{server.url}/v1", api_key="{API_KEY}"')
    exec(compile(code, str(README), "exec"), {})
    city, call, choice = capsys.readouterr().out.splitlines()
    city = ast.literal_eval(city)
    assert isinstance(city["city"], str) and isinstance(city["population"], int)
    finish, name, arguments = call.split(" ", 2)
    assert (finish, name) == ("tool_calls", "get_weather") and isinstance(ast.literal_eval(arguments)["city"], str)
    assert choice in ("yes", "no")
