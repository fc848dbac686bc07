"""The plugin's wrapper of vLLM's grammar compilation: a moved request's grammar is advanced over the
tokens it generated before the move; every other request's grammar is left as compiled."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.engine.vllm_plugin import GRAMMAR_PREFIX_KEY, register


class RecordedGrammar:
    def __init__(self, accepts: bool = True) -> None:
        self.accepts = accepts
        self.accepted: list[tuple[str, list[int]]] = []

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        self.accepted.append((request_id, tokens))
        return self.accepts


@pytest.fixture
def create_grammar(monkeypatch):
    """vLLM's ``_create_grammar`` as the plugin leaves it, over a compiler that returns ``grammar``."""
    from vllm.v1.structured_output import StructuredOutputManager

    grammar = RecordedGrammar()
    monkeypatch.setattr(StructuredOutputManager, "_create_grammar", lambda self, request: grammar)
    register()
    register()  # vLLM may load a plugin twice in one process: wrapped once
    return lambda request: (StructuredOutputManager._create_grammar(None, request), grammar)


def _request(extra_args=None, with_params: bool = True):
    params = SimpleNamespace(extra_args=extra_args) if with_params else None
    return SimpleNamespace(request_id="r1-m1", sampling_params=params)


def test_a_moved_requests_grammar_is_advanced_over_its_earlier_tokens(create_grammar):
    compiled, grammar = create_grammar(_request({GRAMMAR_PREFIX_KEY: (5, 6, 7), "other": 1}))
    assert compiled is grammar
    assert grammar.accepted == [("r1-m1", [5, 6, 7])]


@pytest.mark.parametrize("request_", [_request(), _request({"other": 1}), _request({GRAMMAR_PREFIX_KEY: []}),
                                      _request(with_params=False)])
def test_other_requests_grammars_are_left_as_compiled(create_grammar, request_):
    compiled, grammar = create_grammar(request_)
    assert compiled is grammar and grammar.accepted == []


def test_earlier_tokens_the_grammar_refuses_fail_the_request(create_grammar):
    grammar = create_grammar(_request())[1]
    grammar.accepts = False
    with pytest.raises(ValueError, match="r1-m1.*do not satisfy its structured-output grammar"):
        create_grammar(_request({GRAMMAR_PREFIX_KEY: [1, 2]}))
