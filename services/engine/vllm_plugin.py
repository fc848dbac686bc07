"""PrfaaS's vLLM plugin (entry point ``vllm.general_plugins``: vLLM loads it in each of its processes).

It lets a request that moved to another worker keep its structured-output constraint from where it
stood: vLLM compiles a request's grammar when the request arrives and advances it only over tokens
the engine samples, so a continuation, whose earlier tokens arrive as prompt, would start the grammar
over. A request whose ``extra_args`` carry ``GRAMMAR_PREFIX_KEY`` (the tokens generated before the
move; services/engine/engine.py sets it) has its freshly compiled grammar advanced over them first,
by vLLM's own backend (xgrammar by default). Tokens the grammar refuses fail the request, as any
grammar error does. Requests without the key are untouched, so the plugin is inert for everything
else, vLLM's own server included.
"""
from __future__ import annotations

GRAMMAR_PREFIX_KEY = "prfaas_grammar_prefix"


def register() -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    if getattr(StructuredOutputManager._create_grammar, "_prfaas", False):
        return  # loaded twice in one process
    create = StructuredOutputManager._create_grammar

    def _create_grammar(self, request):
        grammar = create(self, request)
        params = request.sampling_params
        prefix = (params.extra_args or {}).get(GRAMMAR_PREFIX_KEY) if params is not None else None
        if prefix and not grammar.accept_tokens(request.request_id, list(prefix)):
            raise ValueError(f"request {request.request_id}: the tokens generated before it moved do not satisfy "
                             "its structured-output grammar")
        return grammar

    _create_grammar._prfaas = True
    StructuredOutputManager._create_grammar = _create_grammar
