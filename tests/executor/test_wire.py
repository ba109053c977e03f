"""The executor wire: every contract dataclass survives encode -> decode, value and type.

Samples are built from each dataclass's type hints, so a contract that gains a field (or a new
contract in pagedllm/core/outputs.py) is covered without editing this file.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing

import pytest
from executor_helpers import run_loop, workload

from pagedllm.core import outputs
from pagedllm.core.outputs import RunnerOutput, SchedulerOutput
from pagedllm.executor.wire import Codec, contract_types
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams

CODEC = Codec()
POOLING = PoolingParams(task="score", dimensions=8, normalize=False, use_activation=True, truncate_prompt_tokens=-1,
                        extra_kwargs={"compressed_token_type_ids": 5})
STRUCTURED = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": [1, 2]}}},
                                     disable_any_whitespace=True)
SAMPLING = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["\n", "END"],
                          stop_token_ids=[5, 9], max_tokens=20, min_tokens=2, logprobs=3,
                          logit_bias={17: -2.5, 3: 1.0}, output_kind=RequestOutputKind.DELTA)


def _sample(hint, empty: bool, depth: int = 0):
    """A value of type ``hint``: full (one or two items per container) or empty."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return None if empty else _sample(non_none[0], empty, depth)
    if hint is SamplingParams:
        return SamplingParams() if empty else SAMPLING
    if hint is PoolingParams:  # a valid task, so never the generic sample's strings
        return PoolingParams() if empty else POOLING
    if hint is StructuredOutputsParams:  # exactly one kind: never all fields, never none
        return StructuredOutputsParams(regex="[0-9]+") if empty else STRUCTURED
    if dataclasses.is_dataclass(hint):
        return _build(hint, empty, depth + 1)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return list(hint)[-1]
    if hint is typing.Any:
        return None
    simple = {int: 7, float: -0.25, str: "req-1", bool: True, bytes: b"\x00\xff"}
    if hint in simple:
        return simple[hint]
    if origin is list:
        return [] if empty else [_sample(args[0], False, depth), _sample(args[0], True, depth)]
    if origin in (set, frozenset):
        return origin() if empty else origin([_sample(args[0], False, depth)])
    if origin is dict:
        return {} if empty else {_sample(args[0], False, depth): _sample(args[1], False, depth)}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return () if empty else (_sample(args[0], False, depth),) * 2
        return tuple(_sample(a, empty, depth) for a in args)
    raise AssertionError(f"no sample for {hint!r}: teach _sample this type")


def _build(cls: type, empty: bool, depth: int = 0):
    hints = typing.get_type_hints(cls)
    values = {f.name: _sample(hints[f.name], empty, depth) for f in dataclasses.fields(cls) if f.init}
    return cls(**values)


def assert_same(a, b, path: str = "value") -> None:
    """Equal, and of the same type all the way down (a tuple stays a tuple, a set a set)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} became {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    else:
        assert a == b, path


def round_trip(obj):
    return CODEC.decode(CODEC.encode(obj))


CONTRACTS = [t for t in contract_types() if dataclasses.is_dataclass(t) and t is not SamplingParams]


def test_every_outputs_dataclass_is_registered():
    found = {t for t in vars(outputs).values() if dataclasses.is_dataclass(t) and isinstance(t, type)}
    assert found <= set(contract_types())
    assert {SchedulerOutput, RunnerOutput} <= found


@pytest.mark.parametrize("empty", [False, True], ids=["full", "empty"])
@pytest.mark.parametrize("cls", CONTRACTS, ids=lambda c: c.__name__)
def test_contract_round_trip(cls, empty):
    obj = _sample(cls, empty) if cls in (StructuredOutputsParams, PoolingParams) else _build(cls, empty)
    back = round_trip(obj)
    assert back == obj
    assert_same(obj, back)


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLING,
                                    SamplingParams(temperature=0.0, stop="x", max_tokens=None)])
def test_sampling_params_round_trip(params):
    back = round_trip(params)
    assert_same(params, back)
    assert back.all_stop_token_ids == params.all_stop_token_ids
    assert back.output_kind is params.output_kind
    assert back.clone(n=1) == params.clone(n=1)  # still a working SamplingParams


def test_real_scheduler_outputs_round_trip():
    """What the scheduler really emits (new requests, cached diffs, prefix hits, preemption)."""
    from pagedllm.executor.uniproc import UniProcExecutor
    from pagedllm.runner.fake import FakeRunner

    class Recording(UniProcExecutor):
        def execute_model(self, so):
            assert_same(so, round_trip(so), "SchedulerOutput")
            ro = super().execute_model(so)
            assert_same(ro, round_trip(ro), "RunnerOutput")
            return ro

    tokens, ros = run_loop(Recording(FakeRunner(vocab_size=1000)))
    assert len(tokens) == len(workload()) and len(ros) > 5


def test_plain_values_and_nesting():
    value = {"ids": [1, 2, 3], 4: (5, frozenset({6})), "none": None, "f": 1.5, "nested": [[], [{}]],
             "sets": [set(), {("a", 1)}], "bytes": b"\x01"}
    assert_same(value, round_trip(value))


def test_unregistered_type_is_refused():
    @dataclasses.dataclass
    class Stranger:
        x: int = 1

    with pytest.raises(TypeError, match="cannot encode .*Stranger"):
        CODEC.encode(Stranger())
    with pytest.raises(ValueError, match="unregistered type"):
        CODEC.decode(Codec([Stranger]).encode(Stranger()))
