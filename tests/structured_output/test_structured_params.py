"""StructuredOutputsParams: vLLM's fields, exactly one kind, errors naming the field; it rides
on SamplingParams (clone, validation) and over the executor wire with the step's bitmask."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.errors import ValidationError
from pagedllm.executor.wire import Codec
from pagedllm.structured_output.grammar import grammar_source


@pytest.mark.parametrize("kwargs", [
    {}, {"regex": "a", "choice": ["b"]}, {"json": {"type": "object"}, "json_object": True},
    {"json": "{not json"}, {"json": [1, 2]}, {"regex": ""}, {"choice": []}, {"choice": ["a", 3]},
    {"grammar": 5}, {"json_object": "yes"}, {"regex": "\ud800"},
])
def test_bad_params_name_the_field(kwargs):
    with pytest.raises(ValidationError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == "structured_outputs"


def test_kinds_and_keys():
    assert StructuredOutputsParams(json='{"type": "string"}').json == {"type": "string"}
    assert StructuredOutputsParams(choice=("a", "b")).kind == "choice"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    a = StructuredOutputsParams(json={"a": 1, "b": 2})
    b = StructuredOutputsParams(json='{"b": 2, "a": 1}')
    assert a.key == b.key != StructuredOutputsParams(json={"a": 1, "b": 2}, disable_any_whitespace=True).key


def test_sampling_params_carry_it():
    so = StructuredOutputsParams(regex="[0-9]+")
    p = SamplingParams(n=2, structured_outputs=so)
    assert p.clone(n=1).structured_outputs is so
    with pytest.raises(ValidationError) as e:
        SamplingParams(structured_outputs={"regex": "a"})
    assert e.value.param == "structured_outputs"


@pytest.mark.parametrize("kwargs, word", [
    ({"regex": "a(b"}, "regex"), ({"regex": "[z-a]"}, "regex"),
    ({"json": {"type": "frobnicate"}}, "json"), ({"grammar": "start: (("}, "grammar"),
    ({"grammar": "root ::= ("}, "grammar"),
])
def test_invalid_constraints_are_validation_errors(kwargs, word):
    with pytest.raises(ValidationError) as e:
        grammar_source(StructuredOutputsParams(**kwargs))
    assert e.value.param == "structured_outputs" and word in e.value.message


def test_the_wire_carries_params_and_bitmask():
    codec = Codec()
    so = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    params = SamplingParams(structured_outputs=so)
    out = SchedulerOutput([NewRequestData("r", [1, 2], [], params, [0], 0)], CachedRequestData(),
                          {"r": 2}, 2, grammar_bitmask={"r": b"\xff\x00\x01\x02" * 17})
    back = codec.decode(codec.encode(out))
    assert back.grammar_bitmask == out.grammar_bitmask
    assert back.scheduled_new_reqs[0].sampling_params.structured_outputs == so
