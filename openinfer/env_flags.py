"""Environment mirrors of the command line: every flag of ``openinfer serve`` and ``openinfer
router`` may be given as ``OPENINFER_<FLAG>`` (the flag's name in upper case, dashes as
underscores), as container deployments set them:

    OPENINFER_MODEL=/models/qwen3 OPENINFER_PORT=9000 OPENINFER_MAX_MODEL_LEN=4096 \\
    OPENINFER_ENABLE_PREFIX_CACHING=false openinfer serve

A flag on the command line (or in ``--config FILE``) wins over its variable; a variable wins
over the built-in default, and ``--help`` shows it as the default. Switches take
``1/true/yes/on`` or ``0/false/no/off``. A value the flag would refuse is refused naming the
variable. Not mirrored: the repeatable flags (``--worker``, ``--prefill``), the flags a
data-parallel or disaggregated launcher sets on its replicas (``LAUNCHER_SET``), and the
secrets: ``OPENINFER_API_KEY``, ``OPENINFER_ADMIN_API_KEY`` and
``OPENINFER_KV_TRANSFER_SECRET`` keep their own handling (docs/configuration.md), read when
the command runs and never shown as a default."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

PREFIX = "OPENINFER_"
COMMANDS = ("serve", "router")
OWN_HANDLING = frozenset({"api_key", "admin_api_key", "kv_transfer_secret", "kv_transfer_host",
                          "config", "help"})
LAUNCHER_SET = frozenset({"data_parallel_size", "data_parallel_rank", "data_parallel_rpc_port",
                          "data_parallel_address", "backend", "disaggregate", "role",
                          "metrics_engine_index", "listen_fd"})
"""Not mirrored: what a launcher (``--data-parallel-size``, ``--disaggregate``) sets on the
processes it starts, which inherit its environment; a variable would make each replica
launch replicas again."""
TRUE, FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


def variable(action: argparse.Action) -> str:
    return PREFIX + action.dest.upper()


def apply_env_defaults(parser: argparse.ArgumentParser,
                       environ: Mapping[str, str] = os.environ) -> None:
    """Each mirrored flag whose variable is set takes its value as the default. Raises
    ValueError naming the variable for a value the flag refuses."""
    for command, sub in _subcommands(parser).items():
        if command not in COMMANDS:
            continue
        for action in sub._actions:
            if (not action.option_strings or action.dest in OWN_HANDLING | LAUNCHER_SET
                    or isinstance(action, argparse._AppendAction)):
                continue  # (a repeatable flag adds to its default: the variable would stay)
            name = variable(action)
            if environ.get(name, "") != "":
                action.default = _value(sub, action, environ[name].strip(), name)
                action.required = False


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _value(parser: argparse.ArgumentParser, action: argparse.Action, text: str,
           name: str) -> Any:
    if action.nargs == 0:  # a switch
        lowered = text.lower()
        if lowered not in TRUE | FALSE:
            raise ValueError(f"${name}={text!r}: want one of 1/true/yes/on or 0/false/no/off")
        on = lowered in TRUE
        if isinstance(action, argparse.BooleanOptionalAction):
            return on
        if on and not isinstance(action, argparse._StoreConstAction):
            action(parser, argparse.Namespace(), None, action.option_strings[0])  # its refusal
        return action.const if on else action.default
    return _one(action, text, name)


def _one(action: argparse.Action, text: str, name: str) -> Any:
    try:
        value = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"${name}={text!r}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"${name}={text!r}: want one of {', '.join(map(str, action.choices))}")
    return value
