"""One codec for every value tpassrun writes as JSON: a frozen dataclass, its fields and their type hints are the
schema; :func:`dump` writes it, :func:`load` reads it back strictly.

A record is declared once. Its JSON object has one key per field, in the order the fields are declared (after
``"v"`` for a versioned type); :func:`load` checks every value against its field's type hint and raises one
error of one line (:attr:`Schema.error`) naming the record, the field and what was wrong. What a type hint says:

- ``str``, ``int`` (never a bool), ``float`` (an int is read as a float), ``bool``, ``Any`` (taken as it is),
  ``bytes`` (written as a hex string: a key);
  a ``str`` enum (written as its value); ``X | None``; another dataclass (a nested JSON object);
- ``tuple[X, ...]`` / ``list[X]`` (a JSON list), ``tuple[X, Y]`` (a list of exactly that shape),
  ``Mapping[str, X]`` / ``Mapping[int, X]`` (a JSON object; int keys are written as decimal strings);
- ``Annotated[int, Min(0)]`` and the like (:class:`Min`, :class:`Max`, :class:`OneOf`) for the values it allows,
  wherever the hint sits (an element of a list, a value of a map): :data:`NonNegative`, :data:`Port`,
  :data:`Address`.

What a type hint cannot say is the field's :func:`wire` metadata: the value a missing key reads as
(``missing``, ``missing_from``), a key left out while it holds its default (``omit_default``) or unless another
key is written (``written_with``), a field that is never written (``skip``). A key the record does not know is
ignored (a newer writer's field, a seal's ``mac``); a missing key reads as the field's default, else None for an
optional field, else it is an error.

This module imports only the standard library: the worker side (the channel's messages) and the rendezvous use it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping as AbcMapping
from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar, Self, TypeVar

T = TypeVar("T")


class SchemaError(ValueError):
    """A JSON value that is not a valid value of the expected type (wrong shape, type or version)."""


# --------------------------------------------------------------------------------------------- constraints
@dataclass(frozen=True)
class Min:
    value: int


@dataclass(frozen=True)
class Max:
    value: int


class OneOf:
    """The only values a ``str`` may take."""

    def __init__(self, *values: str) -> None:
        self.values = values

    def __repr__(self) -> str:
        return f"OneOf{self.values!r}"


NonNegative = Annotated[int, Min(0)]
Positive = Annotated[int, Min(1)]
Port = Annotated[int, Min(1), Max(65535)]
Address = tuple[str, Port]      # [host, port]


# --------------------------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Schema:
    """How one type is named and framed: ``SCHEMA`` (a ``ClassVar``) on the dataclass. A type without one is
    named by its class and raises :class:`SchemaError`; nested in another it is named by the path to it."""

    what: str = ""                                  # names it in errors ("taint"); "" names it by its class
    version: int | None = None                      # written first as "v", and read only at this version
    error: type[SchemaError] = SchemaError
    named_by: str | None = None                     # a field whose value names one record in errors (its id)
    check: Callable[[Any], str | None] | None = None   # a rule across fields, after reading: the problem, or None


_NOTHING: Any = object()
_WIRE = "tpassrun.schema"


@dataclass(frozen=True)
class _Wire:
    missing: Any = _NOTHING
    missing_from: str | None = None
    omit_default: bool = False
    written_with: str | None = None
    skip: bool = False


def wire(*, missing: Any = _NOTHING, missing_from: str | None = None, omit_default: bool = False,
         written_with: str | None = None, skip: bool = False) -> dict[str, Any]:
    """A field's metadata (``dataclasses.field(metadata=wire(...))``) for what its type hint cannot say:

    ``missing``: the value an absent key reads as (when the field has no default, or another one);
    ``missing_from``: an absent key reads as the value of that (earlier) field; ``omit_default``: not written
    while it equals its default; ``written_with``: written only when that (earlier) field is; ``skip``: never
    written nor read (a value derived after reading, or the etcd revision a copy was read at)."""
    return {_WIRE: _Wire(missing, missing_from, omit_default, written_with, skip)}


class Record:
    """A base for a dataclass that is a JSON value: its ``to_json`` and ``from_json``, by the one codec."""

    SCHEMA: ClassVar[Schema] = Schema()

    def to_json(self) -> dict[str, Any]:
        return dump(self)

    @classmethod
    def from_json(cls, doc: Any) -> Self:
        return load(cls, doc)


# --------------------------------------------------------------------------------------------- the codec
def dump(value: Any) -> dict[str, Any]:
    """``value`` (a dataclass instance) as a JSON object."""
    return _plan(type(value)).write(value)


def load(cls: type[T], doc: Any, what: str | None = None) -> T:
    """``doc`` read as a ``cls``; ``cls``'s :attr:`Schema.error` for anything it does not accept. ``what`` names
    it in errors instead of its schema's ``what``."""
    plan = _plan(cls)
    try:
        return typing.cast(T, plan.read(doc, what or plan.what, None))
    except _Problem as problem:
        raise plan.schema.error(str(problem)) from None


