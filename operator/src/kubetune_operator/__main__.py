"""`python -m kubetune_operator`: run the operator (in its pod, or against any kubeconfig)."""
from __future__ import annotations

import argparse
import asyncio
import logging

import kopf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kubetune_operator", description=__doc__)
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only these namespaces (repeatable); default: all")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint for the Deployment's probe")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port (0: off)")
    parser.add_argument("--metrics-addr", default="0.0.0.0", help="address the metrics server binds")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kubetune_operator import handlers, sweeps  # noqa: F401  (registers the handlers)

    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_addr)

    asyncio.run(kopf.operator(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=True,  # one replica (Recreate); no peering objects needed
        liveness_endpoint=args.liveness,
    ))


if __name__ == "__main__":
    main()
