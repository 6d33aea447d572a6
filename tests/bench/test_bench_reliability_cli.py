"""The reliability tools are `kvpilot bench` commands like the others: each answers --help under
its command name, and a bad flag exits 2 before any server starts."""

from __future__ import annotations

import pytest

from kvpilot.cli.main import main

TOOLS = {"reliability": "--fuzz-requests", "fuzz-liveness": "--canary-every", "slow-clients": "--connections"}


@pytest.mark.parametrize("name, flag", TOOLS.items())
def test_each_reliability_tool_is_a_bench_command_with_its_flags(name, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvpilot bench {name} ") and flag in out and "--out" in out


@pytest.mark.parametrize("name, flag", TOOLS.items())
def test_a_bad_flag_value_exits_2_before_a_server_starts(name, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", name, flag, "many"])
    assert exc.value.code == 2
    assert "invalid" in capsys.readouterr().err
