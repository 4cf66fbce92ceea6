"""The README's first command, checked end to end: start `bash scripts/run_cluster.sh`,
use the cluster as its users do (OpenAI client over REST, the gRPC stub, the `lorafleet`
CLI), then stop it with SIGTERM and check that nothing it started is left.

    .venv/bin/python scripts/cluster_smoke.py            # from the repository root

Prints one line per check and exits 1 if any failed. The cluster it starts is the
default one of deploy/cluster.yaml (REST :8000, gRPC :9000, a local Redis); it refuses
to start while those ports are taken. CI runs it after the test suite (.ci/run).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REST, GRPC = "http://127.0.0.1:8000", "127.0.0.1:9000"
START_S, STOP_S = 600, 60
DEMO = ("demo-poet", "demo-coder", "demo-chef")
EXPORT = re.compile(r'export LORAFLEET_REDIS_URL="\$\(cat (.+?)\)"')


class Cluster:
    """`bash scripts/run_cluster.sh` in its own process group; its output is kept."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["bash", "scripts/run_cluster.sh"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def url_file(self) -> str | None:
        for line in self.lines:
            m = EXPORT.search(line)
            if m:
                return m.group(1).strip("'")
        return None

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_ready(cluster: Cluster) -> None:
    import httpx

    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if cluster.proc.poll() is not None:
            raise RuntimeError(f"the cluster exited with {cluster.proc.returncode}")
        try:
            ids = {m["id"] for m in httpx.get(f"{REST}/v1/models", timeout=2).json()["data"]}
            if set(DEMO) <= ids:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError(f"no demo adapters in /v1/models within {START_S} s")


