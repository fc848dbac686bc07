"""How a worker starts (services/engine/serve.py, services/engine/cpus.py): the engine first, its
engine-core process forked where the engine is bound to a CPU list, the ports checked free before
the engine loads, and SIGTERM during the start acted on once it is up."""
import os
import signal
import socket

import pytest
import torch

from services.engine.cpus import engine_core_forks, fork_engine_core
from services.engine.serve import _check_free, _signals_held


@pytest.mark.parametrize("moved, bind, forks", [
    (True, "0", True),
    (True, "0-1", True),
    (True, "auto", False),    # OMP_PLACES and OMP_PROC_BIND reach OpenMP only in a freshly loaded runtime
    (True, None, False),
    (True, "", False),
    (True, "nobind", False),
    (False, "0", False),      # TP above 1, a GPU host, or the operator's own VLLM_ENABLE_V1_MULTIPROCESSING
])
def test_the_engine_core_forks_only_where_the_model_moved_into_it_and_the_cpus_are_listed(moved, bind, forks):
    env = {} if bind is None else {"VLLM_CPU_OMP_THREADS_BIND": bind}
    assert engine_core_forks(moved, env) is forks


def test_forking_sets_the_thread_count_in_the_running_runtime_and_asks_vllm_for_fork():
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    env = {"OMP_NUM_THREADS": str(wanted), "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    try:
        fork_engine_core(env)
        assert torch.get_num_threads() == wanted
        assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    finally:
        torch.set_num_threads(before)


def test_a_port_in_use_fails_the_start_before_the_engine_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            _check_free("127.0.0.1", [None, port])
    _check_free("127.0.0.1", [port, None])  # closed again: free


def test_a_port_another_grpc_server_listens_on_fails_the_start_though_grpc_would_share_it():
    from concurrent import futures

    import grpc

    other = grpc.server(futures.ThreadPoolExecutor(1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        second = grpc.server(futures.ThreadPoolExecutor(1))
        assert second.add_insecure_port(f"127.0.0.1:{port}") == port  # SO_REUSEPORT: gRPC binds it again
        with pytest.raises(OSError, match="Address already in use"):
            _check_free("127.0.0.1", [port])
    finally:
        other.stop(0)


def test_a_sigterm_during_the_start_is_remembered_and_the_handler_restored():
    before = signal.getsignal(signal.SIGTERM)
    with _signals_held() as asked:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    assert asked == [signal.SIGTERM, signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_pool_or_worker_server_refuses_a_port_another_server_listens_on():
    from concurrent import futures

    import grpc

    from services.security import GrpcSecurity

    options = GrpcSecurity().options
    first = grpc.server(futures.ThreadPoolExecutor(1), options=options)
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    try:
        second = grpc.server(futures.ThreadPoolExecutor(1), options=options)
        with pytest.raises(RuntimeError, match="Failed to bind"):
            second.add_insecure_port(f"127.0.0.1:{port}")
    finally:
        first.stop(0)


def test_the_event_loops_handlers_installed_during_the_start_stay():
    import asyncio

    async def start() -> bool:
        with _signals_held():
            loop = asyncio.get_running_loop()
            stop = asyncio.Event()
            loop.add_signal_handler(signal.SIGTERM, stop.set)
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            await asyncio.wait_for(stop.wait(), 5)
            return stop.is_set()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    assert asyncio.run(start())
