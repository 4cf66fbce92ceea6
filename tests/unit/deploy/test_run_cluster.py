"""scripts/run_cluster.sh (deploy/run_cluster.py) refuses a cluster whose ports another one
holds: Serve's proxies bind with SO_REUSEPORT, so a second cluster on a host would share
them and the kernel would split requests between two clusters with separate registries.
And it stops `serve run` on SIGTERM as Ctrl-C does, gracefully."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.run_cluster import main, ports, taken_ports

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def proxy_port():
    """A port held as Serve's proxy holds it: listening, SO_REUSEPORT on."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("0.0.0.0", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_second_proxy_would_share_the_port(proxy_port):
    # why the check exists: the bind a second cluster's proxy makes succeeds
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("0.0.0.0", proxy_port))


def test_a_port_a_proxy_holds_is_refused_naming_the_field(proxy_port):
    config = {"http_options": {"host": "0.0.0.0", "port": proxy_port}}
    assert taken_ports(config) == [
        f"port {proxy_port} (http_options.port) is in use on 0.0.0.0: a cluster (another "
        "`serve run`) or another server holds it; allowed: stop it first, or set another "
        "http_options.port"
    ]
    grpc = {"grpc_options": {"port": proxy_port, "grpc_servicer_functions": ["m.f"]}}
    (problem,) = taken_ports({"http_options": {"port": free_port()}, **grpc})
    assert problem.startswith(f"port {proxy_port} (grpc_options.port) is in use on ")


def test_free_ports_pass_and_grpc_counts_only_when_served(proxy_port):
    assert taken_ports({"http_options": {"port": free_port()}}) == []
    # Serve starts no gRPC server without servicer functions
    assert (
        taken_ports({"http_options": {"port": free_port()}, "grpc_options": {"port": proxy_port}})
        == []
    )


def test_the_cluster_config_checks_both_proxy_ports():
    config = yaml.safe_load((REPO / "deploy/cluster.yaml").read_text())
    assert [(field, port) for field, _, port in ports(config)] == [
        ("http_options.port", 8000),
        ("grpc_options.port", 9000),
    ]


def test_main_prints_one_line_per_taken_port_and_fails(proxy_port, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"host": "0.0.0.0", "port": proxy_port}}))
    assert main([str(path)]) == 1  # before serve run starts (none on PATH needed)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"lorafleet: error: port {proxy_port} ")


def test_bad_cluster_args_are_refused_before_serve_starts(tmp_path, capsys):
    app = {"name": "lorafleet", "import_path": "deploy.builder:build_app",
           "args": {"max_queued_requests": 0}}  # fmt: skip
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"port": free_port()}, "applications": [app]}))
    assert main([str(path)]) == 1
    assert capsys.readouterr().err == (
        "lorafleet: error: application 'lorafleet': cluster args: max_queued_requests: 0; "
        "allowed: -1 (unbounded) or a positive count\n"
    )


# Stands in for `serve run`: Serve's CLI shuts down gracefully on KeyboardInterrupt only.
FAKE_SERVE = """#!PYTHON
import os, sys, time
try:
    print(os.getpid(), flush=True)
    print("args", *sys.argv[1:], flush=True)
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    print("graceful shutdown", flush=True)
    sys.exit(0)
"""


def launch(tmp_path: Path, ignoring: tuple[int, ...] = ()) -> tuple[subprocess.Popen, int]:
    """The launcher on a stand-in serve (started ignoring some signals) -> (it, the
    stand-in's pid), once the stand-in runs."""
    fake = tmp_path / "bin" / "serve"
    fake.parent.mkdir()
    fake.write_text(FAKE_SERVE.replace("PYTHON", sys.executable))
    fake.chmod(0o755)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"http_options": {"port": free_port()}}))
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    launcher = subprocess.Popen(
        [sys.executable, "-m", "deploy.run_cluster", str(config), "--non-blocking"],
        env=env, stdout=subprocess.PIPE, text=True, start_new_session=True,
        # a suite started in the background (`nohup ... &`) has SIGINT / SIGHUP ignored:
        # the launcher would inherit that, so each is set as this test means it
        preexec_fn=lambda: [
            signal.signal(s, signal.SIG_IGN if s in ignoring else signal.SIG_DFL)
            for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)
        ],
    )  # fmt: skip
    fake_pid = int(launcher.stdout.readline())
    assert launcher.stdout.readline() == f"args run {config} --non-blocking\n"
    return launcher, fake_pid


def stop(launcher: subprocess.Popen, fake_pid: int, signum: int) -> tuple[int, str]:
    try:
        launcher.send_signal(signum)
        out, _ = launcher.communicate(timeout=10)
    finally:
        launcher.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(fake_pid, signal.SIGKILL)  # in a session of its own: not killed with it
    return launcher.returncode, out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_reaches_serve_run_as_ctrl_c(tmp_path, signum):
    assert stop(*launch(tmp_path), signum) == (0, "graceful shutdown\n")


def test_under_nohup_in_the_background_sighup_is_ignored_and_sigterm_stops(tmp_path):
    # `nohup bash scripts/run_cluster.sh &`: SIGHUP and SIGINT ignored from the start
    launcher, fake_pid = launch(tmp_path, ignoring=(signal.SIGHUP, signal.SIGINT))
    launcher.send_signal(signal.SIGHUP)  # the terminal closing
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.wait(timeout=0.5)
    assert stop(launcher, fake_pid, signal.SIGTERM) == (0, "graceful shutdown\n")


def test_run_cluster_sh_starts_through_the_launcher():
    script = (REPO / "scripts/run_cluster.sh").read_text()
    assert 'exec python -m deploy.run_cluster deploy/cluster.yaml "$@"' in script
    assert "exec serve run" not in script


def test_a_stopped_proxys_connections_do_not_count():
    # a cluster restarted at once: the connections its proxy closed wait in TIME_WAIT
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve binds
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server closes first: its side waits in TIME_WAIT
    client.close()
    listener.close()
    assert taken_ports({"http_options": {"host": "0.0.0.0", "port": port}}) == []
