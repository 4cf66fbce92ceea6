"""Options and error handling shared by every admin verb."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

from cluster.client import DEFAULT_URL, RetryPolicy, redact
from cluster.registry import MAX_LORA_RANK, Registry
from lora_core.errors import LoraFleetError, RegistryUnavailable

# Without --redis-timeout: the most one Redis command may take, retries included. Every
# verb's commands are short (paged listings: ~20 ms a page, ~35 ms for the names of 10k
# adapters), so this is ~100x their need, yet a stopped Redis fails in seconds.
DEFAULT_REDIS_TIMEOUT_S = 3.0
# without --max-lora-rank: the served base's limit, or this (the cluster's default) when
# no deployment published one
DEFAULT_MAX_LORA_RANK = 64
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C, one line instead of a traceback
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, as a shell reports a tool killed by SIGPIPE
Handler = Callable[[Registry, argparse.Namespace], int]
# The default URL (no --redis-url, no LORAFLEET_REDIS_URL) is rarely a cluster's: one
# started without redis_url has a local Redis on a port picked at start, and a Redis that
# answers there (a system redis-server) holds no cluster: each verb read or wrote the
# wrong registry without a word.
URL_HINT = (
    '`serve run` prints its registry\'s URL at start ("lorafleet: local registry at ..."): '
    "pass it as --redis-url or LORAFLEET_REDIS_URL"
)


def env_default(name: str, default: str) -> str:
    """$name, or default when it is unset or empty (`VAR=` in a shell or an env file
    means "not configured", not "the empty value")."""
    return os.environ.get(name) or default


def connection_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    url = env_default("LORAFLEET_REDIS_URL", DEFAULT_URL)
    p.add_argument(
        "--redis-url",
        metavar="URL",
        default=url,
        # the default may come from the environment: --help must not print its password
        help="registry Redis (env LORAFLEET_REDIS_URL; default "
        + redact(url).replace("%", "%%")
        + ")",
    )
    p.add_argument(
        "--namespace",
        default=env_default("LORAFLEET_NAMESPACE", "lorafleet"),
        help="key prefix of this cluster (env LORAFLEET_NAMESPACE; default %(default)s)",
    )
    p.add_argument(
        "--redis-timeout",
        type=_seconds,
        metavar="SECONDS",
        default=env_default("LORAFLEET_REDIS_TIMEOUT", str(DEFAULT_REDIS_TIMEOUT_S)),
        help="the most one Redis command may take, retries included, before the verb "
        "fails; raise it for a slow Redis (env LORAFLEET_REDIS_TIMEOUT; default "
        f"{DEFAULT_REDIS_TIMEOUT_S:g})",
    )
    return p


def add_max_lora_rank(p: argparse.ArgumentParser) -> None:
    """--max-lora-rank: only `adapters register` checks ranks."""
    p.add_argument(
        "--max-lora-rank",
        type=_lora_rank,
        metavar="RANK",
        default=env_default("LORAFLEET_MAX_LORA_RANK", "") or None,
        help="max LoRA rank to accept; a running cluster's own limit applies too (env "
        f"LORAFLEET_MAX_LORA_RANK; default: the cluster's limit, or {DEFAULT_MAX_LORA_RANK} "
        "when no cluster published one)",
    )


def _lora_rank(text: str) -> int:
    # argparse reports the option's name; the value may have come from the environment
    if not (text.strip().isdigit() and 1 <= int(text) <= MAX_LORA_RANK):
        raise argparse.ArgumentTypeError(
            f"{text!r}; allowed: an integer 1 .. {MAX_LORA_RANK} (flag or env "
            "LORAFLEET_MAX_LORA_RANK)"
        )
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 3600:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(
            f"{text!r}; allowed: seconds, > 0 and <= 3600 (flag or env LORAFLEET_REDIS_TIMEOUT)"
        )
    return value


def cli_retry(timeout_s: float) -> RetryPolicy:
    """The CLI's policy: a refused connection is retried twice within ~0.5 s; one attempt
    may wait timeout_s for an answer (no retry after that: the time is spent)."""
    return RetryPolicy(
        retries=2,
        backoff_base_s=0.05,
        backoff_cap_s=0.2,
        connect_timeout_s=min(0.5, timeout_s),
        socket_timeout_s=timeout_s,
        deadline_s=timeout_s,
        deadline_advice="retry later, or a longer --redis-timeout (env LORAFLEET_REDIS_TIMEOUT)",
    )


def json_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def add_verb(
    sub: argparse._SubParsersAction,
    name: str,
    handler: Handler,
    help: str,
    *,
    listing: bool,
    named: str = "",
) -> argparse.ArgumentParser:
    """The verb's parser; listing: it takes --json; named: the help of its NAME argument
    ("" for none)."""
    parents = [connection_parent()] + ([json_parent()] if listing else [])
    p = sub.add_parser(name, parents=parents, help=help, description=help)
    p.set_defaults(func=lambda args: run(handler, args))
    if named:
        p.add_argument("name", metavar="NAME", help=named)
    return p


def run(handler: Handler, args: argparse.Namespace) -> int:
    """Open the registry, run handler; LoraFleetError / ValueError -> one line, exit 1;
    stdout closed by its reader (`lorafleet adapters list | head`) -> quiet exit 141;
    Ctrl-C -> one line, exit 130."""
    try:
        # register passes its own --max-lora-rank; the registry's limit is the widest
        retry = cli_retry(args.redis_timeout)
        registry = Registry(
            args.redis_url, args.namespace, max_lora_rank=MAX_LORA_RANK, retry=retry
        )
    except ValueError as e:
        return fail(e)
    default = args.redis_url == DEFAULT_URL
    try:
        if default and registry.get_served() is None:
            print(
                f"lorafleet: note: no cluster serves from the default registry {DEFAULT_URL} "
                f"(namespace {args.namespace}); {URL_HINT}",
                file=sys.stderr,
            )
        return handler(registry, args)
    except RegistryUnavailable as e:
        return fail(e, f" (the default URL; {URL_HINT})" if default else "")
    except (LoraFleetError, ValueError) as e:
        return fail(e)
    except KeyboardInterrupt:
        print("lorafleet: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # what a shell tool killed by SIGPIPE does; stdout is pointed at /dev/null so
        # the interpreter's final flush does not print a second traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    finally:
        registry.close()


def fail(err: BaseException, hint: str = "") -> int:
    print(
        f"lorafleet: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}" + hint,
        file=sys.stderr,
    )
    return 1


def utc_time(at: float | None) -> str:
    """A timestamp (seconds since the epoch) as "YYYY-MM-DD HH:MM:SSZ", or "-" for none."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + "Z" if at else "-"


def print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """An aligned text table: one header line, then one line per row."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
