"""The ``kiln.toml`` reference, rendered from the configuration models themselves.

Every table and key of :class:`~kiln.tasks.project.config.KilnConfig` with its type, default, allowed values,
constraints, description and deprecated spellings. A key's description is its ``Field(description=...)``, else
the comment the model carries beside or just above the key; a table's is its model's docstring. Nothing here
is written by hand, so a key added to a model is in the next regenerated page (``docs/reference/kiln-toml.md``,
which ``tests/docs/test_reference.py`` keeps current). Pure: models in, markdown out.
"""

from __future__ import annotations

import inspect
import io
import re
import textwrap
import tokenize
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kiln.release.upload.kinds import UploadTargetConfig
from kiln.tasks.project.config import SUITE_RENAMES, KilnConfig, Suite
from kiln.tasks.project.config_publish import upload_target_models

# Deprecated spellings each model still accepts (old -> new), from the tables the loader itself applies.
DEPRECATED: dict[type[BaseModel], dict[str, str]] = {Suite: SUITE_RENAMES}
# Keys the models hold that no kiln.toml may set: Kiln fills them in at load.
_INTERNAL = {("variants", "cell")}
# Tables the file spells differently from the model: kind = "upload" targets sit in [publish.targets].
_SPELLING = {"publish.upload_targets.<name>": "publish.targets.<name>"}
_FIELD_LINE = re.compile(r"^    ([A-Za-z_][A-Za-z0-9_]*)\s*:")


@dataclass(frozen=True)
class Table:
    header: str  # as the file spells it: "[build.cache]", "[[suites]]", "[publish.targets.<name>]"
    model: type[BaseModel]
    path: str  # the model's own dotted path, for the keys Kiln sets itself
    names: tuple[str, ...] = ()  # the allowed names of a table of tables keyed by a closed set


def _strip(annotation: Any) -> Any:
    """``annotation`` without ``Annotated`` and ``None`` (optional keys are told by their default)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return annotation


def _model_of(annotation: Any) -> type[BaseModel] | None:
    annotation = _strip(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def tables(model: type[BaseModel] = KilnConfig, path: str = "", array: bool = False,
           names: tuple[str, ...] = (), kind: str = "") -> Iterator[Table]:
    """Every table of ``model``, depth first in the models' order, as the file spells its header."""
    if path:
        spelled = _SPELLING.get(path, path)
        note = f' with kind = "{kind}"' if kind else ""
        yield Table((f"[[{spelled}]]" if array else f"[{spelled}]") + note, model, path, names)
    for name, info in model.model_fields.items():
        if info.exclude or (path, name) in _INTERNAL:
            continue
        key = f"{path}.{name}" if path else name
        annotation = _strip(info.annotation)
        origin, args = get_origin(annotation), get_args(annotation)
        if origin is dict and len(args) == 2 and _strip(args[1]) is UploadTargetConfig:
            for kind, kind_model in upload_target_models().items():  # each kind's model: its own table
                yield from tables(kind_model, f"{key}.<name>", kind=kind)
        elif _model_of(annotation):
            yield from tables(_strip(annotation), key)
        elif origin is tuple and args and _model_of(args[0]):
            yield from tables(_strip(args[0]), key, array=True)
        elif origin is dict and len(args) == 2 and _model_of(args[1]):
            keys = tuple(f"`{n}`" for n in get_args(_strip(args[0])))  # a closed set of names (the steps)
            placeholder = "step" if keys else "name"
            yield from tables(_strip(args[1]), f"{key}.<{placeholder}>", names=keys)


def _type(annotation: Any) -> str:
    annotation = _strip(annotation)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "string"
    if origin in (Union, types.UnionType):  # a count or "auto"
        return " or ".join(_type(a) for a in args)
    if origin is tuple:
        return f"array of {_plural(_type(args[0]))}" if args else "array"
    if origin is dict:
        return f"table of {_plural(_type(args[1]))}"
    if annotation is UploadTargetConfig:  # a table whose kind chooses its model
        return "table"
    if _model_of(annotation):
        return "table" if origin is None else "array of tables"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _plural(kind: str) -> str:
    return {"table": "tables", "string": "strings", "integer": "integers", "number": "numbers",
            "boolean": "booleans", "path": "paths"}.get(kind, kind)


