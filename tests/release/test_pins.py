"""Pinned external artifacts: schema validation and hash-checked downloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.errors import IntegrityError, InvalidInputError
from kiln.core.fsutil import sha256_file
from kiln.release.index.pins import DEFAULT_PINS, fetch_pins, load_pins
from tests.helpers.wheelkit import make_wheel


def _write(path: Path, pins: list[dict]) -> Path:
    path.write_text(json.dumps({"schema_version": 1, "pins": pins}))
    return path


def test_shipped_pins_file_is_valid() -> None:
    assert isinstance(load_pins(DEFAULT_PINS), list)


def test_pinned_download_matching_its_hash_is_fetched(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "upstream", "third-party", "2.1")
    pins = load_pins(_write(tmp_path / "pins.json", [{
        "filename": wheel.name, "version": "2.1", "url": wheel.as_uri(), "sha256": sha256_file(wheel), "variants": ["cu130"]}]))
    fetched = fetch_pins(pins, tmp_path / "dl")
    assert fetched == [("cu130", tmp_path / "dl" / wheel.name)]
    assert sha256_file(fetched[0][1]) == sha256_file(wheel)


def test_pinned_download_with_another_hash_is_refused_and_not_written(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "upstream", "third-party", "2.1")
    pins = load_pins(_write(tmp_path / "pins.json", [{
        "filename": wheel.name, "version": "2.1", "url": wheel.as_uri(), "sha256": "0" * 64}]))
    with pytest.raises(IntegrityError, match="the pin says"):
        fetch_pins(pins, tmp_path / "dl")
    assert not (tmp_path / "dl").exists()


@pytest.mark.parametrize(
    ("pin", "fragment"),
    [
        ({"filename": "x-1.0-py3-none-any.whl", "version": "2.0", "url": "https://e/x", "sha256": "a" * 64}, "does not match"),
        ({"filename": "../x-1.0-py3-none-any.whl", "version": "1.0", "url": "https://e/x", "sha256": "a" * 64}, "bare file name"),
        ({"filename": "x-1.0-py3-none-any.whl", "version": "1.0", "url": "ftp://e/x", "sha256": "a" * 64}, "url"),
        ({"filename": "x-1.0-py3-none-any.whl", "version": "1.0", "url": "https://e/x", "sha256": "A" * 64}, "sha256"),
        ({"filename": "x-1.0-py3-none-any.whl", "version": "1.0", "url": "https://e/x"}, "missing"),
        ({"filename": "x-1.0-py3-none-any.whl", "version": "1.0", "url": "https://e/x", "sha256": "a" * 64, "sha": 1}, "unknown"),
    ],
)
def test_invalid_pins_are_refused_naming_the_problem(tmp_path: Path, pin: dict, fragment: str) -> None:
    with pytest.raises(InvalidInputError, match=fragment):
        load_pins(_write(tmp_path / "pins.json", [pin]))


def test_pins_file_without_schema_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pins.json").write_text('{"pins": []}')
    with pytest.raises(InvalidInputError, match="schema_version"):
        load_pins(tmp_path / "pins.json")
