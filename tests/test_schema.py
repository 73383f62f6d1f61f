"""The one codec (tpassrun/schema): what a type hint and wire() metadata make of a dataclass, pure."""

from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass, field
from typing import Annotated, Any, ClassVar, Mapping

import pytest

from tpassrun.schema import Address, Max, NonNegative, OneOf, Schema, SchemaError, dump, load, wire


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


class Bad(SchemaError):
    pass


@dataclass(frozen=True)
class Inner:
    name: str
    at: Address | None = None


@dataclass(frozen=True)
class Outer:
    id: str
    count: NonNegative
    color: Color
    _: KW_ONLY
    ratio: float = 0.5
    flag: bool = False
    level: Annotated[int, Max(3)] = 0
    mode: Annotated[str, OneOf("a", "b")] = "a"
    note: str | None = None
    items: tuple[Inner, ...] = ()
    pairs: tuple[tuple[str, int], ...] = ()
    by_rank: Mapping[int, tuple[NonNegative, ...]] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    since: int = field(default=0, metadata=wire(missing_from="count"))
    total: int = field(default=0, metadata=wire(omit_default=True))
    detail: int = field(default=0, metadata=wire(written_with="total"))
    reason: str = field(default="x", metadata=wire(missing=""))
    derived: str = field(default="", compare=False, metadata=wire(skip=True))

    SCHEMA: ClassVar[Schema] = Schema("outer", version=3, error=Bad, named_by="id")


FULL = Outer(id="o1", count=2, color=Color.BLUE, ratio=1.5, flag=True, level=3, mode="b", note="n",
             items=(Inner("i", ("h", 80)), Inner("j")), pairs=(("p", -1),), by_rank={4: (1, 2)}, extra={"k": [1]},
             since=7, total=9, detail=1, reason="r", derived="not written")


def test_declaration_order_is_key_order_and_quirks_are_metadata():
    doc = dump(FULL)
    assert list(doc) == ["v", "id", "count", "color", "ratio", "flag", "level", "mode", "note", "items", "pairs",
                         "by_rank", "extra", "since", "total", "detail", "reason"]
    assert doc["v"] == 3 and doc["color"] == "blue" and doc["by_rank"] == {"4": [1, 2]}
    assert doc["items"] == [{"name": "i", "at": ["h", 80]}, {"name": "j", "at": None}]
    assert load(Outer, doc) == FULL
    small = dump(Outer(id="o2", count=1, color=Color.RED, detail=5))
    assert "total" not in small and "detail" not in small       # omit_default, and written only with total
    back = load(Outer, {"v": 3, "id": "o2", "count": 4, "color": "red"})
    assert (back.since, back.reason, back.note, back.ratio) == (4, "", None, 0.5)
    assert load(Outer, {**doc, "ratio": 2}).ratio == 2.0 and isinstance(load(Outer, {**doc, "ratio": 2}).ratio, float)
    assert load(Outer, {**doc, "unknown": 1, "mac": "v1:x"}) == FULL     # keys it does not know are ignored


@pytest.mark.parametrize("change,says", [
    ({"v": 2}, "outer: schema version 2; this tpassrun reads v3"),
    ({"count": -1}, "outer 'o1': count must be >= 0, not -1"),
    ({"count": True}, "outer 'o1': count must be an integer, not True"),
    ({"color": "green"}, "outer 'o1': color 'green' is not one of red, blue"),
    ({"level": 4}, "outer 'o1': level must be <= 3, not 4"),
    ({"mode": "c"}, "outer 'o1': mode 'c' is not one of a, b"),
    ({"ratio": "1"}, "outer 'o1': ratio must be a number, not '1'"),
    ({"flag": 1}, "outer 'o1': flag must be true or false, not 1"),
    ({"note": 5}, "outer 'o1': note must be a string, not 5"),
    ({"items": [{"name": "i", "at": ["h", 0]}]}, "outer 'o1' items[0]: at[1] must be >= 1, not 0"),
    ({"items": [5]}, "outer 'o1': items[0] must be a JSON object, not 5"),
    ({"pairs": [["p"]]}, "outer 'o1': pairs[0] must be a list of 2, not ['p']"),
    ({"by_rank": {"x": []}}, "outer 'o1': by_rank must be keyed by ranks, not 'x'"),
    ({"by_rank": {"1": [-2]}}, "outer 'o1': by_rank[1][0] must be >= 0, not -2"),
    ({"extra": []}, "outer 'o1': extra must be a JSON object, not []"),
    ({"id": None}, "outer None: id must be a string, not None"),
])
def test_a_bad_value_is_one_line_naming_the_record_and_the_field(change, says):
    with pytest.raises(Bad) as err:
        load(Outer, {**dump(FULL), **change})
    assert str(err.value) == says


def test_a_missing_required_field_and_a_non_object_are_errors_too():
    with pytest.raises(Bad, match="outer 'o1': count is missing"):
        load(Outer, {"v": 3, "id": "o1", "color": "red"})
    with pytest.raises(Bad, match=r"outer: not a JSON object \(list\)"):
        load(Outer, [])
    with pytest.raises(SchemaError, match="Inner: name is missing"):
        load(Inner, {})          # a type without a schema: named by its class, a SchemaError (a ValueError)


def test_a_hint_without_a_json_form_is_refused_when_first_used():
    @dataclass
    class Odd:
        x: set[int]

    with pytest.raises(TypeError, match="no JSON form"):
        dump(Odd({1}))


def test_bytes_are_written_as_hex_and_anything_else_is_refused():
    @dataclass(frozen=True)
    class Keyed:
        key: bytes
        old: bytes | None = None

    assert dump(Keyed(b"\x00\xab")) == {"key": "00ab", "old": None}
    assert load(Keyed, {"key": "00AB", "old": "01"}) == Keyed(b"\x00\xab", b"\x01")
    for bad, says in (("0g", "'0g'"), ("abc", "'abc'"), (5, "5")):
        with pytest.raises(SchemaError) as err:
            load(Keyed, {"key": bad})
        assert str(err.value) == f"Keyed: key must be a hex string, not {says}"
