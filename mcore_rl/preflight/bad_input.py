"""Bad input at the command line: one line on stderr naming what is wrong (and the path), exit
code 2, no traceback.

Every entry point (train, plan, config, converters and their merge) reads its inputs inside

    try:
        ...
    except BAD_INPUT as e:
        return report(e)

before it writes anything, so a refused input leaves nothing behind (the run's checks, shared
with `--dry-run`, are mcore_rl.preflight.inputs's). Exceptions that mean "the user's input is wrong"
derive from `BadInput`; the readers below turn a missing, unreadable or malformed file into one.
tests/unit/test_cli_errors.py holds one row per refusal and entry point.
"""

from __future__ import annotations

import difflib
import json
import os
import sys

EXIT_BAD_INPUT = 2


class BadInput(ValueError):
    """A file, directory or setting given by the user is wrong; the message names it."""


class ConfigError(BadInput):
    """One or more config problems; `.errors` holds one line per problem (one problem: one line)."""

    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        sep = "\n  " if len(self.errors) > 1 else " "
        super().__init__("invalid config:" + sep + sep.join(self.errors))


def suggest(word: str, choices) -> str:
    """" (did you mean 'X'?)" for the closest of `choices`, or ""."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


# file-system errors outside our readers (a shard that cannot be opened, ...) are bad input too
BAD_INPUT = (BadInput, OSError)


def message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    if isinstance(e, KeyError) and e.args:  # str() would quote it
        return str(e.args[0])
    return str(e) or type(e).__name__


def report(e: BaseException, prog: str | None = None) -> int:
    """Print `e` as one error line (no traceback) and return the exit code for bad input."""
    print(f"{prog + ': ' if prog else ''}error: {message(e)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _read_text(path: str, what: str) -> str:
    if os.path.isdir(path):
        raise BadInput(f"{path}: is a directory, not a {what} file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not a {what} file (not UTF-8 text)") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot be read ({e.strerror or e})") from None


def yaml_load(text: str):
    """yaml.safe_load, except that a number written with underscores stays text: YAML 1.1 reads
    0.5_2 as 0.52, where verl's "lower_upper" thresholds mean the band [0.5, 2]."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    for tag, number in (("float", yaml.SafeLoader.construct_yaml_float), ("int", yaml.SafeLoader.construct_yaml_int)):
        Loader.add_constructor(f"tag:yaml.org,2002:{tag}",
                               lambda loader, node, number=number: node.value if "_" in node.value
                               else number(loader, node))
    return yaml.load(text, Loader=Loader)


def read_yaml_mapping(path: str) -> dict:
    """The mapping at the top of a YAML file (an empty file is an empty mapping)."""
    import yaml

    text = _read_text(path, "YAML")
    try:
        data = yaml_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise BadInput(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BadInput(f"{path}: a YAML mapping (key: value lines) is needed, found a {type(data).__name__}")
    return data


def read_json_object(path: str) -> dict:
    """The JSON object in a file."""
    text = _read_text(path, "JSON")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: a JSON object is needed, found a {type(data).__name__}")
    return data


def hf_config(model_dir: str) -> dict:
    """config.json of an HF model directory."""
    if not os.path.isdir(model_dir):
        kind = "not a directory" if os.path.exists(model_dir) else "no such directory"
        raise BadInput(f"{model_dir}: {kind} (an HF model directory with a config.json is needed)")
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise BadInput(f"{model_dir}: no config.json (not an HF model directory)")
    return read_json_object(path)
