"""One engine over two `kvpilot serve` processes on this machine, each a node as a pod would be
(`--nnodes 2 --node-rank R --master-addr 127.0.0.1 --master-port P`, node 1 headless, one rank
each): greedy output equals one process for pipeline parallel (SmolLM2, stage 1 on node 1) and
tensor parallel (a 4-head Llama: SmolLM2's 9 heads do not split in 2) across the processes;
killing node 1 fails node 0's request with an error and its /health within seconds (then
node 0 exits 5 naming the node); killing node 0 ends node 1 with exit 5 and the reason; node 0's
shutdown ends node 1 with 0; a node that finds no node 0 exits 1 saying where it looked; bad
flags exit 2 saying what to change. The rendezvous itself
(late nodes, missing ones, a rank claimed twice): test_rendezvous.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest
import torch

from kvpilot.bench.harness.node_group import HeadlessNode, NodeGroup, node_flags
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.entrypoints import serve
from kvpilot.engine.exit_codes import EXIT_BAD_ARGS, EXIT_ENGINE_DIED, parse_failure
from kvpilot.engine.settings import to_flags
from kvpilot.loadgen.process import KVPILOT_SERVE, free_port

from tiny_llama import save_tiny_llama, tiny_llm

pytestmark = pytest.mark.slow

ENV = {**os.environ, "KVPILOT_RENDEZVOUS_TIMEOUT_S": "180"}  # the default 5 s node timeout: no false alarm under load
MAX_TOKENS = 12


def completion_texts(url: str, prompts: list[str]) -> list[str]:
    texts = []
    for prompt in prompts:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"].strip())  # the server's text may keep a leading space
    return texts


def offline_texts(llm, prompts: list[str]) -> list[str]:
    """One prompt at a time, as the server gets them."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        return [llm.generate(prompt, params)[0].outputs[0].text.strip() for prompt in prompts]
    finally:
        llm.engine.close()


def health_code(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:  # node 0 has exited: also not healthy
        return None


def test_pipeline_stages_on_two_nodes_match_one_process_and_a_lost_node_fails_node_0(model_path, tmp_path):
    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    engine = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_seqs": 4,
              "num_gpu_blocks_override": 64, "swap_space": 0, "quantization": "none"}  # dense: batch-independent
    expected = offline_texts(LLM(str(model_path), **engine), prompts)
    flags = ["--served-model-name", "m", *to_flags({**engine, "pipeline_parallel_size": 2})]
    group = NodeGroup(str(model_path), flags, nnodes=2, log_dir=tmp_path, env=ENV)
    try:
        group.start(workers_first=True)  # node 0 comes up after node 1, which waits for it
        assert completion_texts(group.url, prompts) == expected
        group.workers[0].kill()
        t0 = time.monotonic()
        try:  # the step fails at once (gloo: connection closed) and is mapped to the silent rank
            r = httpx.post(f"{group.url}/v1/completions", timeout=30,
                           json={"model": "m", "prompt": "hi", "max_tokens": 4})
            assert r.status_code >= 500, r.text
        except httpx.TransportError:  # node 0 already exited
            pass
        assert time.monotonic() - t0 < 15
        while health_code(group.url) == 200:
            assert time.monotonic() - t0 < 15, "node 0's /health still 200"
            time.sleep(0.2)
        assert group.node0_exit_code(30) == EXIT_ENGINE_DIED
        failure = parse_failure(group.server.log())
        assert "rank 1 on node 1" in failure["message"], failure
    finally:
        group.stop()


def test_tensor_parallel_over_two_nodes_matches_one_process_and_a_lost_driver_ends_node_1(tmp_path):
    model = save_tiny_llama(tmp_path / "tiny", num_layers=2)
    prompts = ["w3 w4 w5 w6", "w10 w11"]
    expected = offline_texts(tiny_llm(model), prompts)
    flags = ["--served-model-name", "m", *to_flags({
        "dtype": "float32", "device": "cpu", "tensor_parallel_size": 2, "block_size": 16,
        "num_gpu_blocks_override": 32, "max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 24,
        "swap_space": 0})]
    group = NodeGroup(str(model), flags, nnodes=2, log_dir=tmp_path, env=ENV)
    try:
        group.start(workers_first=False)  # node 1 comes up 2 s after node 0, which waits for it
        assert completion_texts(group.url, prompts) == expected
        time.sleep(1.5)  # idle: no collective is running when node 0 goes
        group.server.proc.kill()
        node1 = group.workers[0]
        assert node1.wait(15) == EXIT_ENGINE_DIED
        log = node1.log()
        assert "rank 1 on node 1" in log and "lost the driver (rank 0 on node 0" in log, log[-2000:]
        assert parse_failure(log)["kind"] == "engine_died"
    finally:
        group.stop()


