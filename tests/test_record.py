"""record.py: the records that replace dataclasses on the status path keep the dataclasses' semantics (issue 38),
and no class of the package is a dataclass any more (they compile methods per class at import)."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import pkgutil

import pytest

import spark_memsaver
from spark_memsaver import record
from spark_memsaver.record import Record, field


class Point(Record):
    x: int
    y: int = 0
    tags: list = field(default_factory=list)


class Frozen(Record, frozen=True):
    code: str
    detail: dict = field(default_factory=dict)
    note: str = field(default="", compare=False)


class Pair(Record, frozen=True):
    a: str
    b: int


class Derived(Point):
    z: int = 9


def test_positional_keyword_defaults_and_factories():
    p = Point(1)
    assert (p.x, p.y, p.tags) == (1, 0, [])
    assert Point(1, 2, ["a"]).tags == ["a"]
    assert Point(x=3, y=4).y == 4
    assert Point(1).tags is not Point(1).tags          # a fresh list each time, as default_factory
    with pytest.raises(TypeError, match="missing the argument 'x'"):
        Point()
    with pytest.raises(TypeError, match="unexpected keyword argument 'w'"):
        Point(1, w=2)
    with pytest.raises(TypeError, match="multiple values for 'x'"):
        Point(1, x=2)
    with pytest.raises(TypeError, match="positional"):
        Point(1, 2, [], 4)


def test_slots_from_annotations():
    assert Point.__slots__ == ("x", "y", "tags") and Derived.__slots__ == ("z",)
    assert record.fields(Derived) == ("x", "y", "tags", "z")
    with pytest.raises(AttributeError):
        Point(1).other = 2                             # no __dict__


def test_equality_repr_and_hash_as_dataclasses():
    assert Point(1, 2) == Point(1, 2) and Point(1, 2) != Point(1, 3)
    assert Point(1) != Derived(1)                      # another class is never equal
    assert repr(Point(1, 2)) == "Point(x=1, y=2, tags=[])"
    assert Point.__hash__ is None                      # mutable: unhashable
    with pytest.raises(TypeError):
        hash(Point(1))
    assert Frozen("a", note="x") == Frozen("a", note="y")       # compare=False
    assert len({Pair("a", 1), Pair("a", 1), Pair("b", 1)}) == 2     # frozen: hashed by value
    with pytest.raises(TypeError):
        hash(Frozen("a"))                              # ... as its fields are (a dict is not)


def test_frozen_refuses_assignment():
    f = Frozen("a")
    with pytest.raises(record.FrozenInstanceError):
        f.code = "b"
    with pytest.raises(AttributeError):                # FrozenInstanceError is an AttributeError
        del f.code
    p = Point(1)
    p.x = 5                                            # a mutable record assigns
    assert p.x == 5


def test_replace_asdict_pickle():
    f = Frozen("a", {"k": [Point(1)]})
    g = record.replace(f, code="b")
    assert (g.code, g.detail) == ("b", f.detail) and f.code == "a"
    with pytest.raises(TypeError):
        record.replace(f, nope=1)
    assert record.asdict(f) == {"code": "a", "detail": {"k": [{"x": 1, "y": 0, "tags": []}]}, "note": ""}
    assert pickle.loads(pickle.dumps(Derived(1, z=3))) == Derived(1, z=3)


def test_no_dataclass_left_in_the_package():
    """Every class of the package that declares fields is a Record: a dataclass would be compiled at import."""
    found = []
    for mod in pkgutil.walk_packages(spark_memsaver.__path__, "spark_memsaver."):
        if ".validate" in mod.name:                    # imports the CUDA binding lazily; checked below by source
            continue
        m = importlib.import_module(mod.name)
        found += [f"{mod.name}.{k}" for k, v in vars(m).items()
                  if isinstance(v, type) and v.__module__ == mod.name and dataclasses.is_dataclass(v)]
    assert found == []
    src = list((__import__("pathlib").Path(spark_memsaver.__file__).parent).rglob("*.py"))
    assert [str(p) for p in src if "@dataclass" in p.read_text() or "dataclasses.dataclass" in p.read_text()] == []
