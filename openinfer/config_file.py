"""vLLM's ``--config FILE``: a YAML mapping of a command's flags, read before its command line
(which wins where both set a flag).

    # serve.yaml                          openinfer serve --config serve.yaml --port 9000
    model: /models/qwen3
    port: 8000                            # the command line's 9000 wins
    enable-prefix-caching: false          # -> --no-enable-prefix-caching
    api-key: [key-a, key-b]               # a list -> --api-key key-a key-b
    speculative-config: {method: ngram, num_speculative_tokens: 4}   # a mapping -> its JSON

Keys are the flags' names without dashes (``tensor-parallel-size`` or
``tensor_parallel_size``); ``true`` sets a switch, ``false`` turns it off where it has a
``--no-`` form and leaves it off otherwise. A key the command does not have is refused by
name, as on the command line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with its ``--config FILE`` replaced by the file's flags, placed right after
    the command so that the command line's own flags come later and win."""
    where = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")),
                 None)
    if where is None:
        return argv
    if argv[where] == "--config":
        if where + 1 >= len(argv):
            raise ValueError("--config needs a file")
        path, rest = argv[where + 1], argv[:where] + argv[where + 2:]
    else:
        path, rest = argv[where].split("=", 1)[1], argv[:where] + argv[where + 1:]
    if not rest or rest[0].startswith("-"):
        raise ValueError("--config goes after the command (openinfer serve --config FILE)")
    options = _options_of(parser, rest[0])
    return rest[:1] + _flags(_read(path), options, path) + rest[1:]


def _read(path: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: want a mapping of flags to values, got "
                         f"{type(data).__name__}")
    return data


def _options_of(parser: argparse.ArgumentParser, command: str) -> set[str]:
    commands = next((a.choices for a in parser._actions
                     if isinstance(a, argparse._SubParsersAction)), {})
    if command not in commands:
        raise ValueError(f"--config: no command {command!r}")
    return {s for a in commands[command]._actions for s in a.option_strings}


def _flags(data: dict, options: set[str], path: str) -> list[str]:
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config" or flag not in options:
            raise ValueError(f"--config {path}: {key!r} is not a flag of this command")
        if value is True:
            tokens.append(flag)
        elif value is False:
            negated = "--no-" + flag[2:]
            tokens += [negated] if negated in options else []
        elif isinstance(value, list):
            tokens += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            tokens += [flag, json.dumps(value)]
        elif value is not None:
            tokens += [flag, str(value)]
    return tokens
