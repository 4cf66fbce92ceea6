"""`python -m deploy.preflight CONFIG`: refuse to start a cluster whose HTTP or gRPC port is
already taken on this host (scripts/run_cluster.sh runs it before `serve run`).

Serve's proxies bind their ports with SO_REUSEPORT (`SERVE_SOCKET_REUSE_PORT_ENABLED`, on
by default), so a second `serve run` on a host where a cluster already serves starts
without a word and the kernel spreads connections over both: two clusters with their own
registries (each its own local Redis), so requests for an adapter registered on one get
404 from the other about half the time. A bind without SO_REUSEPORT, as here, fails while
any proxy holds the port. (Turning SO_REUSEPORT off for the proxies would make a plain
`serve run` fail to bind instead, but it also drops their SO_REUSEADDR: a cluster restarted
within a minute of a stop would fail on the connections it left in TIME_WAIT.)
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import yaml

# Serve's defaults (ray.serve.config.HTTPOptions / gRPCOptions); the gRPC proxy binds
# [::] (every address, both families), and starts only with servicer functions.
HTTP_HOST, HTTP_PORT, GRPC_PORT = "127.0.0.1", 8000, 9000


def port_taken(host: str, port: int) -> bool:
    """Whether a listener holds host:port (a plain bind fails). SO_REUSEADDR, as the
    proxies bind, so connections of a cluster stopped a moment ago (TIME_WAIT) do not
    count."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def ports(config: dict) -> list[tuple[str, str, int]]:
    """(config field, host, port) of each port the config's proxies bind."""
    http = config.get("http_options") or {}
    grpc = config.get("grpc_options") or {}
    found = [("http_options.port", http.get("host", HTTP_HOST), http.get("port", HTTP_PORT))]
    if grpc.get("grpc_servicer_functions"):
        found.append(("grpc_options.port", "::" if socket.has_ipv6 else "0.0.0.0",
                      grpc.get("port", GRPC_PORT)))  # fmt: skip
    return found


def taken_ports(config: dict) -> list[str]:
    """One message per port of the config that a listener already holds."""
    return [
        f"port {port} ({field}) is in use on {f'[{host}]' if ':' in host else host}: a cluster (another `serve run`) "
        f"or another server holds it; allowed: stop it first, or set another {field}"
        for field, host, port in ports(config)
        if port_taken(host, port)
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m deploy.preflight CONFIG.yaml", file=sys.stderr)
        return 2
    config = yaml.safe_load(Path(argv[0]).read_text()) or {}
    problems = taken_ports(config)
    for problem in problems:
        print(f"lorafleet: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
