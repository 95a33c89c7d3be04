"""Records: classes declared as dataclasses are (annotated fields, defaults, ``field(...)``), built without code
generation.

``dataclasses`` compiles an ``__init__``, ``__eq__``, ``__repr__`` (and ``__setattr__`` when frozen) for every
class with ``exec`` at import time, and ``dataclass(slots=True)`` builds each class twice: on the status path that
was about 1 ms a class, 36 classes (issue 38). A :class:`Record` gets ``__slots__`` from its annotations when the
class statement runs, and shares one ``__init__``, ``__eq__``, ``__repr__`` and ``__hash__`` with every other
record. The semantics the code and its tests rely on are the dataclasses' own: positional or keyword arguments in
field order, defaults and ``field(default_factory=...)``, ``field(compare=False)``, equality by value between
objects of the same class, ``Name(a=1, b='x')`` as repr, ``frozen=True`` (class keyword) refusing assignment with
:class:`FrozenInstanceError` (an ``AttributeError``) and hashing by value, a mutable record unhashable.

    class Finding(Record, frozen=True):
        code: str
        detail: dict = field(default_factory=dict)

A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

MISSING = object()


class Field:
    """What ``field()`` declares: a default or a factory of one, and whether equality compares the field."""
    __slots__ = ("default", "factory", "compare")

    def __init__(self, default=MISSING, factory=MISSING, compare=True):
        self.default, self.factory, self.compare = default, factory, compare


def field(*, default=MISSING, default_factory=MISSING, compare: bool = True) -> Field:
    if default is not MISSING and default_factory is not MISSING:
        raise ValueError("field(): give default or default_factory, not both")
    return Field(default, default_factory, compare)


class FrozenInstanceError(AttributeError):
    """Assignment to a field of a frozen record."""


def _is_classvar(annotation) -> bool:
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return text.startswith(("ClassVar", "typing.ClassVar"))


class _RecordType(type):
    def __new__(mcls, name, bases, ns, frozen=None):
        own = [k for k, a in ns.get("__annotations__", {}).items() if not _is_classvar(a)]
        fields: list[str] = []
        specs: dict[str, Field] = {}
        inherited_frozen = False
        for base in reversed(bases):
            for k in getattr(base, "_FIELDS", ()):
                if k not in specs:
                    fields.append(k)
                specs[k] = base._SPECS[k]
            inherited_frozen = inherited_frozen or getattr(base, "_FROZEN", False)
        new = []
        for k in own:
            v = ns.pop(k, MISSING)
            specs[k] = v if isinstance(v, Field) else Field(v)
            if k not in fields:
                fields.append(k)
                new.append(k)
        ns["__slots__"] = tuple(new)
        cls = super().__new__(mcls, name, bases, ns)
        cls._FIELDS = tuple(fields)
        cls._SPECS = specs
        cls._FROZEN = inherited_frozen if frozen is None else bool(frozen)
        cls._COMPARED = tuple(k for k in fields if specs[k].compare)
        if "__hash__" not in ns:
            cls.__hash__ = _hash if cls._FROZEN else None    # as dataclasses: eq and frozen, or unhashable
        if cls._FROZEN:                                      # a mutable record keeps object's own __setattr__
            cls.__setattr__, cls.__delattr__ = _frozen_set, _frozen_del
        return cls


_set = object.__setattr__


def _frozen_set(self, name, value):
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_del(self, name):
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def _hash(self):
    return hash(tuple(getattr(self, k) for k in self._COMPARED))


class Record(metaclass=_RecordType):
    """Base of the records: see the module's docstring."""
    __slots__ = ()

    def __init__(self, *args, **kwargs):
        names = self._FIELDS
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes {len(names)} positional arguments, {len(args)} given")
        for k, v in zip(names, args):
            _set(self, k, v)
        for k in names[len(args):]:
            if k in kwargs:
                _set(self, k, kwargs.pop(k))
                continue
            spec = self._SPECS[k]
            if spec.factory is not MISSING:
                _set(self, k, spec.factory())
            elif spec.default is not MISSING:
                _set(self, k, spec.default)
            else:
                raise TypeError(f"{type(self).__name__}() missing the argument {k!r}")
        if kwargs:
            k = next(iter(kwargs))
            if k in names[:len(args)]:
                raise TypeError(f"{type(self).__name__}() got multiple values for {k!r}")
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {k!r}")

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self._COMPARED)

    def __repr__(self):
        return f"{type(self).__name__}(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self._FIELDS) + ")"

    def __getstate__(self):
        return {k: getattr(self, k) for k in self._FIELDS}

    def __setstate__(self, state):
        for k, v in state.items():
            _set(self, k, v)


def fields(obj) -> tuple[str, ...]:
    """The field names of a record (class or instance), in order."""
    return obj._FIELDS


def replace(obj, **changes):
    """A copy of ``obj`` with ``changes`` (as ``dataclasses.replace``)."""
    values = {k: getattr(obj, k) for k in obj._FIELDS}
    unknown = set(changes) - set(values)
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
    values.update(changes)
    return type(obj)(**values)


def asdict(obj):
    """Records, lists, tuples and dicts turned into plain data, recursively (as ``dataclasses.asdict``)."""
    if isinstance(obj, Record):
        return {k: asdict(getattr(obj, k)) for k in obj._FIELDS}
    if isinstance(obj, (list, tuple)):
        return type(obj)(asdict(v) for v in obj)
    if isinstance(obj, dict):
        return {asdict(k): asdict(v) for k, v in obj.items()}
    return obj