class _Problem(Exception):
    """Raised while reading, turned into the outermost type's error by :func:`load`."""


# Where a value sits, for an error message: a str, or a tuple formatted only when a message needs it (reading a
# valid record formats nothing): ("in", label, key) a nested object, ("at", key, index) an element, ("named", label,
# name) a record named by one of its fields.
Label = Any
Reader = Callable[[Any, Label, Label], Any]    # (value, label of the object, key) -> the field's value
Writer = Callable[[Any], Any]


def _text(part: Label) -> str:
    if isinstance(part, str):
        return part
    kind, a, b = part
    if kind == "at":
        return f"{_text(a)}[{b}]"
    if kind == "named":
        return f"{_text(a)} {b!r}"
    return f"{_text(a)} {_text(b)}"


def _problem(label: Label, key: Label, text: str) -> _Problem:
    return _Problem(f"{_text(label)}: {_text(key)} {text}")


def _fail(label: Label, key: Label, value: Any, what: str) -> _Problem:
    return _problem(label, key, f"must be {what}, not {value!r:.80}")


class _Plan:
    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.schema: Schema = getattr(cls, "SCHEMA", None) or Schema()
        self.what = self.schema.what or cls.__name__
        hints = typing.get_type_hints(cls, include_extras=True)
        # (name, reader, missing, missing_from, has a default, optional) per field read, in declaration order
        self.reads: list[tuple[str, Reader, Any, str | None, bool, bool]] = []
        # (name, writer or None: as it is, omit_default, default, written_with) per field written
        self.writes: list[tuple[str, Writer | None, bool, Any, str | None]] = []
        seen: set[str] = set()
        for f in dataclasses.fields(cls):
            w = f.metadata.get(_WIRE, _Wire())
            for other in (w.missing_from, w.written_with):
                if other is not None and other not in seen:
                    raise TypeError(f"{cls.__name__}.{f.name}: {other} must be declared before it")
            if w.omit_default and f.default is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{f.name}: omit_default needs a plain default")
            seen.add(f.name)
            if w.skip:
                continue
            hint = hints[f.name]
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            self.reads.append((f.name, _reader(hint), w.missing, w.missing_from, has_default, _is_optional(hint)))
            self.writes.append((f.name, _writer(hint), w.omit_default, f.default, w.written_with))

    def write(self, value: Any) -> dict[str, Any]:
        doc: dict[str, Any] = {} if self.schema.version is None else {"v": self.schema.version}
        for name, write, omit_default, default, written_with in self.writes:
            item = getattr(value, name)
            if (omit_default and item == default) or (written_with is not None and written_with not in doc):
                continue
            doc[name] = item if write is None or item is None else write(item)
        return doc

    def read(self, doc: Any, label: Label, key: Label | None) -> Any:
        if not isinstance(doc, AbcMapping):
            if key is None:
                raise _Problem(f"{_text(label)}: not a JSON object ({type(doc).__name__})")
            raise _fail(label, key, doc, "a JSON object")
        if key is not None:
            label = ("in", label, key)
        version = self.schema.version
        if version is not None and doc.get("v") != version:
            raise _Problem(f"{_text(label)}: schema version {doc.get('v')!r}; this tpassrun reads v{version}")
        if self.schema.named_by is not None:
            label = ("named", label, doc.get(self.schema.named_by))
        kwargs: dict[str, Any] = {}
        get = doc.get
        for name, read, missing, missing_from, has_default, optional in self.reads:
            item = get(name, _NOTHING)
            if item is not _NOTHING:
                kwargs[name] = read(item, label, name)
            elif missing is not _NOTHING:
                kwargs[name] = missing
            elif missing_from is not None and missing_from in kwargs:
                kwargs[name] = kwargs[missing_from]
            elif has_default:
                continue
            elif optional:
                kwargs[name] = None
            else:
                raise _Problem(f"{_text(label)}: {name} is missing")
        value = self.cls(**kwargs)
        if self.schema.check is not None and (why := self.schema.check(value)) is not None:
            raise _Problem(f"{_text(label)}: {why}")
        return value


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        plan = _PLANS[cls] = _Plan(cls)
    return plan


# --------------------------------------------------------------------------------------------- type hints
def _is_optional(hint: Any) -> bool:
    return type(None) in (_union_args(hint) or ())


