"""The rendezvous and the heartbeats of a multi-node engine (engine/distributed/rendezvous.py), in one
process over a real TCPStore: ranks join whatever their order, the driver names the ranks
that never came and refuses a rank claimed twice, a silent rank is declared dead, and a rank
whose driver is gone hears of it."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvpilot.engine.config import ParallelConfig
from kvpilot.engine.distributed.rendezvous import Heartbeat, PeerMonitor, Rendezvous


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def nodes(monkeypatch):
    """ParallelConfig of node r of a PP2 engine over 2 nodes on a free port, short timeouts."""
    monkeypatch.setenv("KVPILOT_RENDEZVOUS_TIMEOUT_S", "20")
    monkeypatch.setenv("KVPILOT_NODE_TIMEOUT_S", "1.5")
    port = _free_port()
    return lambda r: ParallelConfig(1, 2, nnodes=2, node_rank=r, master_port=port)


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except Exception as exc:  # handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_a_rank_that_comes_first_waits_for_the_driver_and_a_silent_rank_is_declared_dead(nodes):
    worker, joined = _in_thread(lambda: Rendezvous(nodes(1), 1).join())  # node 1 before node 0
    time.sleep(0.5)
    driver_store = Rendezvous(nodes(0), 0).join()
    worker.join(10)
    assert "value" in joined, joined
    lost: list[str] = []
    beat = Heartbeat(nodes(1), 1, lost.append)
    beat.start()
    dead: list[RuntimeError] = []
    monitor = PeerMonitor(nodes(0), dead.append)
    monitor.start()
    time.sleep(2.5)
    assert dead == [] and lost == []  # beating: alive
    beat.stop()
    t0 = time.monotonic()
    monitor.join(5)
    assert len(dead) == 1 and time.monotonic() - t0 < 4
    assert "rank 1 on node 1" in str(dead[0]) and "sent no heartbeat for" in str(dead[0])
    assert lost == []  # a stopped heartbeat reports nothing
    del driver_store


def test_the_driver_names_the_nodes_that_never_joined(nodes, monkeypatch):
    monkeypatch.setenv("KVPILOT_RENDEZVOUS_TIMEOUT_S", "1")
    with pytest.raises(RuntimeError, match=r"nodes \[1\] \(ranks \[1\]\) did not join node 0's rendezvous"):
        Rendezvous(nodes(0), 0).join()


def test_two_nodes_with_one_rank_stop_the_rendezvous_with_the_reason(nodes):
    port = nodes(0).master_port
    three = lambda r: ParallelConfig(1, 3, nnodes=3, node_rank=r, master_port=port)  # noqa: E731
    driver, driver_result = _in_thread(lambda: Rendezvous(three(0), 0).join())
    time.sleep(0.3)
    first, first_result = _in_thread(lambda: Rendezvous(three(1), 1).join())
    time.sleep(0.3)  # node 2 never comes: the rendezvous is still open
    with pytest.raises(RuntimeError, match="rank 1 on node 1 joined twice: two nodes run --node-rank 1"):
        Rendezvous(three(1), 1).join()
    driver.join(10)
    first.join(10)
    assert "joined twice" in str(driver_result["error"])
    assert "node 0 stopped the rendezvous: rank 1 on node 1 joined twice" in str(first_result["error"])


def test_a_node_restarted_into_a_running_engine_is_refused_without_stopping_it(nodes):
    worker, _ = _in_thread(lambda: Rendezvous(nodes(1), 1).join())
    store = Rendezvous(nodes(0), 0).join()
    worker.join(10)
    with pytest.raises(RuntimeError, match="came to an engine that already runs with that rank"):
        Rendezvous(nodes(1), 1).join()
    assert not store.check(["kvpilot/abort"])  # the running engine's ranks are not told to stop


def test_a_rank_hears_that_its_driver_is_gone(nodes):
    worker, _ = _in_thread(lambda: Rendezvous(nodes(1), 1).join())
    driver = Rendezvous(nodes(0), 0)
    driver.join()
    worker.join(10)
    lost: list[str] = []
    beat = Heartbeat(nodes(1), 1, lost.append)
    beat.start()
    time.sleep(1.2)
    driver.store = None  # the driver's process goes: its store's server with it
    import gc

    gc.collect()
    beat.join(10)
    assert len(lost) == 1 and "lost the driver (rank 0 on node 0" in lost[0], lost
