"""Wheel variants (PEP 825): the metadata every variant wheel carries and the index-level file merged from it.

A variant wheel is an ordinary wheel whose file name carries a variant label after the platform tag
(``tiny_kernels-0.1.0-py3-none-linux_x86_64-cu130.whl``) and whose ``*.dist-info/variant.json`` maps that
label to its variant properties (``nvidia :: sm_arch :: 90_real``). An index lists, on the project page
beside the wheels, ``{name}-{version}-variants.json``: every label of that version with its properties, which
an installer reads to choose a wheel without downloading each. :func:`merge_variants` makes that file from
the wheels' own ``variant.json`` (and the file already published, if any): labels are only ever added, and a
label defined twice differently is refused, naming the label.

Kiln writes the variant metadata with the PEP 850 schema (``v0.2.0``, :data:`VARIANT_SCHEMA`): PEP 825's
format plus a ``providers`` table naming the plugin that knows each namespace. uv 0.13 (``--preview-features
wheel-variants``) reads both schemas, but evaluates a namespace only when that table names one of its
vendored providers (``nvidia_variant_provider.plugin:NvidiaVariantPlugin``); under the bare PEP 825 schema
it only ever picks the null variant. Pure functions over JSON documents and bytes: no tasks, no Prefect.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kiln.core.errors import InvalidInputError
from kiln.core.wheels import WheelSource, open_wheel, read_member

#: The schema Kiln writes: PEP 825's variant metadata with PEP 850's provider table.
VARIANT_SCHEMA = "https://variants-schema.wheelnext.dev/peps/850/v0.2.0.json"
#: Schemas Kiln reads (uv 0.13 reads the same two).
KNOWN_SCHEMAS = (VARIANT_SCHEMA, "https://variants-schema.wheelnext.dev/peps/825/v0.1.1.json")
#: The label of the variant with no properties: chosen when no other variant fits the machine.
NULL_LABEL = "null"
VARIANT_JSON = "variant.json"
VARIANT_JSON_LIMIT = 1 << 20
_LABEL = re.compile(r"^[0-9a-z_.]+$")
_NAME = re.compile(r"^[a-z0-9_]+$")
_VALUE = re.compile(r"^[0-9a-z_.]+$")
_SHARED = ("$schema", "default-priorities", "providers")

Properties = dict[str, dict[str, list[str]]]


def check_label(label: str) -> str:
    if not _LABEL.match(label):
        raise InvalidInputError(f"variant label {label!r} must be lowercase letters, digits, '_' and '.' (PEP 825)")
    return label


def variant_filename(filename: str, label: str) -> str:
    """``name-version-tag.whl`` -> ``name-version-tag-label.whl``."""
    if not filename.endswith(".whl") or filename.count("-") != 4:
        raise InvalidInputError(f"{filename!r} is not a wheel file name without a build tag or variant label")
    return f"{filename.removesuffix('.whl')}-{check_label(label)}.whl"


def wheel_variant_label(filename: str) -> str | None:
    """The variant label of a wheel file name, ``None`` for a wheel without one (a build tag is not a label)."""
    parts = filename.removesuffix(".whl").split("-")
    build = parts[2][:1].isdigit() if len(parts) > 2 else False
    return parts[-1] if len(parts) == (7 if build else 6) else None


def variants_json_name(distribution: str, version: str) -> str:
    """``{name}-{version}-variants.json``, both normalized as in a wheel's file name."""
    try:
        normal = str(Version(version))
    except InvalidVersion as exc:
        raise InvalidInputError(f"cannot name the variants file of {distribution!r} {version!r}: {exc}") from exc
    return f"{canonicalize_name(distribution).replace('-', '_')}-{normal}-variants.json"


def dumps(document: Mapping[str, Any]) -> bytes:
    """The one spelling Kiln writes: sorted keys, two-space indent, a final newline (same input, same bytes)."""
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


# Any: parsed JSON of a variants file, checked here
def _properties(label: str, value: Any, where: str) -> Properties:
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where}: variant {label!r} must map namespaces to features")
    out: Properties = {}
    for namespace, features in value.items():
        if not isinstance(namespace, str) or not _NAME.match(namespace) or not isinstance(features, dict):
            raise InvalidInputError(f"{where}: variant {label!r} has an invalid namespace {namespace!r}")
        out[namespace] = {}
        for feature, values in features.items():
            if (not isinstance(feature, str) or not _NAME.match(feature) or not isinstance(values, list)
                    or not values or not all(isinstance(v, str) and _VALUE.match(v) for v in values)):
                raise InvalidInputError(f"{where}: variant {label!r} has an invalid feature {namespace}::{feature}")
            out[namespace][feature] = sorted(set(values))
    return out


