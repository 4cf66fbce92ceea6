import pytest

from deploy.builder import ClusterArgs, parse_args, prepare_model
from lora_core.errors import InvalidRequest


def test_defaults_match_cluster_yaml():
    args = parse_args({})
    assert args == ClusterArgs()
    assert (args.model, args.redis_url, args.max_loras, args.max_cpu_loras, args.auth) == (
        "demo",
        "",
        2,
        4,
        False,
    )
    assert args.router == "affinity" and args.num_replicas == 2


@pytest.mark.parametrize(
    "args, where",
    [
        ({"max_loras": 0}, "max_loras"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"dtype": "int8"}, "dtype"),
        ({"router": "random"}, "router"),
        ({"num_cpus_per_replica": -1}, "num_cpus_per_replica"),
        ({"redis_port": 70000}, "redis_port"),
        ({"lease_ttl_s": 1.0, "registry_tick_s": 2.0}, "lease_ttl_s"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_args_are_refused_naming_the_field(args, where):
    with pytest.raises(InvalidRequest) as e:
        parse_args(args)
    assert where in str(e.value)


def test_a_model_directory_needs_a_config(tmp_path):
    with pytest.raises(InvalidRequest, match="config.json"):
        prepare_model(parse_args({"model": str(tmp_path)}))
    (tmp_path / "config.json").write_text("{}")
    assert prepare_model(parse_args({"model": str(tmp_path)})) == (str(tmp_path), {})
