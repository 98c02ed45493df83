"""Turn pydantic validation errors on YAML input into 'file:line: field ...' messages."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import yaml
from pydantic import ValidationError


def read_yaml(path: Path, error: type[Exception], what: str):
    """Parse a YAML file, or raise `error` saying 'file:line: ...' (missing file, bad syntax)."""
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise error(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML: {getattr(e, 'problem', e)}") from None


def yaml_root(path: Path) -> yaml.Node | None:
    try:
        return yaml.compose(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def line_of(node: yaml.Node | None, loc: Sequence) -> int:
    """1-based line of the deepest YAML node along `loc` (the parent's, for a missing key)."""
    line = node.start_mark.line + 1 if node is not None else 1
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(key):
                    node, line = v, k.start_mark.line + 1
                    break
            else:
                break
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
    return line


def explain(err: ValidationError, path: Path | None = None, root: yaml.Node | None = None,
            prefix: Sequence = ()) -> str:
    """One line per error: `file:line: field 'a.b': message (got value)`.

    `prefix` is where the validated mapping sits inside the YAML document (for a Serve config,
    the application's `args`), so lines and field names point at the real place in the file.
    """
    lines = []
    for e in err.errors():
        loc = [*prefix, *e["loc"]]
        field = ".".join(str(p) for p in loc) or "<root>"
        where = f"{path}:{line_of(root, loc)}: " if path is not None else ""
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"{where}field '{field}': {e['msg']}{got}")
    return "\n".join(lines)
