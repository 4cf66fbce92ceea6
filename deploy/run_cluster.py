"""`python -m deploy.run_cluster CONFIG [serve run options]`: `serve run CONFIG`, as
scripts/run_cluster.sh starts the cluster, with what Serve's CLI does not do: it refuses
cluster args that build_app would refuse (Serve retries a failing build, and `serve run`
stays up printing tracebacks) and ports another cluster holds, and it stops on SIGTERM as
on Ctrl-C.

Ports: Serve's proxies bind with SO_REUSEPORT (`SERVE_SOCKET_REUSE_PORT_ENABLED`, on by
default), so a second `serve run` on a host where a cluster already serves starts without
a word and the kernel spreads connections over both: two clusters with their own
registries (each its own local Redis), so requests for an adapter registered on one get
404 from the other about half the time. A bind without SO_REUSEPORT, as here, fails while
any proxy holds the port, so the start is refused first. (Turning SO_REUSEPORT off for the
proxies would make a plain `serve run` fail to bind instead, but it also drops their
SO_REUSEADDR: a cluster restarted within a minute of a stop would fail on the connections
it left in TIME_WAIT.)

Stopping: `serve run` shuts Serve down gracefully only on Ctrl-C (KeyboardInterrupt):
replicas finish their requests and remove their registry rows. A SIGTERM killed it at
once, cutting requests off and leaving the replicas' rows (and residency) in a Redis that
outlives the cluster. So `serve run` runs in a session of its own and every SIGINT,
SIGTERM or SIGHUP this process gets reaches it as one SIGINT (a second one cuts the
graceful shutdown short, as a second Ctrl-C does), but for one it was started ignoring
(nohup's SIGHUP, a background job's SIGINT).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import yaml

# Serve's defaults (ray.serve.config.HTTPOptions / gRPCOptions); the gRPC proxy binds
# [::] (every address, both families), and starts only with servicer functions.
HTTP_HOST, HTTP_PORT, GRPC_PORT = "127.0.0.1", 8000, 9000
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BUILD_APP = "deploy.builder:build_app"


def port_taken(host: str, port: int) -> bool:
    """Whether a listener holds host:port (a plain bind fails). SO_REUSEADDR, as the
    proxies and redis-server bind, so connections of a cluster stopped a moment ago
    (TIME_WAIT, ~60 s) do not count (`deploy.local_redis` checks a fixed redis_port so)."""
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
        f"port {port} ({field}) is in use on {f'[{host}]' if ':' in host else host}: a cluster "
        f"(another `serve run`) or another server holds it; allowed: stop it first, or set "
        f"another {field}"
        for field, host, port in ports(config)
        if port_taken(host, port)
    ]


def bad_args(config: dict) -> list[str]:
    """What `deploy.cluster_args.parse_args` refuses in the args of the config's lorafleet
    apps: build_app would refuse the same, but Serve retries a failing build and `serve
    run` stays up, printing the refusal among tracebacks."""
    from deploy.cluster_args import parse_args  # the registry client: imported when needed
    from lora_core.errors import InvalidRequest

    problems = []
    for app in config.get("applications") or []:
        if app.get("import_path") == BUILD_APP:
            try:
                parse_args(app.get("args") or {})
            except InvalidRequest as e:
                problems.append(f"application {app.get('name', '')!r}: {e}")
    return problems


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def serve_run(args: list[str]) -> int:
    """Run `serve run ARGS` until it exits, passing each signal of FORWARDED on as SIGINT
    -> its exit status (128 + the signal's number when a signal ended it)."""
    child: subprocess.Popen | None = None
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if child is None:
            pending.append(signum)  # not started yet: sent once it is
        else:
            child.send_signal(signal.SIGINT)

    for signum in FORWARDED:
        # one ignored stays so: nohup's SIGHUP, a background job's SIGINT
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, forward)
    # a session of its own: a terminal's Ctrl-C reaches it once, through forward; and
    # SIGINT at its default, so that what is forwarded is a KeyboardInterrupt in it
    child = subprocess.Popen(
        ["serve", "run", *args], start_new_session=True, preexec_fn=_default_sigint
    )
    for _ in pending:
        child.send_signal(signal.SIGINT)
    code = child.wait()
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(
            "usage: python -m deploy.run_cluster CONFIG.yaml [serve run options]", file=sys.stderr
        )
        return 2
    config = yaml.safe_load(Path(argv[0]).read_text()) or {}
    problems = bad_args(config) + taken_ports(config)
    for problem in problems:
        print(f"lorafleet: error: {problem}", file=sys.stderr)
    if problems:
        return 1
    return serve_run(argv)


if __name__ == "__main__":
    sys.exit(main())
