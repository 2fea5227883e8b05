"""A body that does not validate gets a 400 that says where and what in the client's terms: `sampling_params[0]`,
not the union members pydantic tried (`sampling_params.list[SamplingFields]`), and its own wording only where
it already speaks plainly."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.server.schemas import ChatCompletionRequest, CompletionRequest, GenerateReqInput
from pdserve.server.validation_errors import MAX_PROBLEMS, validation_problems

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def problems(model, body) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return validation_problems(caught.value.errors())


@pytest.mark.parametrize("model, body, expected", [
    (GenerateReqInput, {"text": "x", "sampling_params": 5}, "sampling_params: must be an object or a list of objects"),
    (GenerateReqInput, {"text": "x", "sampling_params": {"temperature": "hot"}},
     "sampling_params.temperature: should be a valid number, unable to parse string as a number"),
    (GenerateReqInput, {"text": "x", "sampling_params": [{}, {"top_k": []}]},
     "sampling_params[1].top_k: should be a valid integer"),
    (GenerateReqInput, {"text": 5}, "text: must be a string or a list of strings"),
    (GenerateReqInput, {"text": "x", "rid": 5}, "rid: must be a string or a list of strings"),
    (GenerateReqInput, {"input_ids": [1, "a"]},
     "input_ids[1]: should be a valid integer, unable to parse string as an integer"),
    (GenerateReqInput, {"input_ids": [[1], [True, "b"]]},
     "input_ids[1][1]: should be a valid integer, unable to parse string as an integer"),
    (GenerateReqInput, {"text": "x", "max_new_tokenz": 3}, "max_new_tokenz: is not a field of this request"),
    (GenerateReqInput, [1], "the body: should be a JSON object"),
    (ChatCompletionRequest, {**CHAT, "messages": []}, "messages: must not be empty"),
    (ChatCompletionRequest, {"messages": CHAT["messages"]}, "model: is required"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": 5}]},
     "messages[0].content: must be a string or a list of objects"),
    (ChatCompletionRequest, {**CHAT, "tool_choice": 5},
     "tool_choice: must be one of 'none', 'auto' or 'required' or an object"),
    (ChatCompletionRequest, {**CHAT, "stream_options": 1}, "stream_options: should be a JSON object"),
    (CompletionRequest, {"model": "m", "prompt": {"a": 1}},
     "prompt: must be a string, a list of strings, a list of integers or a list of lists of integers"),
])
def test_the_problem_is_named_in_the_clients_terms(model, body, expected):
    assert problems(model, body) == [expected]


def test_every_problem_of_a_body_is_named_up_to_a_bound():
    body = {"model": "m", "messages": [{"role": "bot"}], "n": 0, "top_k": "a", "stop": [1], "seed": "s", "user": 2}
    found = problems(ChatCompletionRequest, body)
    assert len(found) == MAX_PROBLEMS
    assert {"n: should be greater than or equal to 1", "stop[0]: should be a valid string"} <= set(found)
    assert len(problems(ChatCompletionRequest, {**body, "n": 1, "top_k": 1})) == MAX_PROBLEMS - 1