def checks(cluster: Cluster, tmp: Path) -> list[tuple[str, Callable[[], None]]]:
    import grpc
    import httpx
    from openai import NotFoundError, OpenAI

    from deploy.demo import write_demo_adapter
    from router.proto import lorafleet_pb2 as pb
    from router.proto import lorafleet_pb2_grpc as pb_grpc

    client = OpenAI(base_url=f"{REST}/v1", api_key="unused", max_retries=0)
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(GRPC))
    greedy = dict(max_tokens=12, temperature=0)
    env = dict(os.environ)
    cli = [str(ROOT / ".venv" / "bin" / "lorafleet")]

    def complete(model: str, prompt: str = "hello world") -> str:
        return client.completions.create(model=model, prompt=prompt, **greedy).choices[0].text

    def models() -> None:
        ids = {m.id for m in client.models.list().data}
        assert set(DEMO) <= ids, ids

    def deterministic() -> None:
        a, b = complete("demo-poet"), complete("demo-poet")
        assert a and a == b, (a, b)

    def adapters_differ() -> None:
        texts = {complete(name) for name in DEMO}
        assert len(texts) > 1, texts

    def stream_equals_whole() -> None:
        chunks = client.completions.create(
            model="demo-chef", prompt="the quick brown fox", stream=True, **greedy
        )
        assert "".join(c.choices[0].text for c in chunks) == complete(
            "demo-chef", "the quick brown fox"
        )

    def unknown_is_404() -> None:
        try:
            complete("no-such-adapter")
        except NotFoundError as e:
            assert "no-such-adapter" in str(e), e
        else:
            raise AssertionError("an unknown adapter answered")

    def bad_body_is_400() -> None:
        r = httpx.post(f"{REST}/v1/completions", json={"model": "demo-poet", "prompt": "x",
                                                       "max_tokens": -1}, timeout=10)  # fmt: skip
        assert r.status_code == 400 and "max_tokens" in r.text, (r.status_code, r.text)

    def chat() -> None:
        msgs = [{"role": "user", "content": "what is lorafleet"}]
        whole = client.chat.completions.create(model="demo-coder", messages=msgs, **greedy)
        streamed = client.chat.completions.create(
            model="demo-coder", messages=msgs, stream=True, **greedy
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == whole.choices[0].message.content, (text, whole)

    def tool(city: dict) -> dict:
        params = {"type": "object", "properties": {"city": city}, "required": ["city"]}
        return {"type": "function", "function": {"name": "get_weather", "parameters": params}}

    def tool_call() -> None:  # the README's example
        r = client.chat.completions.create(
            model="demo-poet", messages=[{"role": "user", "content": "weather in oslo?"}],
            tools=[tool({"type": "string", "enum": ["oslo", "lima"]})],
            tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("oslo", "lima")

    def bounded_strings_are_json() -> None:  # xgrammar's minLength / maxLength rule
        for model in DEMO:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "weather in oslo?"}],
                tools=[tool({"type": "string", "maxLength": 12})], tool_choice="required",
                parallel_tool_calls=False, max_tokens=64, temperature=0,
            )  # fmt: skip
            (call,) = r.choices[0].message.tool_calls
            assert len(json.loads(call.function.arguments)["city"]) <= 12

    def json_schema() -> None:
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        r = client.chat.completions.create(
            model="demo-chef", messages=[{"role": "user", "content": "a number"}],
            response_format=fmt, max_tokens=32, temperature=0,
        )  # fmt: skip
        assert isinstance(json.loads(r.choices[0].message.content)["n"], int)

    def grpc_equals_rest() -> None:
        listed = {m.id for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
        assert set(DEMO) <= listed, listed
        chunks = stub.Generate(
            pb.GenerateRequest(model="demo-poet", prompt="hello world", max_tokens=12),
            timeout=30,
        )
        text = "".join(c.text for c in chunks)
        assert text == complete("demo-poet"), text

    def cli_lists() -> None:
        url_file = cluster.url_file()
        assert url_file, "no LORAFLEET_REDIS_URL export line in the cluster's output"
        env["LORAFLEET_REDIS_URL"] = Path(url_file).read_text().strip()
        password = env["LORAFLEET_REDIS_URL"].split(":")[2].split("@")[0]
        assert not any(password in line for line in cluster.lines), "the password was printed"
        out = subprocess.run([*cli, "adapters", "list", "--json"], env=env, check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        names = {a["name"] for a in json.loads(out)}
        assert set(DEMO) <= names, names

    def register_serve_unregister() -> None:
        path = write_demo_adapter(tmp / "smoke-adapter", ("q_proj", "v_proj"), 8, 16, 99)
        subprocess.run([*cli, "adapters", "register", "smoke-adapter", str(path), "--public"],
                       env=env, check=True, capture_output=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                assert complete("smoke-adapter")
                break
            except NotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        subprocess.run([*cli, "adapters", "unregister", "smoke-adapter"], env=env, check=True,
                       capture_output=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                complete("smoke-adapter")
            except NotFoundError:
                return
            if time.monotonic() > deadline:
                raise AssertionError("an unregistered adapter still answers after 60 s")
            time.sleep(1)

    return [(f.__name__, f) for f in (
        models, deterministic, adapters_differ, stream_equals_whole, unknown_is_404,
        bad_body_is_400, chat, tool_call, bounded_strings_are_json, json_schema, grpc_equals_rest, cli_lists,
        register_serve_unregister,
    )]  # fmt: skip


def redis_port(url_file: str | None) -> int | None:
    if url_file is None or not Path(url_file).exists():
        return None
    return int(Path(url_file).read_text().strip().rsplit(":", 1)[1].split("/")[0])


def stop(cluster: Cluster) -> list[str]:
    """SIGTERM, as `kill <pid>` sends it; the problems with how it went."""
    rport = redis_port(cluster.url_file())
    started = time.monotonic()
    os.kill(cluster.proc.pid, signal.SIGTERM)
    try:
        cluster.proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(cluster.proc.pid, signal.SIGKILL)
        return [f"still running {STOP_S} s after SIGTERM (killed)"]
    print(f"  stopped in {time.monotonic() - started:.1f} s (exit {cluster.proc.returncode})")
    time.sleep(2)
    problems = [f"exit code {cluster.proc.returncode}"] if cluster.proc.returncode else []
    for port in (8000, 9000, rport):
        if port is not None and port_open(port):
            problems.append(f"port {port} still answers after the stop")
    return problems


def main() -> int:
    for port in (8000, 9000):
        if port_open(port):
            print(f"port {port} is taken: stop what holds it first", file=sys.stderr)
            return 2
    cluster = Cluster()
    failed = []
    started = time.monotonic()
    try:
        wait_ready(cluster)
        print(f"cluster up in {time.monotonic() - started:.0f} s")
        with tempfile.TemporaryDirectory() as tmp:
            for name, check in checks(cluster, Path(tmp)):
                try:
                    check()
                    print(f"ok    {name}")
                except Exception as e:  # noqa: BLE001 - reported, then the next check
                    failed.append(name)
                    print(f"FAIL  {name}: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - the cluster never came up: show why
        failed.append("start")
        print(f"FAIL  start: {e}\n{cluster.tail()}")
    finally:
        problems = stop(cluster) if cluster.proc.poll() is None else ["it had exited"]
    for p in problems:
        print(f"FAIL  stop: {p}")
    if failed or problems:
        print(f"--- cluster output (last lines) ---\n{cluster.tail()}")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
