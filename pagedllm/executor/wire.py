"""The wire between the engine and its worker processes: msgpack, with dataclasses as data.

The contracts (``SchedulerOutput``, ``RunnerOutput``, ``SamplingParams``...) are plain
dataclasses of ints, strings, lists, dicts and sets. msgpack packs the native values in C; the
few types it does not know (dataclasses, sets, frozensets, tuples, IntEnums) reach ``_default``,
which turns each into a *tagged array*: a one-item msgpack extension naming the type, then the
values, which msgpack goes on packing natively:

    dataclass          [tag "NewRequestData", req_id, prompt_token_ids, ...]   (fields in order)
    set/frozenset/tuple [tag "set", item, item, ...]
    IntEnum            [tag "RequestOutputKind", value]

Decoding, the tag comes back as a ``_Tag`` and ``list_hook`` rebuilds the object from its array
(inner arrays first, so nesting needs nothing special). Only the registry's types are ever built:
unlike pickle, the wire cannot be made to construct an arbitrary class. The codec is generic
over dataclasses, not written per class, so a contract can gain or lose fields without touching
this file (both ends run the same code, so the field order is the same on both).
"""
from __future__ import annotations

import dataclasses
import enum
import operator
from typing import Any, Callable, Iterable

import msgpack

from pagedllm.core import outputs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams

_EXT_TAG = 1
_CONTAINERS: dict[type, Callable[[list], Any]] = {set: set, frozenset: frozenset, tuple: tuple}


def contract_types() -> list[type]:
    """Every pagedllm dataclass in ``pagedllm.core.outputs``' namespace, defined there or
    imported for a field (found, not listed, so new contracts join by themselves), plus what
    SamplingParams carries (its enum, its structured-outputs constraint)."""
    found = [obj for obj in vars(outputs).values()
             if isinstance(obj, type) and dataclasses.is_dataclass(obj)
             and obj.__module__.startswith("pagedllm.")]
    return list(dict.fromkeys([*found, SamplingParams, StructuredOutputsParams, RequestOutputKind]))


class _Tag:
    """A decoded type tag: knows how to build its type from the values that follow it."""
    __slots__ = ("build",)

    def __init__(self, build: Callable[[list], Any]) -> None:
        self.build = build


def _dataclass_builder(cls: type, names: tuple[str, ...]) -> Callable[[list], Any]:
    positional = all(f.init and not f.kw_only for f in dataclasses.fields(cls))
    if positional and not hasattr(cls, "__post_init__"):
        return lambda values: cls(*values)  # the generated __init__: assignments only
    # Otherwise around __init__: the values were validated when first built (SamplingParams'
    # __post_init__ again would cost every step); frozen classes take these writes too.
    new = object.__new__
    if "__slots__" not in cls.__dict__:
        def build(values: list) -> Any:
            obj = new(cls)
            obj.__dict__.update(zip(names, values))
            return obj
        return build

    def build_slotted(values: list) -> Any:
        obj = new(cls)
        for name, value in zip(names, values):
            object.__setattr__(obj, name, value)
        return obj
    return build_slotted


class Codec:
    """``encode(obj) -> bytes`` and ``decode(bytes) -> obj`` for the registered types.

    One codec per thread: its packer keeps a buffer between calls.
    """

    def __init__(self, types: Iterable[type] | None = None) -> None:
        self._field_getters: dict[type, Callable[[Any], tuple]] = {}
        self._headers: dict[type, msgpack.ExtType] = {}
        self._tags: dict[bytes, _Tag] = {}
        for cls, build in _CONTAINERS.items():
            self._register(cls, cls.__name__, build)
        for cls in contract_types() if types is None else types:
            if dataclasses.is_dataclass(cls):
                names = tuple(f.name for f in dataclasses.fields(cls))
                # attrgetter reads every field in C; a lone field comes back bare, not in a tuple.
                getter = operator.attrgetter(*names) if names else (lambda obj: ())
                self._field_getters[cls] = ((lambda obj, get=getter: (get(obj),))
                                            if len(names) == 1 else getter)
                self._register(cls, cls.__qualname__, _dataclass_builder(cls, names))
            else:
                assert issubclass(cls, enum.IntEnum), f"{cls} is neither a dataclass nor an IntEnum"
                members = {int(m): m for m in cls}  # faster than calling the enum class
                self._register(cls, cls.__qualname__, lambda values, members=members: members[values[0]])
        # strict_types: subclasses of native types (an IntEnum is an int) and tuples reach
        # _default instead of being flattened, so they come back as what they were.
        self._packer = msgpack.Packer(default=self._default, strict_types=True)

    def _register(self, cls: type, name: str, build: Callable[[list], Any]) -> None:
        key = name.encode()
        assert key not in self._tags, f"two wire types named {name}"
        self._headers[cls] = msgpack.ExtType(_EXT_TAG, key)
        self._tags[key] = _Tag(build)

    def encode(self, obj: Any) -> bytes:
        return self._packer.pack(obj)

    def decode(self, data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=self._ext_hook, list_hook=self._list_hook,
                               strict_map_key=False)

    def _default(self, obj: Any) -> list:
        cls = type(obj)
        header = self._headers.get(cls)
        if header is None:
            raise TypeError(f"the executor wire cannot encode {cls.__module__}.{cls.__qualname__}: "
                            f"contracts carry plain data; register the type in pagedllm.executor.wire")
        get_fields = self._field_getters.get(cls)
        if get_fields is not None:
            return [header, *get_fields(obj)]
        if cls in _CONTAINERS:
            return [header, *obj]
        return [header, int(obj)]  # an IntEnum

    def _ext_hook(self, code: int, data: bytes) -> _Tag:
        tag = self._tags.get(data) if code == _EXT_TAG else None
        if tag is None:
            raise ValueError(f"the executor wire received an unregistered type {data!r} (code {code})")
        return tag

    @staticmethod
    def _list_hook(items: list) -> Any:
        if items and type(items[0]) is _Tag:
            return items[0].build(items[1:])
        return items
