"""gRPC client errors leave no traceback in the ingress's and the proxy's Serve logs (one
INFO line each, as REST answers them with only an access-log line); a server error still
logs its traceback. Reads the live cluster's log files under the Ray session."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from router.proto import lorafleet_pb2 as pb
from router.proto import lorafleet_pb2_grpc as pb_grpc
from tests.integration.serve.cluster_fixture import start_cluster, stop_cluster
from tests.polling import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # a KV cache smaller than max_model_len (1024), so only the replica finds that a
    # request cannot fit (InvalidRequest raised in the replica, not the ingress)
    cluster = start_cluster(
        tmp_path_factory.mktemp("grpc-logs"), num_replicas=1, kv_cache_tokens=512
    )
    yield cluster
    stop_cluster(cluster)


class ServeLogs:
    """The text the Ingress's, the LoraReplica's and the proxy's log files gained since
    `mark`."""

    def __init__(self):
        session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
        self.dir = session / "logs" / "serve"
        self.marks: dict[Path, int] = {}

    def files(self) -> list[Path]:
        ingress = sorted(self.dir.glob("replica_*Ingress*.log"))
        replicas = sorted(self.dir.glob("replica_*LoraReplica*.log"))
        proxies = sorted(self.dir.glob("proxy_*.log"))
        assert ingress and replicas and proxies, sorted(p.name for p in self.dir.iterdir())
        return ingress + replicas + proxies

    def mark(self) -> None:
        self.marks = {p: p.stat().st_size for p in self.files()}

    def new(self, name_part: str) -> str:
        return "".join(
            p.read_bytes()[self.marks.get(p, 0) :].decode(errors="replace")
            for p in self.files()
            if name_part in p.name
        )


def errors(log: str) -> list[str]:
    """The log's ERROR records (the access log's "CALL ... ERROR" lines are INFO)."""
    return [line for line in log.splitlines() if line.startswith("ERROR")]


def refused(cluster, request: pb.GenerateRequest, key: str) -> grpc.StatusCode:
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, metadata=(("authorization", key),), timeout=120))
    return e.value.code()


def wait_for_text(logs: ServeLogs, name_part: str, text: str, timeout_s: float = 20.0) -> str:
    """The name_part log since the mark, once it holds text; on a timeout, the error
    carries that log (what was written instead)."""
    try:
        return wait_for(
            lambda: text in (got := logs.new(name_part)) and got,
            timeout_s,
            f"{text!r} reaching the {name_part} log",
            interval_s=0.2,
        )
    except TimeoutError as e:
        raise TimeoutError(f"{e}; that log since the mark: {logs.new(name_part)}") from None


def overflowing_adapter(cluster, root: Path) -> str:
    """extra-1 with every weight a huge finite number: registration takes it (no NaN or
    inf), and the first forward pass overflows, so the replica fails the request with a
    500-type error (NonFiniteLogits)."""
    src = cluster.adapters["extra-1"]
    shutil.copytree(src, root)
    weights = load_file(str(src / "adapter_model.safetensors"))
    big = {k: torch.full_like(v, torch.finfo(v.dtype).max / 4) for k, v in weights.items()}
    save_file(big, str(root / "adapter_model.safetensors"))
    return str(root)


def test_client_errors_log_no_traceback_and_server_errors_do(cluster, tmp_path):
    logs = ServeLogs()
    logs.mark()
    ops = f"Bearer {cluster.keys['ops']}"
    assert refused(cluster, pb.GenerateRequest(model="no-such", prompt="hi"), ops) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert refused(cluster, pb.GenerateRequest(model="demo-poet", prompt=""), ops) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert refused(cluster, pb.GenerateRequest(model="demo-poet", prompt="hi"), "Token x") == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    too_big = pb.GenerateRequest(model="demo-poet", prompt="hi", max_tokens=600)
    assert refused(cluster, too_big, ops) == grpc.StatusCode.INVALID_ARGUMENT
    replica = wait_for_text(logs, "LoraReplica", "does not fit")
    assert "Request refused (INVALID_ARGUMENT, HTTP 400, InvalidRequest): max_tokens:" in replica
    ingress = wait_for_text(logs, "Ingress", "unsupported Authorization scheme 'Token'")
    assert "Request refused (NOT_FOUND, HTTP 404, AdapterNotFound): adapter 'no-such'" in ingress
    assert "Request refused (INVALID_ARGUMENT, HTTP 400, InvalidRequest): prompt: empty" in (
        ingress
    )
    proxy = wait_for_text(logs, "proxy", "unsupported Authorization scheme 'Token'")
    for text in (ingress, replica, proxy):
        assert "Traceback" not in text and not errors(text), text

    reg = cluster.registry()
    reg.register_adapter("overflow", overflowing_adapter(cluster, tmp_path / "o"), public=True)
    reg.close()
    logs.mark()
    bad = pb.GenerateRequest(model="overflow", prompt="hi", max_tokens=2)
    assert refused(cluster, bad, ops) == grpc.StatusCode.INTERNAL
    ingress = wait_for_text(logs, "Ingress", "NonFiniteLogits")
    assert "Traceback" in ingress and errors(ingress), ingress
    assert "Traceback" in wait_for_text(logs, "proxy", "Traceback")
