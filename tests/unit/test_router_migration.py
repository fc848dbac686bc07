"""A decode worker that fails mid-stream: the router moves the request to another worker with the
tokens generated so far, and the client's stream goes on as if nothing happened.

The workers here are real in-process gRPC servers whose "model" is a pure function of the sequence
so far (as greedy decoding is), so an uninterrupted run is the reference."""
import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from prfaas.v1 import worker_pb2 as wpb
from prfaas.v1 import worker_pb2_grpc as wpb_grpc

from services.config import parse_config
from services.router.continuation import Continuation, StopScan
from services.router.dispatch import Dispatcher
from services.router.metrics import RouterMetrics
from services.router.placement import Placement
from services.router.workers import WorkerFailed, WorkerPool
from services.scheduling.congestion import FixedThreshold
from services.security import GrpcSecurity
from services.worker_api.types import GenerateInput, Sampling, TokenDelta

PROMPT = [11, 12, 13]


def next_token(sequence: list[int]) -> int:
    return (len(sequence) * 7 + sequence[-1]) % 26


def text_of(token_ids) -> str:
    return "".join(chr(ord("a") + t) for t in token_ids)


def detokenize(context, new_ids) -> str:
    return text_of(new_ids)


def reference(num_tokens: int) -> list[int]:
    sequence = list(PROMPT)
    for _ in range(num_tokens):
        sequence.append(next_token(sequence))
    return sequence[len(PROMPT):]