def _union_args(hint: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return None


def _reader(hint: Any) -> Reader:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _constrained(_reader(args[0]), hint.__metadata__)
    if (union := _union_args(hint)) is not None:
        rest = [a for a in union if a is not type(None)]
        if len(rest) != 1 or len(union) != 2:
            raise TypeError(f"unsupported union {hint!r}: only X | None")
        inner = _reader(rest[0])

        def read_optional(value: Any, label: Label, key: Label) -> Any:
            return None if value is None else inner(value, label, key)
        return read_optional
    if hint is Any:
        return lambda value, label, key: value
    if hint in _SCALARS:
        return _SCALARS[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_reader(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        cls = hint
        return lambda value, label, key: _plan(cls).read(value, label, key)
    if origin in (tuple, list):
        return _sequence_reader(origin, args)
    if origin in (dict, AbcMapping):
        return _mapping_reader(args)
    raise TypeError(f"no JSON form for the type {hint!r}")


def _constrained(inner: Reader, constraints: tuple[Any, ...]) -> Reader:
    least = [c.value for c in constraints if isinstance(c, Min)]
    most = [c.value for c in constraints if isinstance(c, Max)]
    among = [c.values for c in constraints if isinstance(c, OneOf)]

    def read(value: Any, label: Label, key: Label) -> Any:
        value = inner(value, label, key)
        for m in least:
            if value < m:
                raise _problem(label, key, f"must be >= {m}, not {value}")
        for m in most:
            if value > m:
                raise _problem(label, key, f"must be <= {m}, not {value}")
        for values in among:
            if value not in values:
                raise _Problem(f"{_text(label)}: {_text(key)} {value!r} is not one of {', '.join(values)}")
        return value
    return read


def _read_str(value: Any, label: Label, key: Label) -> Any:
    if isinstance(value, str):
        return value
    raise _fail(label, key, value, "a string")


def _read_int(value: Any, label: Label, key: Label) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _fail(label, key, value, "an integer")


def _read_float(value: Any, label: Label, key: Label) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _fail(label, key, value, "a number")


def _read_bool(value: Any, label: Label, key: Label) -> Any:
    if isinstance(value, bool):
        return value
    raise _fail(label, key, value, "true or false")


def _read_hex(value: Any, label: Label, key: Label) -> Any:
    if isinstance(value, str):
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    raise _fail(label, key, value, "a hex string")


_SCALARS: dict[Any, Reader] = {str: _read_str, int: _read_int, float: _read_float, bool: _read_bool, bytes: _read_hex}


def _enum_reader(cls: type[enum.Enum]) -> Reader:
    def read(value: Any, label: Label, key: Label) -> Any:
        try:
            return cls(value)
        except ValueError:
            raise _Problem(f"{_text(label)}: {_text(key)} {value!r:.80} is not one of "
                           f"{', '.join(str(m.value) for m in cls)}") from None
    return read


def _sequence_reader(origin: Any, args: tuple[Any, ...]) -> Reader:
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        items = [_reader(a) for a in args]

        def read_fixed(value: Any, label: Label, key: Label) -> Any:
            if not isinstance(value, list) or len(value) != len(items):
                raise _fail(label, key, value, f"a list of {len(items)}")
            return tuple(read(v, label, ("at", key, i)) for i, (read, v) in enumerate(zip(items, value)))
        return read_fixed
    item = _reader(args[0])
    make: Callable[[Any], Any] = tuple if origin is tuple else list

    def read_sequence(value: Any, label: Label, key: Label) -> Any:
        if not isinstance(value, list):
            raise _fail(label, key, value, "a list")
        return make([item(v, label, ("at", key, i)) for i, v in enumerate(value)])
    return read_sequence


def _mapping_reader(args: tuple[Any, ...]) -> Reader:
    key_type, item = (args[0], _reader(args[1])) if args else (str, _reader(Any))
    if key_type not in (str, int):
        raise TypeError(f"a JSON object's keys are str (or int, written in decimal), not {key_type!r}")

    def read_mapping(value: Any, label: Label, key: Label) -> Any:
        if not isinstance(value, AbcMapping):
            raise _fail(label, key, value, "a JSON object")
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str) or (key_type is int and not k.isdigit()):
                raise _problem(label, key, f"must be keyed by {'ranks' if key_type is int else 'strings'}, "
                                           f"not {k!r:.40}")
            out[int(k) if key_type is int else k] = item(v, label, ("at", key, k))
        return out
    return read_mapping


def _writer(hint: Any) -> Writer | None:
    """How a value of ``hint`` is written (None: as it is; a None value is always written as null)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _writer(args[0])
    if (union := _union_args(hint)) is not None:
        return _writer(next(a for a in union if a is not type(None)))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda value: value.value
    if hint is bytes:
        return bytes.hex
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return dump
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            ws = [_writer(a) for a in args]
            return lambda value: [v if w is None or v is None else w(v) for w, v in zip(ws, value)]
        item = _writer(args[0])
        if item is None:
            return list
        each: Writer = item
        return lambda value: [v if v is None else each(v) for v in value]
    if origin in (dict, AbcMapping):
        item = _writer(args[1]) if args else None
        if args and args[0] is int:
            return lambda value: {str(k): v if item is None or v is None else item(v) for k, v in value.items()}
        if item is None:
            return dict
        every: Writer = item
        return lambda value: {k: v if v is None else every(v) for k, v in value.items()}
    return None


__all__ = ["Address", "Max", "Min", "NonNegative", "OneOf", "Port", "Positive", "Record", "Schema", "SchemaError",
           "dump", "load", "wire"]
