"""The wire between the engine and its worker processes: msgpack, with dataclasses as data.

The contracts (``SchedulerOutput``, ``RunnerOutput``, ``SamplingParams``...) are plain
dataclasses of ints, strings, lists, dicts and sets. msgpack packs the native values in C; the
few types it does not know (dataclasses, sets, frozensets, tuples, IntEnums) reach ``_default``
and travel as msgpack extension types:

* a dataclass: its class name and a map of field name -> value, rebuilt only if the class is in
  the codec's registry (the wire never builds an arbitrary type, unlike pickle);
* set / frozenset / tuple: their items, so they come back as the same container;
* an IntEnum of the registry: its class name and value.

The codec is generic over dataclasses rather than written per class, so a contract can gain or
lose fields without touching this file: both ends run the same code.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Iterable

import msgpack

from pagedllm.core import outputs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

_EXT_DATACLASS = 1
_EXT_SET = 2
_EXT_FROZENSET = 3
_EXT_TUPLE = 4
_EXT_ENUM = 5


def contract_types() -> list[type]:
    """Every dataclass of ``pagedllm.core.outputs`` (found, not listed, so new contracts join by
    themselves), plus what they carry from elsewhere."""
    found = [obj for obj in vars(outputs).values()
             if isinstance(obj, type) and dataclasses.is_dataclass(obj)
             and obj.__module__ == outputs.__name__]
    return [*found, SamplingParams, RequestOutputKind]


class Codec:
    """``encode(obj) -> bytes`` and ``decode(bytes) -> obj`` for the registered types.

    One codec per thread: its packer keeps a buffer between calls.
    """

    def __init__(self, types: Iterable[type] | None = None) -> None:
        self._types: dict[str, type] = {}
        self._field_names: dict[type, tuple[str, ...]] = {}
        for cls in contract_types() if types is None else types:
            assert cls.__qualname__ not in self._types, f"two wire types named {cls.__qualname__}"
            self._types[cls.__qualname__] = cls
            if dataclasses.is_dataclass(cls):
                self._field_names[cls] = tuple(f.name for f in dataclasses.fields(cls))
            else:
                assert issubclass(cls, enum.IntEnum), f"{cls} is neither a dataclass nor an IntEnum"
        # strict_types: subclasses of native types (IntEnum is an int) and tuples reach
        # _default instead of being flattened, so they come back as what they were.
        self._packer = msgpack.Packer(default=self._default, strict_types=True)

    def encode(self, obj: Any) -> bytes:
        return self._packer.pack(obj)

    def decode(self, data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=self._ext_hook, strict_map_key=False)

    # -- encoding ---------------------------------------------------------------------------
    def _pack_nested(self, payload: Any) -> bytes:
        # The outer packer is busy (we are inside its call): a small one for the payload.
        return msgpack.Packer(default=self._default, strict_types=True, buf_size=256).pack(payload)

    def _default(self, obj: Any) -> msgpack.ExtType:
        cls = type(obj)
        names = self._field_names.get(cls)
        if names is not None:
            values = {name: getattr(obj, name) for name in names}
            return msgpack.ExtType(_EXT_DATACLASS, self._pack_nested([cls.__qualname__, values]))
        if cls is set:
            return msgpack.ExtType(_EXT_SET, self._pack_nested(list(obj)))
        if cls is frozenset:
            return msgpack.ExtType(_EXT_FROZENSET, self._pack_nested(list(obj)))
        if cls is tuple:
            return msgpack.ExtType(_EXT_TUPLE, self._pack_nested(list(obj)))
        if isinstance(obj, enum.IntEnum) and self._types.get(cls.__qualname__) is cls:
            return msgpack.ExtType(_EXT_ENUM, self._pack_nested([cls.__qualname__, int(obj)]))
        raise TypeError(f"the executor wire cannot encode {cls.__module__}.{cls.__qualname__}: "
                        f"contracts carry plain data; register the type in pagedllm.executor.wire")

    # -- decoding ---------------------------------------------------------------------------
    def _ext_hook(self, code: int, data: bytes) -> Any:
        payload = self.decode(data)
        if code == _EXT_DATACLASS:
            name, values = payload
            cls = self._lookup(name)
            # Rebuild without __init__: the values were validated when first built (running
            # SamplingParams.__post_init__ again would cost every step), and frozen or slotted
            # dataclasses take object.__setattr__ alike.
            obj = cls.__new__(cls)
            for key, value in values.items():
                object.__setattr__(obj, key, value)
            return obj
        if code == _EXT_SET:
            return set(payload)
        if code == _EXT_FROZENSET:
            return frozenset(payload)
        if code == _EXT_TUPLE:
            return tuple(payload)
        if code == _EXT_ENUM:
            name, value = payload
            return self._lookup(name)(value)
        raise ValueError(f"unknown msgpack extension code {code} on the executor wire")

    def _lookup(self, name: str) -> Callable[..., Any]:
        cls = self._types.get(name)
        if cls is None:
            raise ValueError(f"the executor wire received an unregistered type {name!r}")
        return cls
