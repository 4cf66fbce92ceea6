"""The admin CLI as a real subprocess against a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.records import ServedBase
from cluster.registry import Registry
from lora_core.base_shape import BaseShape
from lora_core.validate import content_hash
from tests.integration.cluster.conftest import _save_peft
from tests.integration.cluster.timing import lapse
from tests.redis_fixture import dump_redis

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def cli(redis_url: str):
    """cli(*argv, module="cluster.cli") -> CompletedProcess; env points at the test Redis."""

    def run(*argv: str, module: str = "cluster.cli") -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "LORAFLEET_NAMESPACE": "t"}
        return subprocess.run(
            [sys.executable, "-m", module, *argv, "--redis-url", redis_url],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run


def ok(proc: subprocess.CompletedProcess) -> str:
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    return proc.stdout


def error_line(proc: subprocess.CompletedProcess, code: int = 1) -> str:
    assert proc.returncode == code
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lorafleet: error: "), proc.stderr
    return lines[0].removeprefix("lorafleet: error: ")


def test_register_list_show_json(cli, adapters, registry: Registry):
    assert ok(cli("tenants", "create", "acme")) == "created tenant acme\n"
    out = ok(
        cli(
            "adapters",
            "register",
            "a",
            str(adapters["a"]),
            "--base-model",
            "tiny",
            "--tenant",
            "acme",
        )
    )
    h = content_hash(adapters["a"])
    assert out == f"registered a version 1 (rank 8, sha256 {h[:16]})\n"
    ok(cli("adapters", "register", "b", str(adapters["small"]), "--public"))
    ok(cli("adapters", "pin", "a", "--pool", "decode"))
    assert cli("adapters", "warm", "b", "--replicas", "2").returncode == 0  # with a note
    epoch = registry.register_replica("r1", "decode", "dep", 4, 30.0)
    registry.report_resident("r1", epoch, ("a", 1), "gpu")
    listed = json.loads(ok(cli("adapters", "list", "--json")))
    assert [
        {k: x[k] for k in ("name", "version", "path", "base_model", "rank", "pinned",
                           "warm_replicas", "locations")}
        for x in listed
    ] == [
        {"name": "a", "version": 1, "path": str(adapters["a"].resolve()), "base_model": "tiny",
         "rank": 8, "pinned": True, "warm_replicas": 0,
         "locations": [{"replica": "r1", "tier": "gpu", "pool": "decode"}]},
        {"name": "b", "version": 1, "path": str(adapters["small"].resolve()),
         "base_model": registry.get_adapter("b").base_model, "rank": 4, "pinned": False,
         "warm_replicas": 2, "locations": []},
    ]  # fmt: skip
    shown = json.loads(ok(cli("adapters", "show", "a", "--json")))
    assert (shown["owner"], shown["content_hash"], shown["pin_pool"]) == ("acme", h, "decode")
    replicas = json.loads(ok(cli("replicas", "list", "--json")))
    assert [(r["replica"], r["pool"], r["live"], r["gpu_adapters"]) for r in replicas] == [
        ("r1", "decode", True, 1)
    ]
    status = json.loads(ok(cli("status", "--json")))
    assert (status["adapters"], status["pins"], status["warm"], status["replicas_live"]) == (
        2,
        1,
        1,
        {"decode": 1, "mixed": 0, "prefill": 0},
    )


def test_replace_of_a_name_that_is_no_adapter_says_so(cli, adapters, registry: Registry):
    """--replace expects NAME to exist: one that does not (never registered, removed, or
    being unregistered) is still registered (a script's "create or update" works), with a
    note on stderr."""
    argv = ["adapters", "register", "a", str(adapters["a"]), "--base-model", "m", "--replace"]
    none = "lorafleet: note: --replace found no adapter 'a'; registered it as a new adapter\n"
    for version in (1, 2):
        proc = cli(*argv)
        assert proc.stdout.split()[:4] == ["registered", "a", "version", str(version)]
        assert (proc.returncode, proc.stderr) == (0, none if version == 1 else "")
    assert registry.unregister_adapter("a") == "removed"
    proc = cli(*argv)
    assert (proc.stdout.split()[3], proc.stderr) == ("3", none)
    epoch = registry.register_replica("r1", "mixed", "dep", 4, 30.0)
    registry.report_resident("r1", epoch, ("a", 3), "gpu")
    assert registry.unregister_adapter("a") == "draining"
    proc = cli(*argv)
    assert (proc.returncode, proc.stdout.split()[3]) == (0, "4")
    assert proc.stderr == (
        "lorafleet: note: --replace found 'a' being unregistered; registered it as a new "
        "adapter (the old one's owner, public flag and grants are not kept)\n"
    )
    helped = " ".join(ok(cli("adapters", "register", "--help")).split())
    assert "a NAME that does not exist (or is being unregistered) is registered as a new" in helped


def test_human_tables_are_aligned(cli, adapters, registry: Registry):
    registry.register_adapter("a-long-adapter-name", str(adapters["a"]), base_model="m")
    registry.register_adapter("b", str(adapters["small"]), base_model="m")
    lines = ok(cli("adapters", "list")).splitlines()
    assert lines[0].split() == [
        "NAME",
        "VERSION",
        "RANK",
        "BASE_MODEL",
        "STATE",
        "PIN",
        "WARM",
        "LOCATIONS",
        "PATH",
    ]
    assert [ln.split()[:8] for ln in lines[1:]] == [
        ["a-long-adapter-name", "1", "8", "m", "active", "-", "-", "-"],
        ["b", "1", "4", "m", "active", "-", "-", "-"],
    ]
    starts = {ln.index(word) for ln, word in zip(lines, ("VERSION", "1", "1"), strict=True)}
    assert starts == {len("a-long-adapter-name") + 2}


def test_tenant_key_grant_revoke(cli, adapters, registry: Registry):
    registry.register_adapter("a", str(adapters["a"]))
    ok(cli("tenants", "create", "acme"))
    proc = cli("tenants", "key", "acme")
    key = proc.stdout.strip()
    assert (proc.returncode, proc.stderr.split()[:2]) == (0, ["key", "id"])
    assert key.startswith("lf-") and registry.resolve_key(key) == "acme"
    assert ok(cli("tenants", "grant", "acme", "a")) == "granted acme -> a\n"
    assert registry.resolve_request(key, "a").tenant == "acme"
    assert ok(cli("tenants", "revoke", "acme", "a")) == "revoked acme -> a\n"
    assert registry.authorize("acme", "a") is False
    assert json.loads(ok(cli("tenants", "list", "--json"))) == [
        {"tenant": "acme", "requests_per_minute": 0}
    ]


def test_unpin_and_unregister(cli, adapters, registry: Registry):
    registry.register_adapter("a", str(adapters["a"]))
    ok(cli("adapters", "pin", "a"))
    ok(cli("adapters", "unpin", "a"))
    assert registry.desired_state().pins == {}
    assert ok(cli("adapters", "unregister", "a")) == "a: removed\n"
    assert json.loads(ok(cli("adapters", "list", "--json"))) == []


def test_errors_exit_1_with_one_line_and_change_nothing(
    cli, adapters, broken_adapters, redis_url, registry: Registry
):
    registry.register_adapter("a", str(adapters["a"]))
    before = dump_redis(redis_url)
    assert error_line(cli("adapters", "show", "nope")) == "adapter 'nope' not found"
    assert error_line(cli("adapters", "pin", "nope")) == "adapter 'nope' not found"
    assert "use_dora" in error_line(cli("adapters", "register", "x", str(broken_adapters["dora"])))
    assert "pickle" in error_line(
        cli("adapters", "register", "x", str(broken_adapters["pickle_weights"]))
    )
    assert "already exists" in error_line(cli("adapters", "register", "a", str(adapters["b"])))
    assert "does not exist" in error_line(cli("tenants", "key", "ghost"))
    assert dump_redis(redis_url) == before


def test_register_checks_shape_of_known_base(cli, adapters, registry: Registry, redis_url):
    wide = BaseShape("LlamaForCausalLM", num_layers=2, hidden=128, num_heads=4, num_kv_heads=2,
                     head_dim=32, intermediate=128)  # fmt: skip
    registry.set_base_shape("wide", wide)
    before = dump_redis(redis_url)
    msg = error_line(cli("adapters", "register", "a", str(adapters["a"]), "--base-model", "wide"))
    assert "allowed" in msg
    assert dump_redis(redis_url) == before
    ok(cli("adapters", "register", "a", str(adapters["a"]), "--base-model", "unknown-base"))


def test_replicas_list_and_reap(cli, adapters, registry: Registry):
    registry.register_adapter("a", str(adapters["a"]))
    e = registry.register_replica("gone", "prefill", "dep", 2, 30.0)
    registry.report_resident("gone", e, ("a", 1), "gpu")
    assert registry.unregister_adapter("a") == "draining"
    registry.register_replica("live", "decode", "dep", 8, 30.0)
    lapse(registry, "gone")
    lines = ok(cli("replicas", "list")).splitlines()
    assert [ln.split() for ln in lines] == [
        ["REPLICA", "POOL", "DEPLOYMENT", "SLOTS", "EPOCH", "LIVE", "GPU", "CPU"],
        ["gone", "prefill", "dep", "2", "1", "no", "1", "0"],
        ["live", "decode", "dep", "8", "1", "yes", "0", "0"],
    ]
    assert ok(cli("replicas", "reap")) == "removed 1 lapsed replicas and 1 drained adapters\n"
    assert [r.replica_id for r in registry.list_replicas()] == ["live"]
    assert registry.list_adapters() == []


def test_usage_errors_exit_2(cli):
    for argv in (
        ("adapters",),
        ("adapters", "warm", "a"),
        ("adapters", "pin", "a", "--pool", "x"),
        ("tenants", "grant", "t"),
        ("adapters", "register", "a", "/p", "--base-model", ""),  # was recorded as no base
        ("adapters", "register", "a", "/p", "--base-model", "a b"),
    ):
        proc = cli(*argv)
        assert proc.returncode == 2, argv
        assert "usage:" in proc.stderr


def test_unreachable_redis_names_url(cli):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "status", "--redis-url", "redis://127.0.0.1:1/0"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert error_line(proc).startswith("cannot reach Redis at redis://127.0.0.1:1/0")


def test_lorafleet_entry_point_has_admin_verbs(cli, registry: Registry):
    pytest.importorskip("replica.offline_cli", reason="deploy/cli.py needs replica.offline_cli")
    registry.create_tenant("acme")
    assert json.loads(ok(cli("tenants", "list", "--json", module="deploy.cli"))) == [
        {"tenant": "acme", "requests_per_minute": 0}
    ]


def test_register_checks_the_clusters_served_base(cli, adapters, registry: Registry, redis_url):
    fits = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, intermediate=128)  # fmt: skip
    registry.set_served(ServedBase("tiny-base", replace(fits, hidden=128), max_lora_rank=16))
    before = dump_redis(redis_url)
    assert "do not fit the base model" in error_line(
        cli("adapters", "register", "a", str(adapters["a"]))
    )
    assert dump_redis(redis_url) == before
    registry.set_served(ServedBase("tiny-base", fits, max_lora_rank=4))
    before = dump_redis(redis_url)
    # the client's --max-lora-rank cannot lift the cluster's own limit
    msg = error_line(cli("adapters", "register", "a", str(adapters["a"]), "--max-lora-rank", "256"))
    assert "rank <= 4" in msg
    assert "base model's id" in error_line(
        cli("adapters", "register", "tiny-base", str(adapters["small"]))
    )
    assert dump_redis(redis_url) == before
    ok(cli("adapters", "register", "s", str(adapters["small"])))
    assert registry.get_adapter("s").base_model == "tiny-base"


def test_register_notes_an_adapter_config_naming_another_base(cli, registry: Registry, tmp_path):
    shape = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate=128)  # fmt: skip
    registry.set_served(ServedBase("Meta-Llama-3-8B", shape, max_lora_rank=16))
    path = _save_peft(tmp_path / "other", seed=4, r=4, targets=["q_proj"])
    config = path / "adapter_config.json"
    config.write_text(
        json.dumps(
            {**json.loads(config.read_text()), "base_model_name_or_path": "org/Llama-3.1-8B"}
        )
    )
    proc = cli("adapters", "register", "other", str(path))
    assert proc.returncode == 0 and proc.stdout.startswith("registered other version 1"), proc
    [note] = proc.stderr.splitlines()
    assert note.startswith("lorafleet: note: the adapter's config names base model "
                           "'org/Llama-3.1-8B'; this cluster serves 'Meta-Llama-3-8B'")  # fmt: skip
    assert registry.get_adapter("other").base_model == "Meta-Llama-3-8B"
    # an operator who names the served model vouches for it; a config naming it needs no note
    ok(cli("adapters", "register", "other", str(path), "--replace", "--base-model",
           "Meta-Llama-3-8B"))  # fmt: skip
    config.write_text(
        json.dumps(
            {**json.loads(config.read_text()), "base_model_name_or_path": "meta/Meta-Llama-3-8B"}
        )
    )
    ok(cli("adapters", "register", "same", str(path)))


def test_register_rank_limit_defaults_to_the_clusters(cli, registry: Registry, tmp_path):
    big = _save_peft(tmp_path / "r80", seed=3, r=80, targets=["q_proj"])
    # no cluster published its limit: the default one (64, the cluster's default)
    assert error_line(cli("adapters", "register", "big", str(big))).endswith("rank <= 64")
    shape = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate=128)  # fmt: skip
    registry.set_served(ServedBase("tiny-base", shape, max_lora_rank=128))
    # the cluster takes rank 80, so the CLI does too (it refused it with its own 64)
    assert ok(cli("adapters", "register", "big", str(big))).startswith(
        "registered big version 1 (rank 80,"
    )
    # an explicit client limit below the cluster's still applies
    msg = error_line(cli("adapters", "register", "b2", str(big), "--max-lora-rank", "32"))
    assert msg.endswith("rank <= 32")


def test_unpin_says_when_nothing_was_pinned(cli, adapters, registry: Registry):
    registry.register_adapter("a", str(adapters["a"]))
    assert ok(cli("adapters", "pin", "a")) == "pinned a (pool all)\n"
    assert ok(cli("adapters", "unpin", "a")) == "unpinned a\n"
    assert ok(cli("adapters", "unpin", "a")) == "unpinned a (was not pinned)\n"
    assert error_line(cli("adapters", "unpin", "zzz")) == "adapter 'zzz' not found"


def test_pin_refused_when_no_slot_would_stay_evictable(
    cli, adapters, registry: Registry, redis_url
):
    shape = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate=128)  # fmt: skip
    registry.set_served(ServedBase("tiny-base", shape, max_lora_rank=16, max_loras=2))
    for name in ("x", "y"):
        registry.register_adapter(name, str(adapters["a"]))
    assert ok(cli("adapters", "pin", "x")) == "pinned x (pool all)\n"
    before = dump_redis(redis_url)
    msg = error_line(cli("adapters", "pin", "y", "--pool", "decode"))
    assert msg.startswith("pinning 'y' would leave replicas no evictable GPU adapter slot")
    assert "2 slots (max_loras) and 1 pinned already (x); allowed: at most 1 pinned" in msg
    assert dump_redis(redis_url) == before
    ok(cli("adapters", "unpin", "x"))
    ok(cli("adapters", "pin", "y", "--pool", "decode"))
    assert registry.desired_state().pins == {"y": "decode"}


def test_show_table_reads_like_the_list(cli, adapters, registry: Registry):
    """Unset fields show "-" (as in `adapters list`), the creation time as UTC."""
    rec = registry.register_adapter("a", str(adapters["a"]))
    rows = dict(ln.split(None, 1) for ln in ok(cli("adapters", "show", "a")).splitlines()[1:])
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(rec.created)) + "Z"
    assert (rows["base_model"], rows["owner"], rows["created"]) == ("-", "-", created)
    assert (rows["public"], rows["pin_pool"], rows["locations"]) == ("False", "-", "-")


def test_warm_notes_a_target_above_the_live_replicas_and_zero_clears(
    cli, adapters, registry: Registry
):
    """The target is kept either way; the note says it is not met yet. A decode target
    counts decode and mixed replicas (prefill ones cannot hold it)."""
    registry.register_adapter("a", str(adapters["a"]))
    short = cli("adapters", "warm", "a", "--replicas", "2", "--pool", "decode")
    assert (short.returncode, short.stdout) == (0, "warm target of a: 2 replicas (pool decode)\n")
    assert short.stderr == (
        "lorafleet: note: 0 live replicas in pool decode now; the target is kept and met as "
        "replicas join\n"
    )
    for rid, pool in (("r1", "decode"), ("r2", "prefill")):
        registry.register_replica(rid, pool, "dep", 4, 30.0)
    assert "1 live replicas in pool decode" in cli("adapters", "warm", "a", "--replicas", "2",
                                                    "--pool", "decode").stderr  # fmt: skip
    registry.register_replica("r3", "mixed", "dep", 4, 30.0)
    assert ok(cli("adapters", "warm", "a", "--replicas", "2", "--pool", "decode")) == (
        "warm target of a: 2 replicas (pool decode)\n"
    )
    assert ok(cli("adapters", "warm", "a", "--replicas", "0")) == "cleared the warm target of a\n"
    assert registry.desired_state().warm == {}


def test_register_an_empty_path_says_it_is_empty(cli, redis_url):
    # The CLI read the adapter config for its base model before the registry checked the
    # path, so '' was resolved to the working directory and the error named that.
    before = dump_redis(redis_url)
    assert error_line(cli("adapters", "register", "x", "")) == (
        "path is empty; allowed: an existing local directory holding adapter_config.json "
        "and adapter_model.safetensors"
    )
    assert dump_redis(redis_url) == before


def test_register_of_big_weights_says_so_first(cli, adapters, tmp_path, redis_url):
    """Validation reads, hashes and scans every weight byte, silently: above 256 MiB a
    line on stderr says what is going on (here a sparse file, refused afterwards)."""
    import shutil

    big = shutil.copytree(adapters["a"], tmp_path / "big")
    with open(big / "adapter_model.safetensors", "r+b") as f:
        f.truncate(300 << 20)
    proc = cli("adapters", "register", "x", str(big))
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines[0] == f"lorafleet: validating and hashing 0.3 GiB of weights in {big}"
    assert len(lines) == 2 and lines[1].startswith("lorafleet: error: ")
    assert ok(cli("adapters", "register", "a", str(adapters["a"]))).startswith("registered a ")
