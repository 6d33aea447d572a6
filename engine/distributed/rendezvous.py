"""How the ranks of one engine find each other and notice when one is gone, on one node or
over several (vLLM's multi-node launch without Ray: `vllm serve --nnodes N --node-rank R
--master-addr A --master-port P`).

Rendezvous: the driver (global rank 0, node 0) hosts a torch.distributed `TCPStore` on
master_port, listening on all interfaces; every other rank connects to master_addr:master_port,
retrying until the rendezvous deadline (pods start in any order, node 0 may come last),
claims its rank and writes who it is. The driver waits until every rank has joined, then
says go; past the deadline it writes the reason (the nodes and ranks that never joined)
under the abort key, where the waiting ranks read it, and raises. The process groups
(gloo, NCCL) are then built over the same store.

    node 0: driver ── TCPStore :P ◄── join/claim ── node 1: ranks k..2k-1
                        ▲   ▲ heartbeats (every 1 s) ─┘
                        └───┴── PeerMonitor (driver): no beat for KVPILOT_NODE_TIMEOUT_S -> dead

Liveness: gloo raises at once when a peer's process dies (its connections close), but only in
a collective, and the driver's control group sends nothing while the server is idle; a node
that vanishes (power, network) closes nothing at all. So each non-driver rank beats through
its own connection to the store, and the driver's `PeerMonitor` declares a rank dead when
its count has not moved for the node timeout. The store lives in the driver's process, so
the same beat tells a rank that the driver is gone (the connection fails): it exits
non-zero with the reason instead of waiting for a command that never comes. A side TCP
channel of our own would do the same with more code; the store is already there, and is
what torchrun's elastic agent uses for its own heartbeats.

Environment: KVPILOT_RENDEZVOUS_TIMEOUT_S (default 600), KVPILOT_NODE_TIMEOUT_S (default 5).
Sources: vLLM `vllm/v1/executor/multiproc_executor.py` (nnodes, node_rank, master_addr),
torch `torch.distributed.TCPStore` and torchrun's c10d rendezvous.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from kvpilot.engine.config import ParallelConfig
from kvpilot.engine.settings.env import KVPILOT_NODE_TIMEOUT_S, KVPILOT_RENDEZVOUS_TIMEOUT_S

logger = logging.getLogger("kvpilot.engine.distributed.rendezvous")

RENDEZVOUS_TIMEOUT_ENV = KVPILOT_RENDEZVOUS_TIMEOUT_S
NODE_TIMEOUT_ENV = KVPILOT_NODE_TIMEOUT_S
HEARTBEAT_INTERVAL_S = 1.0
ABORT_KEY = "kvpilot/abort"
GO_KEY = "kvpilot/go"


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"${name} must be > 0, got {text!r}")
    return value


def rendezvous_timeout_s() -> float:
    """How long every rank waits for the others to join (KVPILOT_RENDEZVOUS_TIMEOUT_S, 600)."""
    return _env_seconds(RENDEZVOUS_TIMEOUT_ENV, 600.0)


def node_timeout_s() -> float:
    """A rank whose heartbeat has not moved this long is gone (KVPILOT_NODE_TIMEOUT_S, 5)."""
    return _env_seconds(NODE_TIMEOUT_ENV, 5.0)


def describe_rank(parallel: ParallelConfig, rank: int) -> str:
    """'rank 1 on node 1' (the node only when there are several)."""
    return f"rank {rank}" + (f" on node {parallel.node_of(rank)}" if parallel.nnodes > 1 else "")


def _client(parallel: ParallelConfig, timeout_s: float) -> dist.TCPStore:
    """A connection of this process to the driver's store; torch retries the connect (refused,
    not resolvable yet) until timeout_s, then raises DistNetworkError."""
    return dist.TCPStore(parallel.master_addr, parallel.master_port, is_master=False,
                         timeout=timedelta(seconds=timeout_s))


class Rendezvous:
    """This rank's seat in the store. `join()` returns once every rank has joined (raises
    RuntimeError naming who did not within the deadline); `store` then builds the process
    groups."""

    def __init__(self, parallel: ParallelConfig, rank: int) -> None:
        self.parallel = parallel
        self.rank = rank
        self.timeout_s = rendezvous_timeout_s()
        self.store: dist.TCPStore | None = None

    @property
    def address(self) -> str:
        """master_addr:master_port, the driver's store as the other ranks reach it."""
        return f"{self.parallel.master_addr}:{self.parallel.master_port}"

    def join(self) -> dist.TCPStore:
        """Meets the other ranks: the driver (rank 0) hosts the TCPStore and waits for every rank
        to claim its seat, then writes go; any other rank connects (retrying) and waits for go.
        Returns the store. Raises RuntimeError when the store cannot be reached, a rank is
        claimed twice, or not every rank joined within KVPILOT_RENDEZVOUS_TIMEOUT_S."""
        deadline = time.monotonic() + self.timeout_s
        if self.rank == 0:
            self.store = dist.TCPStore("127.0.0.1", self.parallel.master_port, is_master=True,
                                       timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        else:
            logger.info("%s: joining the driver at %s (waiting up to %.0f s, %s)",
                        describe_rank(self.parallel, self.rank), self.address, self.timeout_s, RENDEZVOUS_TIMEOUT_ENV)
            try:
                self.store = _client(self.parallel, self.timeout_s)
            except Exception as exc:
                raise RuntimeError(
                    f"{describe_rank(self.parallel, self.rank)} could not reach node 0's rendezvous store at "
                    f"{self.address} within {self.timeout_s:.0f} s ({RENDEZVOUS_TIMEOUT_ENV}): is node 0 running "
                    f"with --master-port {self.parallel.master_port}, and --master-addr right? "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
        self._claim()
        if self.rank == 0:
            self._wait_for_everyone(deadline)
        else:
            self._wait_for_go(deadline)
        self.store.set_timeout(timedelta(seconds=max(60.0, self.timeout_s)))
        return self.store

    def _claim(self) -> None:
        """Takes this rank's seat; a second claimant stops the rendezvous (two nodes with one
        --node-rank), or, once the engine runs, leaves alone (a node restarted before node 0
        noticed the old one gone: node 0 exits within the node timeout, then all restart)."""
        if self.store.add(f"kvpilot/claim/{self.rank}", 1) > 1:
            who = describe_rank(self.parallel, self.rank)
            if self.store.check([GO_KEY]):
                raise RuntimeError(f"{who} came to an engine that already runs with that rank: node 0 at "
                                   f"{self.address} stops within {NODE_TIMEOUT_ENV} of losing the old one; start "
                                   "this node again then")
            message = (f"{who} joined twice: two nodes run --node-rank {self.parallel.node_rank}; give each node its "
                       f"own rank in [0, {self.parallel.nnodes})")
            self.store.set(ABORT_KEY, message)
            raise RuntimeError(message)
        me = {"node": self.parallel.node_of(self.rank), "host": socket.gethostname(), "pid": os.getpid()}
        self.store.set(f"kvpilot/join/{self.rank}", json.dumps(me))

    def _wait_for_everyone(self, deadline: float) -> None:
        world = self.parallel.world_size
        keys = [f"kvpilot/join/{r}" for r in range(world)]
        logged = 0.0
        while not self.store.check(keys):
            if self.store.check([ABORT_KEY]):
                raise RuntimeError(self.store.get(ABORT_KEY).decode())
            missing = [r for r in range(world) if not self.store.check([keys[r]])]
            if time.monotonic() >= deadline:
                nodes = sorted({self.parallel.node_of(r) for r in missing})
                message = (f"nodes {nodes} (ranks {missing}) did not join node 0's rendezvous at {self.address} "
                           f"within {self.timeout_s:.0f} s ({RENDEZVOUS_TIMEOUT_ENV}): start them with --nnodes "
                           f"{self.parallel.nnodes} --node-rank <n> --master-addr <this node> --master-port "
                           f"{self.parallel.master_port}")
                self.store.set(ABORT_KEY, message)
                raise RuntimeError(message)
            if time.monotonic() - logged > 10.0:
                logger.info("waiting for ranks %s (nodes %s) to join at %s", missing,
                            sorted({self.parallel.node_of(r) for r in missing}), self.address)
                logged = time.monotonic()
            time.sleep(0.1)
        self.store.set(GO_KEY, "1")
        logger.info("all %d ranks on %d node(s) joined at %s", world, self.parallel.nnodes, self.address)

    def _wait_for_go(self, deadline: float) -> None:
        while not self.store.check([GO_KEY]):
            if self.store.check([ABORT_KEY]):
                raise RuntimeError(f"node 0 stopped the rendezvous: {self.store.get(ABORT_KEY).decode()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{describe_rank(self.parallel, self.rank)}: the other ranks did not all join "
                                   f"within {self.timeout_s:.0f} s ({RENDEZVOUS_TIMEOUT_ENV})")
            time.sleep(0.1)


def announce_abort(parallel: ParallelConfig, reason: str) -> None:
    """The driver's last word: `reason` under the abort key, which every rank's heartbeat
    reads (a no-op when the store is unreachable)."""
    try:
        _client(parallel, 2.0).set(ABORT_KEY, reason)
    except Exception:  # no store (the rendezvous never started), or it is gone
        pass


def abort_reason(parallel: ParallelConfig) -> str | None:
    """What the driver wrote under the abort key before it stopped (None: nothing, or the
    store is gone with it)."""
    try:
        store = _client(parallel, 2.0)
        return store.get(ABORT_KEY).decode() if store.check([ABORT_KEY]) else None
    except Exception:  # the driver's process, and its store, are gone
        return None


class Heartbeat(threading.Thread):
    """A non-driver rank's beat: adds 1 to its counter in the driver's store every
    HEARTBEAT_INTERVAL_S over a connection of its own. When the store cannot be reached (the
    driver's process is gone) or the driver wrote an abort reason, calls on_lost(reason) once
    (which should end the process). `stop()` ends it quietly (the driver's shutdown)."""

    def __init__(self, parallel: ParallelConfig, rank: int, on_lost: Callable[[str], None]) -> None:
        super().__init__(name=f"kvpilot-heartbeat-{rank}", daemon=True)
        self.parallel, self.rank, self.on_lost = parallel, rank, on_lost
        self.key = f"kvpilot/heartbeat/{rank}"
        self._store = _client(parallel, node_timeout_s())
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Ends the beat quietly at its next tick (on_lost is not called)."""
        self._stopped.set()

    def run(self) -> None:
        """Thread body: beats every HEARTBEAT_INTERVAL_S until stopped, or until the store fails or
        holds an abort reason; then calls on_lost(reason) once and returns."""
        while not self._stopped.is_set():
            try:
                self._store.add(self.key, 1)
                aborted = self._store.check([ABORT_KEY])
                reason = self._store.get(ABORT_KEY).decode() if aborted else None
            except Exception as exc:
                reason = (f"lost the driver (rank 0 on node 0, store at {self.parallel.master_addr}:"
                          f"{self.parallel.master_port}): {type(exc).__name__}: {str(exc).splitlines()[0]}")
            else:
                if reason is not None:
                    reason = f"the driver stopped the engine: {reason}"
            if reason is not None and not self._stopped.is_set():
                self.on_lost(reason)
                return
            self._stopped.wait(HEARTBEAT_INTERVAL_S)


class PeerMonitor(threading.Thread):
    """The driver's watch over ranks 1..world-1: a rank whose heartbeat count has not moved
    for node_timeout_s is dead; on_dead(RuntimeError naming it) is called once, from this
    thread. `stop()` ends the watch (a clean shutdown)."""

    def __init__(self, parallel: ParallelConfig, on_dead: Callable[[RuntimeError], None]) -> None:
        super().__init__(name="kvpilot-peer-monitor", daemon=True)
        self.parallel, self.on_dead = parallel, on_dead
        self.timeout_s = node_timeout_s()
        self._stopped = threading.Event()
        self._store = _client(parallel, 10.0)

    def stop(self) -> None:
        """Ends the watch at its next check (on_dead is not called)."""
        self._stopped.set()

    def run(self) -> None:
        """Thread body: watches the heartbeats until stopped; calls on_dead once for the first
        silent rank, or when the store itself stops answering."""
        try:
            self._watch()
        except Exception as exc:  # the store itself broke: no rank can be vouched for
            if not self._stopped.is_set():
                self.on_dead(RuntimeError(f"the rendezvous store stopped answering ({type(exc).__name__}: {exc}); "
                                          "the engine cannot tell whether its ranks live"))

    def _watch(self) -> None:
        ranks = range(1, self.parallel.world_size)
        seen = {r: (-1, time.monotonic()) for r in ranks}
        while not self._stopped.wait(HEARTBEAT_INTERVAL_S / 2):
            now = time.monotonic()
            for rank in ranks:
                count = self._store.add(f"kvpilot/heartbeat/{rank}", 0)
                if count != seen[rank][0]:
                    seen[rank] = (count, now)
                elif now - seen[rank][1] > self.timeout_s and not self._stopped.is_set():
                    self.on_dead(self._dead(rank, now - seen[rank][1]))
                    return

    def _dead(self, rank: int, silent_s: float) -> RuntimeError:
        who = json.loads(self._store.get(f"kvpilot/join/{rank}"))
        return RuntimeError(
            f"{describe_rank(self.parallel, rank)} (host {who['host']}, pid {who['pid']}) sent no heartbeat for "
            f"{silent_s:.1f} s ({NODE_TIMEOUT_ENV} {self.timeout_s:g}): its process or node is gone; the engine "
            "cannot continue")
