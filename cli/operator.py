"""`kvpilot operator`: runs the Kopf operator with kvpilot's settings, and with `--tuner` the
tuner's daemon in the same Kopf process. This module is the one place that loads both
packages: `kvpilot.operator` and `kvpilot.tuner` import neither each other (they share
`kvpilot.api`), so the operator runs without the tuner and the tuner without the operator.

    kvpilot operator --namespace default          # watch one namespace (repeatable)
    kvpilot operator --all-namespaces             # cluster-wide
    kvpilot operator --liveness http://0.0.0.0:8080/healthz   # probes: /healthz, /readyz, /readyz/leader
    kvpilot operator --leader-elect               # one of N replicas reconciles (a Lease; the chart's way)
    kvpilot operator --tuner --metrics-port 9090  # and tune; operator and tuner metrics at :9090/metrics

With --leader-elect the process starts as a standby: it serves its probes and metrics and
waits for the Lease (kvpilot.operator.runtime.leader); only once it holds it does Kopf start, so a
standby runs no handler, timer or daemon. Losing the lease exits 1 at once (the kubelet
restarts the container as a standby); SIGTERM stops Kopf and hands the lease back.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
from typing import TYPE_CHECKING

from kvpilot.engine.settings.env import (
    KVPILOT_LEADER_ELECT, KVPILOT_LIVENESS, KVPILOT_METRICS_PORT, KVPILOT_NAMESPACES, KVPILOT_RESYNC_SECONDS,
    KVPILOT_TUNER,
)

if TYPE_CHECKING:
    from kvpilot.operator.runtime.leader import LeaseConfig


def build_parser() -> argparse.ArgumentParser:
    """`kvpilot operator`'s flags: scope (namespaces), probes, Kopf peering, leader election (durations
    in seconds, client-go's defaults 15/10/2), resync, tuner and metrics; defaults from KVPILOT_* env."""
    parser = argparse.ArgumentParser(prog="kvpilot operator",
                                     description="Run the InferenceService operator (Kopf).")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="namespace to watch; repeat for more (default: KVPILOT_NAMESPACES or all)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--liveness", default=os.environ.get(KVPILOT_LIVENESS, ""),
                        help="serve the probes at this URL's port: its path (liveness), /readyz and /readyz/leader, "
                             "e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--peering", default="",
                        help="take part in Kopf peering under this name (default: standalone); "
                             "--leader-elect is the chart's way to run replicas")
    election = parser.add_argument_group("leader election (a coordination.k8s.io/v1 Lease, client-go's loop)")
    election.add_argument("--leader-elect", action=argparse.BooleanOptionalAction,
                          default=os.environ.get(KVPILOT_LEADER_ELECT, "") == "1",
                          help="reconcile only while holding the Lease; identity: $POD_NAME (default: off, "
                               "or KVPILOT_LEADER_ELECT=1)")
    election.add_argument("--leader-election-lease", default="kvpilot-operator", help="the Lease's name")
    election.add_argument("--leader-election-namespace", default="",
                          help="the Lease's namespace (default: KVPILOT_OPERATOR_NAMESPACE, else the pod's)")
    election.add_argument("--leader-elect-lease-duration", type=float, default=15.0, metavar="SECONDS",
                          help="how long a standby waits after the last renewal it saw (default 15)")
    election.add_argument("--leader-elect-renew-deadline", type=float, default=10.0, metavar="SECONDS",
                          help="how long the leader tries to renew before it gives up and exits (default 10)")
    election.add_argument("--leader-elect-retry-period", type=float, default=2.0, metavar="SECONDS",
                          help="between renewals and between a standby's tries (default 2)")
    parser.add_argument("--resync-seconds", type=float, default=None,
                        help="seconds over which the drift-repair resync visits every resource once (default 300, or KVPILOT_RESYNC_SECONDS); the children's own watches repair edits at once")
    parser.add_argument("--tuner", action=argparse.BooleanOptionalAction,
                        default=os.environ.get(KVPILOT_TUNER, "") == "1",
                        help="also run the SLO tuner daemon for resources with spec.tuning.enabled "
                             "(default: off, or KVPILOT_TUNER=1)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve kvpilot_operator_* (kvpilot.operator.runtime.metrics), kvpilot_slo_* (every "
                             "resource's spec.slo) and kvpilot_tuning_* at :PORT/metrics (default: off, or "
                             "KVPILOT_METRICS_PORT)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def env_port(parser: argparse.ArgumentParser, name: str) -> int:
    """The port number in environment variable `name` (0 when unset); exit 2 naming it otherwise.
    Kubernetes sets NAME_PORT=tcp://IP:PORT in every pod for each Service of its namespace
    (docker links) unless the pod has enableServiceLinks: false, as the chart's has."""
    text = os.environ.get(name, "").strip()
    if not text:
        return 0
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        service = name.removesuffix("_PORT").lower().replace("_", "-")
        parser.error(f"{name}={text!r} is not a port number; a Service named {service!r} sets it in pods "
                     "that keep enableServiceLinks on: set the pod's enableServiceLinks: false, or pass --metrics-port")
    return int(text)


def metrics_port(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--metrics-port, else $KVPILOT_METRICS_PORT, else 0 (off)."""
    return args.metrics_port if args.metrics_port is not None else env_port(parser, KVPILOT_METRICS_PORT)


def lease_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> LeaseConfig | None:
    """The Lease this process competes for (None without --leader-elect); exit 2 on bad durations."""
    if not args.leader_elect:
        return None
    from kvpilot.operator.runtime.leader import LeaseConfig, default_identity, default_namespace

    try:
        return LeaseConfig(name=args.leader_election_lease,
                           namespace=args.leader_election_namespace or default_namespace(),
                           identity=default_identity(), lease_duration_s=args.leader_elect_lease_duration,
                           renew_deadline_s=args.leader_elect_renew_deadline,
                           retry_period_s=args.leader_elect_retry_period)
    except ValueError as e:
        parser.error(str(e))


async def operate(args: argparse.Namespace, clusterwide: bool, namespaces: list[str],
                  lease: LeaseConfig | None) -> None:
    """Probes first, then (as the leader, or at once without election) the Kopf operator."""
    import kopf

    from kvpilot.api.kube import AsyncKubeClient
    from kvpilot.operator.runtime import metrics
    from kvpilot.operator.runtime.leader import LeaderElector, lead
    from kvpilot.operator.runtime.probes import Probes

    kopf_ready = asyncio.Event()
    lease_name = lease.name if lease else ""
    kube = elector = None
    lease_executor = None
    if lease is not None:  # its own thread: renewals must not wait behind the reconciles' requests
        lease_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lease")
        kube = AsyncKubeClient.from_environment(user_agent="kvpilot-operator-leader", executor=lease_executor)
        elector = LeaderElector(kube, lease, on_change=lambda leading: metrics.set_leader(lease_name, leading))
    metrics.set_leader(lease_name, False)
    probes = Probes(elector, kopf_ready)
    if args.liveness:
        await probes.start(args.liveness)

    async def run_kopf() -> None:
        metrics.set_leader(lease_name, True)
        # lifecycle all_at_once: a resource's handlers for one change (a create: `created` and the
        # tuner's field handler) run in one reaction, one PATCH of Kopf's progress; Kopf's default
        # (asap) runs one per cycle, a PATCH and a watch round trip each (2,000 patches for 1,000
        # creates in issue 42's benchmark)
        await kopf.operator(clusterwide=clusterwide, namespaces=[] if clusterwide else namespaces,
                            standalone=not args.peering, peering_name=args.peering or None, ready_flag=kopf_ready,
                            lifecycle=kopf.lifecycles.all_at_once)
    try:
        if elector is not None:
            await lead(elector, run_kopf)
        else:
            await run_kopf()
    finally:
        await probes.stop()
        if kube is not None:
            await kube.close()
        if lease_executor is not None:
            lease_executor.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    """Parses `argv`, registers the operator's Kopf handlers (and with --tuner the tuner's daemon, with
    --metrics-port the Prometheus exporters), then runs `operate` until Kopf stops; returns 0. Bad flags
    or a bad $KVPILOT_METRICS_PORT exit 2 (argparse); losing the Lease exits 1 (runtime/leader.py)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.metrics_port = metrics_port(parser, args)
    lease = lease_config(parser, args)
    if args.resync_seconds is not None:
        if args.resync_seconds <= 0:
            build_parser().error("--resync-seconds must be > 0")
        os.environ[KVPILOT_RESYNC_SECONDS] = str(args.resync_seconds)
    namespaces = args.namespace or [n for n in os.environ.get(KVPILOT_NAMESPACES, "").split(",") if n]
    clusterwide = args.all_namespaces or not namespaces

    import kopf

    from kvpilot.operator import handlers  # noqa: F401  (registers the handlers; reads the resync interval)

    if args.tuner:
        from kvpilot.tuner.cluster import daemon  # noqa: F401  (registers the tuner daemon)
    if args.metrics_port:  # issue 14: the dashboard's SLO lines and tuning panels; issue 42: the operator's own
        from kvpilot.operator.runtime import metrics
        from kvpilot.api import tuning_metrics
        from kvpilot.tuner.cluster import slo_metrics  # noqa: F401  (registers the spec.slo exporter)
        tuning_metrics.REGISTRY.register(metrics.Collector())
        tuning_metrics.serve(args.metrics_port)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    asyncio.run(operate(args, clusterwide, namespaces, lease))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
