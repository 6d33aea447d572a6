"""`kvpilot tune --local --runtime vllm` without a server: the flags spelled for the pinned vLLM,
the `vllm serve` command line and environment, where vLLM is found, the CLI's exit 2 when it is
not or lacks a flag, and vLLM's start-up failures classified from its log."""
from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvpilot.tuner import cli, demo
from kvpilot.tuner.local import session as local_session
from kvpilot.tuner.failures import OUT_OF_MEMORY, REJECTED, classify
from kvpilot.tuner.search.feasibility import Hardware
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.local.vllm_runtime import (VLLM_CPU_BLOCK_SIZE, VLLM_MODULE, VLLMNotFound, vllm_engine, vllm_environment,
                                        vllm_serve_command)

CPU = Hardware(device_memory_bytes=16 << 30, shared_memory=True, one_machine=True)


def executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def test_runtime_vllm_leaves_out_the_flags_vllm_032_refuses():
    s = EngineSettings(max_model_len=256, kv_cache_memory_bytes=1 << 20)
    kvpilot, vllm = s.to_flags(), s.to_flags("vllm")
    assert {"--swap-space", "--preemption-mode"} <= set(kvpilot)
    assert not {"--swap-space", "--preemption-mode"} & set(vllm)
    assert [f for f in kvpilot if f not in ("--swap-space", "4", "--preemption-mode", "recompute")] == vllm
    assert vllm[vllm.index("--kv-cache-memory-bytes") + 1] == str(1 << 20)
    with pytest.raises(ValueError, match="runtime must be one of"):
        s.to_flags("sglang")


def test_the_vllm_command_line_serves_the_directory_under_the_models_name(tmp_path, hf_dir):
    serve = ["/opt/vllm/bin/python", "-P", "-m", VLLM_MODULE, "serve"]
    engine = vllm_engine(str(hf_dir), tmp_path / "report" / "engine.log", serve, ["--enforce-eager"], "key")
    engine.port = 8123
    settings = EngineSettings(max_model_len=256, block_size=32, kv_cache_memory_bytes=9 << 20)
    command = engine.command(settings)
    assert command[:6] == [*serve, str(hf_dir)]
    assert command[command.index("--port") + 1] == "8123"
    assert command[-3:] == ["--served-model-name", str(hf_dir), "--enforce-eager"]
    assert command[command.index("--block-size") + 1] == "32"
    assert not {"--swap-space", "--preemption-mode", "--enable-admin-routes"} & set(command)
    # kvpilot's control routes are not vLLM's; the key goes in the environment, never on the line
    assert engine.admin_token is None and not engine.structured_exit and "key" not in command
    assert engine.cwd == tmp_path / "report"  # a Python started in the repo root imports its operator/
    env = engine.environment()
    assert env["VLLM_API_KEY"] == "key" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["VLLM_LOG_STATS_INTERVAL"] == "1"