# Any: parsed JSON of a variants file, checked here
def check_document(document: Any, where: str) -> dict[str, Any]:
    """A variant metadata document (``variant.json`` or ``-variants.json``), checked; InvalidInputError if not."""
    if not isinstance(document, dict):
        raise InvalidInputError(f"{where}: variant metadata must be a JSON object")
    if document.get("$schema") not in KNOWN_SCHEMAS:
        raise InvalidInputError(f"{where}: unknown variant metadata schema {document.get('$schema')!r}")
    priorities = document.get("default-priorities")
    namespaces = priorities.get("namespace") if isinstance(priorities, dict) else None
    if not isinstance(namespaces, list) or not namespaces or not all(
            isinstance(n, str) and _NAME.match(n) for n in namespaces):
        raise InvalidInputError(f"{where}: default-priorities.namespace must list at least one namespace")
    variants = document.get("variants")
    if not isinstance(variants, dict):
        raise InvalidInputError(f"{where}: 'variants' must map labels to properties")
    checked = {check_label(label): _properties(label, props, where) for label, props in variants.items()}
    unknown = sorted({ns for props in checked.values() for ns in props} - set(namespaces))
    if unknown:
        raise InvalidInputError(f"{where}: namespaces {unknown} are missing from default-priorities.namespace")
    return {**document, "variants": checked}


def read_wheel_variant(filename: str, source: WheelSource) -> dict[str, Any]:
    """The ``*.dist-info/variant.json`` of a variant wheel, checked to describe exactly its file name's label."""
    label = wheel_variant_label(filename)
    if label is None:
        raise InvalidInputError(f"{filename} has no variant label: it is not a variant wheel")
    with open_wheel(filename, source) as archive:
        names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(f".dist-info/{VARIANT_JSON}")]
        if len(names) != 1:
            raise InvalidInputError(f"{filename}: expected one *.dist-info/{VARIANT_JSON}, found {names}")
        data = read_member(archive, names[0], filename, VARIANT_JSON_LIMIT)
    try:
        document = check_document(json.loads(data), f"{filename}: {names[0]}")
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{filename}: {names[0]} is not JSON: {exc}") from exc
    if set(document["variants"]) != {label}:
        raise InvalidInputError(f"{filename}: {VARIANT_JSON} describes {sorted(document['variants'])},"
                                f" the file name says {label!r}")
    return document


def merge_variants(existing: Mapping[str, Any] | None, documents: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The index-level ``{name}-{version}-variants.json``: ``existing`` (the published one, or None) with every
    label of ``documents`` (the wheels' ``variant.json``) added.

    Labels are only ever added. A label already defined with other properties, or documents that disagree on
    the schema, the namespace priorities or the providers, are refused (InvalidInputError naming the label or
    the field): an installer that read the old file would otherwise choose by properties the wheel lacks.
    """
    merged: dict[str, Any] | None = None
    sources = ([("the published variants file", existing)] if existing is not None else []) + [
        (f"variant metadata of {sorted(d.get('variants', {}))}", d) for d in documents]
    for where, raw in sources:
        document = dict(check_document(raw, where))  # checked first: a non-object is an InvalidInputError
        if merged is None:
            merged = {key: document[key] for key in _SHARED if key in document} | {"variants": {}}
        for key in _SHARED:
            if document.get(key) != merged.get(key):
                raise InvalidInputError(f"{where}: {key} {document.get(key)!r} differs from {merged.get(key)!r}"
                                        " already in the variants file")
        for label, properties in document["variants"].items():
            known = merged["variants"].get(label)
            if known is not None and known != properties:
                raise InvalidInputError(f"variant label {label!r} is already defined as {known!r};"
                                        f" {where} defines it as {properties!r}")
            merged["variants"][label] = properties
    if merged is None:
        raise InvalidInputError("no variant metadata to merge")
    merged["variants"] = dict(sorted(merged["variants"].items()))
    return merged


def wheels_variants(paths: Iterable[Path], existing: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`merge_variants` of the variant wheels among ``paths`` (wheels without a label are skipped)."""
    documents = []
    for path in paths:
        if wheel_variant_label(path.name) is not None:
            try:
                documents.append(read_wheel_variant(path.name, path))
            except zipfile.BadZipFile as exc:  # open_wheel translates most; a lazy member read may not
                raise InvalidInputError(f"{path.name} is not a readable wheel: {exc}") from exc
    return merge_variants(existing, documents)