@pytest.mark.parametrize("argv, says", [
    (["--nnodes", "3", "-pp", "2"], "nnodes 3 must divide tensor_parallel_size x pipeline_parallel_size = "
                                    "1 x 2 = 2 (every node runs as many ranks); use --nnodes 1 or 2"),
    (["--nnodes", "2", "-pp", "2", "--node-rank", "2"], "node_rank 2 must be in [0, nnodes) = [0, 2)"),
    (["--nnodes", "2", "-pp", "2", "--node-rank", "-1"], "node_rank must be >= 0"),
    (["--nnodes", "2", "-pp", "2", "--headless"], "drop --headless here, or give this node --node-rank 1"),
], ids=["nnodes-does-not-divide", "node-rank-too-high", "node-rank-negative", "headless-node-0"])
def test_bad_multinode_flags_exit_2_saying_what_to_change(argv, says, capsys):
    try:
        code = serve.main(["smollm2-135m-instruct", "--device", "cpu", *argv])
    except SystemExit as exc:  # argparse's parser.error
        code = exc.code
    assert code == EXIT_BAD_ARGS
    assert says in capsys.readouterr().err


def test_the_headless_node_exits_0_when_node_0_shuts_down(tmp_path):
    """SIGTERM on node 0 drains and stops every rank: node 1 gets the driver's shutdown."""
    model = save_tiny_llama(tmp_path / "tiny", num_layers=2)
    flags = to_flags({"dtype": "float32", "device": "cpu", "pipeline_parallel_size": 2,
                      "num_gpu_blocks_override": 16, "max_model_len": 64, "swap_space": 0})
    group = NodeGroup(str(model), flags, nnodes=2, log_dir=tmp_path, env=ENV)
    try:
        group.start()
        assert group.server.stop() == 0
        assert group.workers[0].wait(20) == 0, group.workers[0].log()[-2000:]
    except subprocess.TimeoutExpired:
        pytest.fail("node 1 did not exit after node 0's shutdown")
    finally:
        group.stop()


def test_more_ranks_per_node_than_visible_gpus_is_refused(monkeypatch, model_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = EngineArgs(str(model_path), device="cuda", dtype="float32", pipeline_parallel_size=2, nnodes=1)
    with pytest.raises(ValueError, match=r"each node runs .* = 2 ranks, one GPU each, but this node sees 1 GPU"):
        args.create_engine_config()
    args.nnodes = 2  # one rank per node: fits
    assert args.create_engine_config().parallel.ranks_per_node == 1


def _lonely_node(tmp_path, rendezvous_timeout_s: str) -> HeadlessNode:
    """Node 1 of a PP2 engine whose node 0 never comes."""
    return HeadlessNode([*KVPILOT_SERVE, "smollm2-135m-instruct", *to_flags({"pipeline_parallel_size": 2}),
                         *node_flags(2, 1, free_port())], tmp_path / "node1.log",
                        {**ENV, "KVPILOT_RENDEZVOUS_TIMEOUT_S": rendezvous_timeout_s})


def test_sigterm_ends_a_waiting_headless_node_with_0(tmp_path):
    node = _lonely_node(tmp_path, "120")
    deadline = time.monotonic() + 60
    while "joining the driver" not in node.log():  # the rank waits in torch's connect, off the main thread
        assert time.monotonic() < deadline and node.proc.poll() is None, node.log()[-2000:]
        time.sleep(0.2)
    node.kill(signal.SIGTERM)
    assert node.wait(10) == 0


def test_a_headless_node_without_node_0_exits_1_saying_where_it_looked(tmp_path):
    node = _lonely_node(tmp_path, "2")
    assert node.wait(60) == 1
    failure = parse_failure(node.log())
    assert failure["kind"] == "failed"
    assert "rank 1 on node 1 could not reach node 0's rendezvous store at 127.0.0.1:" in failure["message"]