def test_the_users_vllm_environment_wins_except_the_cache_size_that_overrides_the_trials():
    env = vllm_environment({"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4", "PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["PATH"] == "/bin"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # vLLM lets it override --kv-cache-memory-bytes


def test_vllm_is_found_beside_a_given_python_then_in_the_repos_venv_then_on_path(tmp_path):
    given = executable(tmp_path / "env" / "bin" / "python")
    executable(tmp_path / "env" / "bin" / "vllm")
    repo, nowhere = tmp_path / "repo", lambda name: None
    assert vllm_serve_command(str(given), repo, nowhere) == [str(given), "-P", "-m", VLLM_MODULE, "serve"]
    venv = executable(repo / ".venv-vllm" / "bin" / "python")
    assert vllm_serve_command(None, repo, nowhere) == [str(venv), "-P", "-m", VLLM_MODULE, "serve"]
    assert vllm_serve_command(None, tmp_path / "other", lambda name: "/usr/bin/vllm") == ["/usr/bin/vllm", "serve"]
    with pytest.raises(VLLMNotFound, match="make vllm"):
        vllm_serve_command(None, tmp_path / "other", nowhere)


def test_a_given_python_without_vllm_is_refused_with_what_to_change(tmp_path):
    bare = executable(tmp_path / "bare" / "bin" / "python")
    with pytest.raises(VLLMNotFound, match="no `vllm` beside it"):
        vllm_serve_command(str(bare), tmp_path, lambda name: None)
    with pytest.raises(VLLMNotFound, match="no such executable"):
        vllm_serve_command(str(tmp_path / "missing" / "python"), tmp_path, lambda name: None)


def test_the_cli_exits_2_when_vllm_is_not_found_or_not_local(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse(["--local", "--runtime", "vllm", "--vllm-python", str(tmp_path / "python")])
    assert exit_.value.code == 2 and "--vllm-python" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.parse(["--namespace", "d", "--name", "x", "--runtime", "vllm"])
    assert exit_.value.code == 2 and "spec.engine.runtime" in capsys.readouterr().err


def test_runtime_vllm_restarts_every_trial_and_counts_its_cpu_blocks(tmp_path, monkeypatch):
    python = executable(tmp_path / "env" / "bin" / "python")
    executable(tmp_path / "env" / "bin" / "vllm")
    a = cli.parse(["--local", "--runtime", "vllm", "--vllm-python", str(python), "--report-dir", str(tmp_path),
                   "--engine-arg=--kv-cache-memory-bytes=9M", "--engine-arg=--enforce-eager"])
    assert a.no_live and a.serve_command == [str(python), "-P", "-m", VLLM_MODULE, "serve"]
    monkeypatch.setattr(local_session, "check_flags", lambda *args, **kw: None)
    monkeypatch.setattr("kvpilot.tuner.search.feasibility.model_directory", lambda model: tmp_path)
    base, engine = local_session.local_engine(a, CPU)
    assert base.block_size == VLLM_CPU_BLOCK_SIZE and base.kv_cache_memory_bytes == 9 << 20
    assert engine.runtime == "vllm" and engine.extra_args[-1] == "--enforce-eager"
    a = cli.parse(["--local", "--runtime", "vllm", "--vllm-python", str(python), "--report-dir", str(tmp_path),
                   "--engine-arg=--kv-cache-memory-bytes=9M", "--engine-arg=--block-size=64"])
    base, engine = local_session.local_engine(a, CPU)
    assert base.block_size == 64 and "--block-size" not in engine.extra_args  # the trial's own flag carries it


def fake_vllm(tmp_path: Path, help_text: str) -> Path:
    """A Python that answers `-P -m vllm... serve --help=all` with help_text."""
    bin_dir = tmp_path / "fake" / "bin"
    executable(bin_dir / "vllm")
    return executable(bin_dir / "python", "#!/bin/sh\ncat <<'EOF'\n" + help_text + "\nEOF\n")


def test_the_cli_exits_2_naming_a_flag_vllm_lacks_and_the_cache_it_needs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(local_session, "hardware_for", lambda a: CPU)
    monkeypatch.setattr("kvpilot.tuner.search.feasibility.model_directory", lambda model: tmp_path)  # no conversion
    python = fake_vllm(tmp_path, "usage: vllm serve\n  --max-model-len\n  --max-num-seqs\n")  # an old vLLM
    argv = ["--local", "--runtime", "vllm", "--vllm-python", str(python), "--report-dir", str(tmp_path / "r")]
    assert cli.main(argv + ["--engine-arg=--kv-cache-memory-bytes=9M"]) == 2
    err = capsys.readouterr().err
    assert "does not accept" in err and "--kv-cache-memory-bytes" in err and "--block-size" in err
    assert "--max-model-len," not in err.split("does not accept")[1]
    assert cli.main(argv) == 2  # on CPU the defaults trial's cache is in bytes
    assert "--engine-arg=--kv-cache-memory-bytes=N" in capsys.readouterr().err


@pytest.mark.parametrize("log, kind", [
    ("ValueError: To serve at least one request with the model's max seq len (256), (0.01 GiB KV cache is needed, "
     "which is larger than the available KV cache memory (0.0 GiB).", OUT_OF_MEMORY),
    ("ValueError: Available memory on node 0 (3.1/23.5 GiB) on kv cache allocation is less than requested memory "
     "for kv (20.0/21.2 GiB). Reduce CPU memory used by other processes.", OUT_OF_MEMORY),
    ("RuntimeError: Worker failed with error 'No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).'", REJECTED),
    ("vllm serve: error: unrecognized arguments: --swap-space 4", REJECTED),
])
def test_vllm_start_failures_are_classified_from_its_log(log, kind):
    assert classify(1, f"(EngineCore pid=1) ERROR 11-28 09:38:35 [core.py:1510] {log}\n") == kind


def test_the_story_on_vllm_runs_restart_trials_with_its_block_size(tmp_path):
    cache = demo.size_cache(88, VLLM_CPU_BLOCK_SIZE)
    assert cache.block_size == 32 and cache.num_blocks == demo.CACHE_REQUESTS * 3  # 88 tokens: 3 blocks of 32
    python = fake_vllm(tmp_path, "")
    a = cli.parse(demo.demo_args(demo.Calibration(0.2, 0.06), cache, tmp_path, runtime="vllm")
                  + ["--vllm-python", str(python)])
    assert a.runtime == "vllm" and a.no_live and "--enforce-eager" in a.engine_args
    assert a.space.kv_cache_memory_bytes == (cache.kv_cache_memory_bytes, 4 * cache.kv_cache_memory_bytes)
    assert a.serve_command[0] == str(python)
