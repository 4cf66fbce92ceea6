"""Usage errors and help texts of the admin verbs (argparse only: no Redis is reached)."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser


def _verb(command: str, verb: str):
    commands = build_parser()._subparsers._group_actions[0].choices
    return commands[command]._subparsers._group_actions[0].choices[verb]


@pytest.mark.parametrize(
    "argv,message",
    [
        (("acme", "--all", "64b7f6"), "error: give a KEY_ID or --all, not both"),
        (("acme", "64b7f6", "--all"), "error: argument --all: not allowed with argument KEY_ID"),
        (("acme",), "error: one of the arguments KEY_ID --all is required"),
    ],
)
def test_revoke_key_needs_exactly_one_of_id_and_all(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["tenants", "revoke-key", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: lorafleet tenants revoke-key [options] NAME (KEY_ID | --all)\n")
    assert err.splitlines()[-1] == f"lorafleet tenants revoke-key: {message}"


@pytest.mark.parametrize(
    "argv,key_id,all_keys",
    [(("acme", "64b7f6"), "64b7f6", False), (("acme", "--all"), None, True)],
)
def test_revoke_key_parses_an_id_or_all(argv, key_id, all_keys):
    args = build_parser().parse_args(["tenants", "revoke-key", *argv])
    assert (args.name, args.key_id, args.all) == ("acme", key_id, all_keys)


def _verbs() -> list[tuple[str, str]]:
    commands = build_parser()._subparsers._group_actions[0].choices
    return [
        (command, verb)
        for command in ("adapters", "replicas", "tenants")
        for verb in commands[command]._subparsers._group_actions[0].choices
    ]


@pytest.mark.parametrize("command,verb", _verbs())
def test_every_argument_has_help(command, verb):
    assert all(action.help for action in _verb(command, verb)._actions)


@pytest.mark.parametrize("command,verb", _verbs())
def test_help_shows_no_argparse_placeholders(command, verb):
    """No `[]` (an optional value with an empty metavar: `--all []`), no lower-case
    positional the help text calls by its upper-case name (NAME, KEY_ID)."""
    text = _verb(command, verb).format_help()
    assert "[]" not in text and "==SUPPRESS==" not in text
    usage = text.split("\n\n")[0]
    positionals = [a for a in _verb(command, verb)._actions if not a.option_strings]
    assert all(a.metavar and a.metavar.isupper() and a.metavar in usage for a in positionals)


def test_revoke_key_help_shows_all_as_a_flag():
    lines = _verb("tenants", "revoke-key").format_help().splitlines()
    assert "  --all                 revoke every key of the tenant" in lines


@pytest.mark.parametrize("command,verb", _verbs())
def test_only_register_takes_max_lora_rank(command, verb):
    options = {o for action in _verb(command, verb)._actions for o in action.option_strings}
    assert ("--max-lora-rank" in options) == ((command, verb) == ("adapters", "register"))


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--max-lora-rank", "0"], {}, "argument --max-lora-rank: '0'; allowed: an integer "
         "1 .. 1024 (flag or env LORAFLEET_MAX_LORA_RANK)"),
        ([], {"LORAFLEET_MAX_LORA_RANK": "x"}, "argument --max-lora-rank: 'x'; allowed: an "
         "integer 1 .. 1024 (flag or env LORAFLEET_MAX_LORA_RANK)"),
        (["--redis-timeout", "0"], {}, "argument --redis-timeout: '0'; allowed: seconds, > 0 "
         "and <= 3600 (flag or env LORAFLEET_REDIS_TIMEOUT)"),
        ([], {"LORAFLEET_REDIS_TIMEOUT": "inf"}, "argument --redis-timeout: 'inf'; allowed: "
         "seconds, > 0 and <= 3600 (flag or env LORAFLEET_REDIS_TIMEOUT)"),
    ],
)  # fmt: skip
def test_bad_rank_or_timeout_is_a_usage_error(capsys, monkeypatch, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["adapters", "register", "a", "/p", *argv])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"lorafleet adapters register: error: {message}"
    )


@pytest.mark.parametrize(
    "env, argv, timeout",
    [({}, [], 3.0), ({"LORAFLEET_REDIS_TIMEOUT": "7.5"}, [], 7.5),
     ({"LORAFLEET_REDIS_TIMEOUT": "7.5"}, ["--redis-timeout", "0.2"], 0.2),
     ({"LORAFLEET_REDIS_TIMEOUT": ""}, [], 3.0)],
)  # fmt: skip
def test_redis_timeout_from_flag_env_or_default(monkeypatch, env, argv, timeout):
    monkeypatch.delenv("LORAFLEET_REDIS_TIMEOUT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert build_parser().parse_args(["status", *argv]).redis_timeout == timeout
