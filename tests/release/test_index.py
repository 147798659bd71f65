"""The index generator, checked field by field with an independent parser."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

from kiln.core.dists import from_record, make_distribution, to_record
from kiln.core.errors import IntegrityError, InvalidInputError
from kiln.release.index.render import JSON_PAGE, generate, group, parse_project_json, parse_root_json, regenerate
from tests.helpers.pageparse import parse_html, parse_json

SHA_A, SHA_B, SHA_M = "a" * 64, "b" * 64, "c" * 64
T0 = 1_700_000_000


def _dists():
    return [
        make_distribution("Kiln_Kernels-0.1.0+cu130-cp311-cp311-linux_x86_64.whl", SHA_A, 123, T0,
                          requires_python=">=3.10,<4", metadata_sha256=SHA_M),
        make_distribution("kiln_kernels-0.2.0-py3-none-any.whl", SHA_B, 456, T0 + 1, yanked="broken <build>"),
        make_distribution("other.pkg-1.0.tar.gz", SHA_A, 7, T0 + 2, yanked=""),
    ]


def test_project_html_has_hash_escaped_requires_python_both_metadata_attrs_and_yank() -> None:
    pages = generate(_dists())
    meta, anchors = parse_html(pages["kiln-kernels/index.html"])
    assert meta["pypi:repository-version"] == "1.4"
    first, second = anchors
    assert first.text == "Kiln_Kernels-0.1.0+cu130-cp311-cp311-linux_x86_64.whl"
    assert first.url == "Kiln_Kernels-0.1.0%2Bcu130-cp311-cp311-linux_x86_64.whl"  # '+' encoded
    assert first.decoded_name == first.text
    assert first.fragment == f"sha256={SHA_A}"
    assert SpecifierSet(first.attrs["data-requires-python"]) == SpecifierSet(">=3.10,<4")
    assert b"&gt;=3.10,&lt;4" in pages["kiln-kernels/index.html"]  # escaped in the raw bytes
    assert first.attrs["data-dist-info-metadata"] == first.attrs["data-core-metadata"] == f"sha256={SHA_M}"
    assert "data-yanked" not in first.attrs
    assert second.attrs["data-yanked"] == "broken <build>"
    assert "data-core-metadata" not in second.attrs and "data-requires-python" not in second.attrs


def test_project_json_is_pep691_with_pep700_fields() -> None:
    page = parse_json(generate(_dists())["kiln-kernels/index.json"])
    assert page["meta"] == {"api-version": "1.4"}
    assert page["name"] == "kiln-kernels"
    assert page["versions"] == ["0.1.0+cu130", "0.2.0"]
    first, second = page["files"]
    assert first["url"] == "Kiln_Kernels-0.1.0%2Bcu130-cp311-cp311-linux_x86_64.whl"
    assert first["hashes"] == {"sha256": SHA_A}
    assert first["size"] == 123
    assert datetime.strptime(first["upload-time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp() == T0
    assert first["requires-python"] == ">=3.10,<4"
    assert first["core-metadata"] == first["dist-info-metadata"] == {"sha256": SHA_M}
    assert first["yanked"] is False
    assert second["yanked"] == "broken <build>" and "core-metadata" not in second
    other = parse_json(generate(_dists())["other-pkg/index.json"])
    assert other["files"][0]["yanked"] is True  # yanked without a reason


def test_root_pages_list_every_normalised_project() -> None:
    pages = generate(_dists())
    _, anchors = parse_html(pages["index.html"])
    assert [(a.text, a.href) for a in anchors] == [("kiln-kernels", "kiln-kernels/"), ("other-pkg", "other-pkg/")]
    assert parse_json(pages["index.json"]) == {"meta": {"api-version": "1.4"},
                                               "projects": [{"name": "kiln-kernels"}, {"name": "other-pkg"}]}
    assert set(pages) == {"index.html", "index.json", "kiln-kernels/index.html", "kiln-kernels/index.json",
                          "other-pkg/index.html", "other-pkg/index.json"}


def test_same_input_in_any_order_gives_the_same_bytes() -> None:
    assert generate(_dists()) == generate(list(reversed(_dists())))


def test_same_filename_with_two_hashes_is_refused() -> None:
    dists = _dists() + [make_distribution("kiln_kernels-0.2.0-py3-none-any.whl", SHA_A, 456, T0)]
    with pytest.raises(IntegrityError, match="kiln_kernels-0.2.0-py3-none-any.whl"):
        group(dists)


def test_regenerate_renders_only_the_changed_project() -> None:
    before = _dists()
    after = before + [make_distribution("kiln_kernels-0.3.0-py3-none-any.whl", SHA_B, 1, T0)]
    assert set(regenerate(before, after)) == {"kiln-kernels/index.html", "kiln-kernels/index.json"}
    new_project = after + [make_distribution("fresh-1.0-py3-none-any.whl", SHA_B, 1, T0)]
    assert set(regenerate(after, new_project)) == {"fresh/index.html", "fresh/index.json", "index.html", "index.json"}
    assert regenerate(after, list(reversed(after))) == {}
    full = generate(new_project)
    assert all(full[path] == data for path, data in regenerate(after, new_project).items())


def test_project_json_round_trips_to_the_same_records() -> None:
    dists = _dists()
    pages = generate(dists)
    for project, files in group(dists).items():
        assert parse_project_json(pages[f"{project}/{JSON_PAGE}"], project) == files


@pytest.mark.parametrize(
    "filename",
    [
        "not-a-wheel.whl",
        "pkg-1.0-py3-none-any.exe",
        "../pkg-1.0-py3-none-any.whl",
        "/abs/pkg-1.0-py3-none-any.whl",
        "dir/pkg-1.0-py3-none-any.whl",
        "pkg-1.0-py3-none-any.whl\n",
        "pkg\x00-1.0-py3-none-any.whl",
        "pkg-not.a.version-py3-none-any.whl",
        ".hidden-1.0-py3-none-any.whl",
        "C:pkg-1.0-py3-none-any.whl",
    ],
)
def test_bad_filenames_are_refused_naming_the_input(filename: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        make_distribution(filename, SHA_A, 1, T0)
    assert repr(filename) in str(caught.value) or filename.strip() in str(caught.value)


@pytest.mark.parametrize(
    ("record", "fragment"),
    [
        ({"filename": "p-1.0-py3-none-any.whl", "sha256": "xyz", "size": 1, "upload_time": 0}, "sha256"),
        ({"filename": "p-1.0-py3-none-any.whl", "sha256": SHA_A, "size": -1, "upload_time": 0}, "size"),
        ({"filename": "p-1.0-py3-none-any.whl", "sha256": SHA_A, "size": 1, "upload_time": 0,
          "requires_python": ">=3.x"}, "requires_python"),
        ({"filename": "p-1.0-py3-none-any.whl", "sha256": SHA_A, "size": 1}, "missing"),
        ({"filename": "p-1.0-py3-none-any.whl", "sha256": SHA_A, "size": 1, "upload_time": 0, "sha": 1}, "unknown"),
        ({"filename": "p-1.0-py3-none-any.whl", "sha256": SHA_A, "size": 1, "upload_time": 0, "yanked": True},
         "yanked"),
    ],
)
def test_bad_records_are_refused_naming_the_field(record: dict, fragment: str) -> None:
    with pytest.raises(InvalidInputError, match=fragment):
        from_record(record)


_GOOD_FILE = ('{"filename": "p-1.0-py3-none-any.whl", "hashes": {"sha256": "' + SHA_A + '"}, "size": 1,'
              ' "upload-time": "2023-11-14T22:13:20.000000Z"}')


@pytest.mark.parametrize(
    ("page", "cause"),
    [
        (b"<html>", "JSONDecodeError"),  # ValueError
        (b"{}", "KeyError"),
        (b'{"files": 3}', "TypeError"),
        (b'{"files": ["p-1.0-py3-none-any.whl"]}', "TypeError"),
        (('{"files": [' + _GOOD_FILE.replace('"size": 1,', '') + ']}').encode(), "KeyError"),
    ],
)
def test_a_project_page_kiln_cannot_merge_into_is_invalid_input_naming_it(page: bytes, cause: str) -> None:
    assert parse_project_json(('{"files": [' + _GOOD_FILE + ']}').encode(), "where")[0].size == 1
    with pytest.raises(InvalidInputError, match=f"s3://b/p/index.json is not a PEP 691 project page.*{cause}"):
        parse_project_json(page, "s3://b/p/index.json")


@pytest.mark.parametrize(("page", "cause"), [(b"<html>", "JSONDecodeError"), (b'{"names": []}', "KeyError"),
                                             (b'{"projects": ["p"]}', "TypeError")])
def test_a_root_page_kiln_cannot_merge_into_is_invalid_input_naming_it(page: bytes, cause: str) -> None:
    assert parse_root_json(b'{"projects": [{"name": "p"}]}', "where") == ["p"]
    with pytest.raises(InvalidInputError, match=f"s3://b/index.json is not a PEP 691 root page.*{cause}"):
        parse_root_json(page, "s3://b/index.json")


def test_record_round_trip() -> None:
    for dist in _dists():
        assert from_record(to_record(dist)) == dist


_names = st.from_regex(r"[A-Za-z][A-Za-z0-9]{0,6}([._-][A-Za-z0-9]{1,4}){0,2}", fullmatch=True)
_versions = st.builds(lambda a, b, local: f"{a}.{b}" + (f"+{local}" if local else ""),
                      st.integers(0, 30), st.integers(0, 30), st.sampled_from(["", "cu130", "rocm6.4", "cpu"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_names, _versions, st.integers(0, 10**9), st.booleans()), min_size=1, max_size=12))
def test_generated_pages_agree_with_the_input_for_arbitrary_names(entries) -> None:
    dists = {}
    for name, version, size, yanked in entries:
        filename = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        dists[filename] = make_distribution(filename, SHA_A, size, T0, yanked="" if yanked else None)
    pages = generate(dists.values())
    listed = 0
    for project in {canonicalize_name(parse_wheel_filename(f)[0]) for f in dists}:
        _, anchors = parse_html(pages[f"{project}/index.html"])
        page = parse_json(pages[f"{project}/index.json"])
        assert [a.decoded_name for a in anchors] == [f["filename"] for f in page["files"]]
        for anchor, entry in zip(anchors, page["files"], strict=True):
            dist = dists[anchor.decoded_name]
            assert "+" not in anchor.url and entry["size"] == dist.size
            assert canonicalize_name(parse_wheel_filename(anchor.decoded_name)[0]) == project
            assert ("data-yanked" in anchor.attrs) == (dist.yanked is not None)
        listed += len(anchors)
    assert listed == len(dists)


_wheelish = st.lists(st.sampled_from(["a", "B", "1", "_", ".", "-", "+", "__", "py3", "none", "any", "cp311", "1.0",
                                      "0"]), min_size=1, max_size=14).map(lambda parts: "".join(parts) + ".whl")


@settings(max_examples=400, deadline=None)
@given(_wheelish)
def test_cached_wheel_parsing_accepts_and_refuses_exactly_what_packaging_does(filename: str) -> None:
    from packaging.utils import InvalidWheelFilename

    from kiln.core.dists import parse_filename

    try:
        name, version, _, _ = parse_wheel_filename(filename)
        expected = (canonicalize_name(name), str(version))
    except InvalidWheelFilename:
        expected = None
    try:
        got = parse_filename(filename)
    except InvalidInputError:
        got = None
    if filename.startswith("."):
        assert got is None  # refused as a hidden file before packaging looks at it
    else:
        assert got == expected


def test_a_yanked_value_that_is_neither_a_flag_nor_a_reason_is_refused() -> None:
    # PEP 691: "yanked" is a boolean or a string; 1 equals True but is neither (a mutant survived on `== True`)
    page = ('{"files": [' + _GOOD_FILE.replace('"size": 1,', '"size": 1, "yanked": 1,') + ']}').encode()
    with pytest.raises(InvalidInputError, match="yanked must be a reason string, got 1"):
        parse_project_json(page, "s3://b/p/index.json")
    flagged = ('{"files": [' + _GOOD_FILE.replace('"size": 1,', '"size": 1, "yanked": true,') + ']}').encode()
    assert parse_project_json(flagged, "where")[0].yanked == ""
