"""`kvpilot operator`: runs the Kopf operator with kvpilot's settings, and with `--tuner` the
tuner's daemon in the same Kopf process. This module is the one place that loads both
packages: `kvpilot.operator` and `kvpilot.tuner` import neither each other (they share
`kvpilot.api`), so the operator runs without the tuner and the tuner without the operator.

    kvpilot operator --namespace default          # watch one namespace (repeatable)
    kvpilot operator --all-namespaces             # cluster-wide
    kvpilot operator --liveness http://0.0.0.0:8080/healthz --peering kvpilot
    kvpilot operator --tuner --metrics-port 9090  # and tune; the tuner's metrics at :9090/metrics
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpilot operator",
                                     description="Run the InferenceService operator (Kopf).")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="namespace to watch; repeat for more (default: KVPILOT_NAMESPACES or all)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--liveness", default=os.environ.get("KVPILOT_LIVENESS", ""),
                        help="serve Kopf's liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--peering", default="",
                        help="take part in Kopf peering under this name (default: standalone)")
    parser.add_argument("--resync-seconds", type=float, default=None,
                        help="interval of the drift-repair timer (default 30, or KVPILOT_RESYNC_SECONDS)")
    parser.add_argument("--tuner", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("KVPILOT_TUNER", "") == "1",
                        help="also run the SLO tuner daemon for resources with spec.tuning.enabled "
                             "(default: off, or KVPILOT_TUNER=1)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve kvpilot_slo_* (every resource's spec.slo) and kvpilot_tuning_* at "
                             ":PORT/metrics (default: off, or KVPILOT_METRICS_PORT)")
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
    return args.metrics_port if args.metrics_port is not None else env_port(parser, "KVPILOT_METRICS_PORT")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.metrics_port = metrics_port(parser, args)
    if args.resync_seconds is not None:
        if args.resync_seconds <= 0:
            build_parser().error("--resync-seconds must be > 0")
        os.environ["KVPILOT_RESYNC_SECONDS"] = str(args.resync_seconds)
    namespaces = args.namespace or [n for n in os.environ.get("KVPILOT_NAMESPACES", "").split(",") if n]
    clusterwide = args.all_namespaces or not namespaces

    import kopf

    from kvpilot.operator import handlers  # noqa: F401  (registers the handlers; reads the resync interval)

    if args.tuner:
        from kvpilot.tuner import daemon  # noqa: F401  (registers the tuner daemon)
    if args.metrics_port:  # issue 14: the dashboard's SLO lines and tuning panels
        from kvpilot.api import tuning_metrics
        from kvpilot.tuner import slo_metrics  # noqa: F401  (registers the spec.slo exporter)
        tuning_metrics.serve(args.metrics_port)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    asyncio.run(kopf.operator(
        clusterwide=clusterwide,
        namespaces=[] if clusterwide else namespaces,
        standalone=not args.peering,
        peering_name=args.peering or None,
        liveness_endpoint=args.liveness or None,
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
