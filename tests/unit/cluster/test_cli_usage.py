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
        (("acme", "64b7f6", "--all"), "error: argument --all: not allowed with argument key_id"),
        (("acme",), "error: one of the arguments key_id --all is required"),
    ],
)
def test_revoke_key_needs_exactly_one_of_id_and_all(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["tenants", "revoke-key", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: lorafleet tenants revoke-key [options] name (key_id | --all)\n")
    assert err.splitlines()[-1] == f"lorafleet tenants revoke-key: {message}"


@pytest.mark.parametrize(
    "argv,key_id,all_keys",
    [(("acme", "64b7f6"), "64b7f6", False), (("acme", "--all"), None, True)],
)
def test_revoke_key_parses_an_id_or_all(argv, key_id, all_keys):
    args = build_parser().parse_args(["tenants", "revoke-key", *argv])
    assert (args.name, args.key_id, args.all) == ("acme", key_id, all_keys)


@pytest.mark.parametrize("command,verb", [("adapters", "register"), ("tenants", "revoke-key")])
def test_every_argument_has_help(command, verb):
    assert all(action.help for action in _verb(command, verb)._actions)