class Worker(wpb_grpc.DecodeWorkerServicer):
    """Generates ``max_tokens`` tokens; ``fail_after``: abort (UNAVAILABLE) after that many, or hang
    there when ``hang``. Holds back the last ``len(longest stop) - 1`` characters, as vLLM does."""

    def __init__(self, fail_after: int | None = None, hang: bool = False, aborts: bool = False) -> None:
        self.fail_after = fail_after
        self.hang = hang
        self.aborts = aborts  # end with vLLM's finish_reason "abort" instead (its engine dropped the request)
        self.requests: list[wpb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        sequence = list(request.prompt_token_ids)
        hold = max((len(s) for s in request.sampling.stop), default=1) - 1
        text = sent = ""
        for i in range(request.sampling.max_tokens):
            if self.fail_after is not None and i == self.fail_after:
                if self.hang:
                    await asyncio.sleep(3600)
                if self.aborts:
                    yield wpb.GenerateResponse(finish_reason="abort", num_prompt_tokens=len(request.prompt_token_ids))
                    return
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")
            token = next_token(sequence)
            sequence.append(token)
            text += text_of([token])
            last = i == request.sampling.max_tokens - 1
            stop = next((s for s in request.sampling.stop if s in text), None)
            if stop is not None:
                yield wpb.GenerateResponse(text=text[len(sent):text.index(stop)], token_ids=[token],
                                           finish_reason="stop", num_prompt_tokens=len(request.prompt_token_ids))
                return
            visible = text if last else text[:max(0, len(text) - hold)]
            yield wpb.GenerateResponse(text=visible[len(sent):], token_ids=[token],
                                       finish_reason="length" if last else "",
                                       num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=2)
            sent = visible
            await asyncio.sleep(0)


async def _serve(servicer, security):
    server = grpc.aio.server(options=security.options)
    wpb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = security.add_port(server, "127.0.0.1:0")
    await server.start()
    return server, port


async def _run(workers: list[Worker], sampling: Sampling, router: dict | None = None, hang_poll: bool = False):
    security = GrpcSecurity()
    servers = [await _serve(w, security) for w in workers]
    config = parse_config({"model": {"name": "m", "path": "/m"}, "router": {"stats_interval_s": 0.05, **(router or {})},
                           "workers": [{"name": f"d{i}", "service": "decode_worker", "role": "both", "port": port}
                                       for i, (_, port) in enumerate(servers)]})
    metrics = RouterMetrics()
    pool = WorkerPool(config.workers, config.router, metrics, security=security)
    for i, handle in enumerate(pool.handles):
        handle.healthy = True
        handle.num_in_flight = i  # d0 is the least loaded: the request starts there
    placement = Placement(config, pool, metrics, threshold=FixedThreshold(1e9))
    dispatcher = Dispatcher(pool, config.router, metrics, placement, detokenize=detokenize)
    deltas: list[TokenDelta] = []
    error = None
    try:
        stream = dispatcher.generate(GenerateInput("r", list(PROMPT), sampling))
        try:
            async for delta in stream:
                deltas.append(delta)
                if hang_poll and len(deltas) == workers[0].fail_after:
                    pool.handle("d0").num_unanswered_polls = 2  # its polls go unanswered from here
        except WorkerFailed as exc:
            error = exc
    finally:
        await pool.close()
        for server, _ in servers:
            await server.stop(0)
    return deltas, error, metrics


def _migrations(metrics, reason, outcome) -> float:
    return metrics.migrations.labels(reason, outcome)._value.get()


def test_a_greedy_stream_continues_token_exact_on_another_worker():
    workers = [Worker(fail_after=5), Worker()]
    deltas, error, metrics = asyncio.run(_run(workers, Sampling(max_tokens=12, temperature=0.0)))
    assert error is None
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == reference(12)
    assert "".join(d.text for d in deltas) == text_of(reference(12))
    assert deltas[-1].finish_reason == "length"
    # the second worker got the prompt plus the 5 tokens, the remaining budget and the same settings
    moved = workers[1].requests[0]
    assert list(moved.prompt_token_ids) == PROMPT + reference(5) and moved.sampling.max_tokens == 7
    assert moved.sampling.temperature == 0.0 and moved.request_id == "r-m1"
    # the client's counts are the original request's
    assert {d.num_prompt_tokens for d in deltas} == {len(PROMPT)} and {d.num_cached_tokens for d in deltas} == {2}
    assert _migrations(metrics, "unavailable", "resumed") == 1


def test_a_worker_that_stops_answering_mid_stream_is_left_and_the_request_moves():
    workers = [Worker(fail_after=4, hang=True), Worker()]
    deltas, error, metrics = asyncio.run(_run(workers, Sampling(max_tokens=9), hang_poll=True))
    assert error is None and [t for d in deltas for t in d.token_ids] == reference(9)
    assert _migrations(metrics, "unanswered_polls", "resumed") == 1


def test_a_stop_string_that_straddles_the_move_ends_the_stream_there():
    ref = text_of(reference(20))
    stop = ref[6:9]  # begins in the 5 tokens the first worker made (its text held back), ends after the move
    assert stop not in ref[:8]
    workers = [Worker(fail_after=8), Worker()]
    deltas, error, _ = asyncio.run(_run(workers, Sampling(max_tokens=20, stop=(stop,))))
    assert error is None
    assert "".join(d.text for d in deltas) == ref[:6]
    assert deltas[-1].finish_reason == "stop"


def test_held_back_text_reaches_the_client_after_a_move():
    workers = [Worker(fail_after=6), Worker()]
    deltas, _, _ = asyncio.run(_run(workers, Sampling(max_tokens=10, stop=("zzzzz",))))
    assert "".join(d.text for d in deltas) == text_of(reference(10))


def test_moves_are_bounded_and_the_last_failure_reaches_the_client():
    workers = [Worker(fail_after=2), Worker(fail_after=2), Worker()]
    deltas, error, metrics = asyncio.run(_run(workers, Sampling(max_tokens=10), router={"max_migrations": 1}))
    assert isinstance(error, WorkerFailed) and "mid-request" in str(error)
    assert [t for d in deltas for t in d.token_ids] == reference(4)
    assert _migrations(metrics, "unavailable", "resumed") == 1 and _migrations(metrics, "unavailable", "limit") == 1


def test_when_no_worker_is_left_the_stream_ends_with_one_error():
    deltas, error, metrics = asyncio.run(_run([Worker(fail_after=3)], Sampling(max_tokens=10)))
    assert isinstance(error, WorkerFailed) and "no worker could continue" in str(error)
    assert len(deltas) == 3 and _migrations(metrics, "unavailable", "failed") == 1


def test_migration_off_ends_the_request_as_before():
    deltas, error, metrics = asyncio.run(_run([Worker(fail_after=3), Worker()], Sampling(max_tokens=10),
                                              router={"max_migrations": 0}))
    assert isinstance(error, WorkerFailed) and len(deltas) == 3
    assert _migrations(metrics, "unavailable", "limit") == 1


# The bookkeeping alone ------------------------------------------------------------------------

def _delta(text: str, token_ids=(1,), finish_reason=None) -> TokenDelta:
    return TokenDelta(text, tuple(token_ids), finish_reason, 3, 0)


def test_the_budget_left_and_the_next_request():
    progress = Continuation(GenerateInput("r", [1, 2], Sampling(max_tokens=3, seed=5, stop=("x",))))
    progress.record(_delta("a", (7,)))
    following = progress.next_input()
    assert following.prompt_token_ids == [1, 2, 7] and following.sampling.max_tokens == 2
    assert following.sampling.seed == 5 and following.sampling.stop == ("x",)
    progress.record(_delta("bc", (8, 9)))
    assert progress.next_input() is None  # every token is out


def test_held_text_is_what_the_tokens_say_beyond_what_was_sent():
    progress = Continuation(GenerateInput("r", [1], Sampling(max_tokens=9)), detokenize)
    progress.record(_delta("a", (0, 1)))
    assert progress.held_text() == "b"
    assert Continuation(GenerateInput("r", [1], Sampling(max_tokens=9))).held_text() == ""  # no detokenizer


@pytest.mark.parametrize("pieces, stop, sent, finish", [
    (["cd", "ef"], "bcd", "a", "stop"),        # the stop string begins in the pending text
    (["c", "d", "e"], "cde", "ab", "stop"),    # it arrives a character at a time
    (["cd", "ef"], "zz", "abcdef", "length"),  # none: everything goes out by the end
])
def test_stop_strings_over_the_move(pieces, stop, sent, finish):
    scan = StopScan((stop,), "ab")
    out = [scan.feed(_delta(p, finish_reason="length" if i == len(pieces) - 1 else None))
           for i, p in enumerate(pieces)]
    out = out[:next((i + 1 for i, d in enumerate(out) if d.finish_reason == "stop"), len(out))]
    assert "".join(d.text for d in out) == sent and out[-1].finish_reason == finish


class Prefill(wpb_grpc.PrefillWorkerServicer):
    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def Prefill(self, request, context):
        self.done.set()
        return wpb.PrefillResponse(num_prompt_tokens=len(request.prompt_token_ids))


class DiesWhenKvArrives(Worker):
    """A decode worker that dies after the prefill worker streamed it the KV, before the first token."""

    def __init__(self, prefill: Prefill) -> None:
        super().__init__()
        self.prefill = prefill

    async def Generate(self, request, context):
        self.requests.append(request)
        await self.prefill.done.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")
        yield wpb.GenerateResponse()  # never reached: makes this a stream handler


def test_on_the_prfaas_path_a_decode_worker_dying_before_the_first_token_costs_no_request():
    async def run():
        security = GrpcSecurity()
        prefill = Prefill()
        dying, healthy = DiesWhenKvArrives(prefill), Worker()
        servers = []
        for servicer in (dying, healthy):
            servers.append(await _serve(servicer, security))
        prefill_server = grpc.aio.server(options=security.options)
        wpb_grpc.add_PrefillWorkerServicer_to_server(prefill, prefill_server)
        prefill_port = security.add_port(prefill_server, "127.0.0.1:0")
        await prefill_server.start()
        config = parse_config({
            "model": {"name": "m", "path": "/m"}, "router": {"stats_interval_s": 0.05},
            "workers": [{"name": "d0", "service": "decode_worker", "role": "both", "port": servers[0][1],
                         "kv_port": 1},
                        {"name": "d1", "service": "decode_worker", "role": "both", "port": servers[1][1],
                         "kv_port": 2},
                        {"name": "p", "service": "prefill_worker", "cluster": "prfaas", "port": prefill_port}]})
        metrics = RouterMetrics()
        pool = WorkerPool(config.workers, config.router, metrics, security=security)
        for handle in pool.handles:
            handle.healthy = True
        pool.handle("d1").num_in_flight = 1  # d0 first
        dispatcher = Dispatcher(pool, config.router, metrics,
                                Placement(config, pool, metrics, threshold=FixedThreshold(1)))
        try:
            deltas = [d async for d in dispatcher.generate(GenerateInput("r", list(PROMPT), Sampling(max_tokens=6)))]
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(0)
            await prefill_server.stop(0)
        return deltas, dying, healthy, metrics
    deltas, dying, healthy, metrics = asyncio.run(run())
    assert [t for d in deltas for t in d.token_ids] == reference(6)
    assert len(dying.requests) == 1 and dying.requests[0].kv_source.transfer_id  # it was the PrfaaS path
    assert len(healthy.requests) == 1 and metrics.worker_retries._value.get() == 1


def test_a_worker_that_aborts_mid_stream_is_a_failure_and_the_request_moves_on():
    """vLLM ends a request its engine dropped (a worker stopping past its drain) with finish_reason
    "abort", which no OpenAI client knows: the router never passes it on as an answer."""
    workers = [Worker(fail_after=5, aborts=True), Worker()]
    deltas, error, metrics = asyncio.run(_run(workers, Sampling(max_tokens=12, temperature=0.0)))
    assert error is None
    assert [t for d in deltas for t in d.token_ids] == reference(12)
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert _migrations(metrics, "abort", "resumed") == 1


def test_an_abort_no_worker_can_continue_ends_with_an_error_not_a_finish_reason():
    workers = [Worker(fail_after=3, aborts=True), Worker(fail_after=0, aborts=True)]
    deltas, error, _ = asyncio.run(_run(workers, Sampling(max_tokens=9)))
    assert isinstance(error, WorkerFailed) and "no worker could continue" in str(error)
    assert [t for d in deltas for t in d.token_ids] == reference(3)
    assert all(d.finish_reason is None for d in deltas)


def test_an_abort_before_the_first_token_sends_the_request_to_another_worker():
    workers = [Worker(fail_after=0, aborts=True), Worker()]
    deltas, error, _ = asyncio.run(_run(workers, Sampling(max_tokens=6)))
    assert error is None and [t for d in deltas for t in d.token_ids] == reference(6)
    assert deltas[-1].finish_reason == "length"


def test_a_request_past_its_deadline_ends_with_an_error_and_does_not_move():
    workers = [Worker(fail_after=3, hang=True), Worker()]
    deltas, error, metrics = asyncio.run(_run(workers, Sampling(max_tokens=9), router={"request_timeout_s": 1.0}))
    assert isinstance(error, WorkerFailed) and "request_timeout_s" in str(error)
    assert [t for d in deltas for t in d.token_ids] == reference(3)
    assert all(d.finish_reason is None for d in deltas)
    assert workers[1].requests == []  # a deadline is the request's, not a reason to start it over elsewhere