def _allowed(info: FieldInfo) -> list[str]:
    annotation = _strip(info.annotation)
    if get_origin(annotation) is dict:  # the allowed keys of a table of tables (permissions' steps, channels)
        annotation = _strip(get_args(annotation)[0])
    elif get_origin(annotation) is tuple and get_args(annotation):
        annotation = _strip(get_args(annotation)[0])
    return [f"`{value}`" for value in get_args(annotation)] if get_origin(annotation) is Literal else []


def _constraints(info: FieldInfo) -> list[str]:
    metadata = list(info.metadata)
    annotation = info.annotation
    while get_origin(annotation) is Annotated:  # an Annotated alias (PoolName) keeps its Field in its args
        metadata += [m for arg in get_args(annotation)[1:] for m in getattr(arg, "metadata", [arg])]
        annotation = get_args(annotation)[0]
    out = []
    for item in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                out.append(f"{sign} {getattr(item, attr)}")
        if getattr(item, "pattern", None):
            out.append(f"matches `{item.pattern}`")
    return out


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        given = value.model_dump(exclude_defaults=True)  # a default table that sets keys of its own ([artifacts])
        return f"`{_toml(given)}`" if given else "its table's defaults"
    return f"`{_toml(value)}`"


def _comments(model: type[BaseModel]) -> dict[str, str]:
    """Each field's comment in ``model``'s source: the comment lines just above it and the one beside it."""
    try:
        source = textwrap.dedent(inspect.getsource(model))  # a class defined in a function is indented
    except (OSError, TypeError):
        return {}
    beside: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.line[: token.start[1]].strip():
            beside[token.start[0]] = token.string.lstrip("#").strip()
    found: dict[str, str] = {}
    above: list[str] = []
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if line.startswith("    #") and not line.startswith("     "):
            above.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD_LINE.match(line)
        if match and match.group(1) not in found:
            text = " ".join([*above, beside.get(number, "")]).strip()
            if text and not text.startswith(("noqa", "type:")):
                found[match.group(1)] = text
        above = []
    return found


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _key_row(name: str, info: FieldInfo, comment: str) -> str:
    allowed = ", ".join(_allowed(info) + _constraints(info)) or "—"
    description = info.description or comment or "—"
    return f"| `{name}` | {_type(info.annotation)} | {_default(info)} | {_cell(allowed)} | {_cell(description)} |"


def render_table(table: Table) -> list[str]:
    model = table.model
    lines = [f"## `{table.header}`", ""]
    doc = inspect.getdoc(model) if model.__doc__ else None
    if doc and not doc.startswith(model.__name__ + "("):
        lines += [doc, ""]
    if table.names:
        lines += [f"One table per name; the names: {', '.join(table.names)}.", ""]
    comments = _comments(model)
    rows = []
    for name, info in model.model_fields.items():
        if info.exclude or (table.path, name) in _INTERNAL:
            continue
        rows.append(_key_row(name, info, comments.get(name, "")))
    lines += ["| key | type | default | allowed | description |", "|---|---|---|---|---|", *rows, ""]
    renames = DEPRECATED.get(model, {})
    if renames:
        lines += ["Deprecated spellings, still accepted with a warning naming the new key:", ""]
        lines += [f"- `{old}`: use `{new}`" for old, new in sorted(renames.items())] + [""]
    return lines


def render() -> str:
    """The whole reference page, markdown."""
    lines = [
        "# `kiln.toml` reference",
        "",
        "<!-- Generated from the configuration models (kiln.tasks.project.config_reference); do not edit."
        " Regenerate: python -m kiln.flows.report.reference -->",
        "",
        "Every table and key `kiln.toml` accepts, generated from the models Kiln validates the file with."
        " An unknown key is an error with a did-you-mean; paths are relative to `kiln.toml`."
        " A key with no description here is described in the guides.",
        "",
    ]
    top = KilnConfig.model_fields
    lines += ["## Top level", "", "| table | type | default |", "|---|---|---|"]
    for name, info in top.items():
        if not info.exclude:
            lines.append(f"| `{name}` | {_type(info.annotation)} | {_default(info)} |")
    lines.append("")
    for table in tables():
        lines += render_table(table)
    return "\n".join(lines).rstrip("\n") + "\n"
