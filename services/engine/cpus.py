"""The CPUs a worker's CPU engine runs on, from vLLM's ``VLLM_CPU_OMP_THREADS_BIND``.

vLLM's CPU backend binds each TP rank's compute threads to the CPUs listed for it (``0-3,6``, ranks
separated by ``|``), but only those threads: the worker's own process, vLLM's scheduler process (its
engine core) and every thread they start run on any CPU. With engines bound to separate cores of one
host, those processes then take time from the other engines' cores: measured in this project
(bench/sim_vs_real.py's deployment at 3.2 req/s on 2 cores), the colocated worker's scheduler process
used 0.35 of a core spread over both, and the PrfaaS prefill engine's compute thread got 0.79 of the
core bound to it. ``confine_worker`` keeps a worker's whole process tree on its engine's CPUs, as the
profiler's in-process engine is (``prfaas profile``), so what an engine costs stays on its own cores.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

logger = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def _cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cpus))


def engine_cpus(bind: str | None, allowed: set[int]) -> list[int] | None:
    """The CPUs vLLM's CPU backend gives an engine's first rank: the listed ones; for ``auto`` or unset
    all but the last, which vLLM reserves for the scheduler process; None for ``nobind``."""
    if bind == "nobind":
        return None
    if bind in (None, "", "auto"):
        cpus = sorted(allowed)
        return cpus[:-1] if len(cpus) > 1 else cpus
    return _cpu_list(bind.split("|")[0])


def all_rank_cpus(bind: str | None) -> set[int] | None:
    """Every CPU an explicit binding lists, over all TP ranks; None when vLLM chooses (``auto``, unset)
    or does not bind (``nobind``)."""
    if bind in (None, "", "auto", "nobind"):
        return None
    return {cpu for rank in bind.split("|") for cpu in _cpu_list(rank)}


def confine_worker(env: Mapping[str, str] = os.environ) -> set[int] | None:
    """On a CPU host whose engine binding lists CPUs, keep this process and its children (vLLM's
    scheduler and worker processes) on them. Returns the CPUs, or None when it leaves placement alone
    (a GPU host, no explicit binding, or CPUs this process may not use: then it logs why)."""
    if os.path.exists("/dev/nvidiactl"):
        return None
    try:
        cpus = all_rank_cpus(env.get(BIND_ENV))
    except ValueError:
        logger.warning("%s=%r is not a CPU list; the worker's processes are not confined", BIND_ENV, env.get(BIND_ENV))
        return None
    if not cpus:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("cannot keep the worker on CPUs %s (%s=%r): %s", sorted(cpus), BIND_ENV, env.get(BIND_ENV), exc)
        return None
    logger.info("worker processes kept on CPUs %s (%s)", sorted(cpus), BIND_ENV)
    return cpus


def model_in_engine_core(tensor_parallel_size: int, env: MutableMapping[str, str] = os.environ) -> bool:
    """On a CPU host, run a TP-1 engine's model in vLLM's engine-core process (its uniprocess executor,
    what vLLM does on a GPU host at TP 1) instead of a third process that vLLM's CPU backend spawns
    for it. That process imports torch and vLLM afresh: a deployment of two SmolLM2 workers on this
    project's 2-core machine served after 21 s against 27-31 s, with the same greedy answers on both
    paths (docs/testing.md). Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (which is what lets vLLM's CPU
    backend keep the uniprocess executor; AsyncLLM still runs the engine core in a process of its
    own) and the OpenMP settings vLLM gives a worker process it spawns: ``OMP_NUM_THREADS`` (in-process
    vLLM would otherwise cut torch to one thread) and, under ``auto``, ``OMP_PLACES`` and
    ``OMP_PROC_BIND`` on the CPUs vLLM would choose (``confine_worker`` binds listed CPUs). Leaves a GPU
    host, TP above 1, ``nobind``, a binding it cannot read and an operator's own
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` alone. Returns whether it moved the model. (vLLM then warns that
    its global seed may change the random state of the process that launched it; the seed is set where
    the model runs, in the engine-core process, not in the worker's.)"""
    if os.path.exists("/dev/nvidiactl") or tensor_parallel_size != 1 or MULTIPROCESSING_ENV in env:
        return False
    bind = env.get(BIND_ENV)
    automatic = bind in (None, "", "auto")
    try:
        cpus = vllm_auto_cpus() if automatic else [] if bind == "nobind" else _cpu_list(bind or "")
    except ValueError:
        return False
    if not cpus:
        return False
    env[MULTIPROCESSING_ENV] = "0"
    env.setdefault("OMP_NUM_THREADS", str(len(cpus)))
    if automatic:
        env.setdefault("OMP_PLACES", "{" + ",".join(map(str, cpus)) + "}")
        env.setdefault("OMP_PROC_BIND", "true")
    logger.info("the engine's model runs in vLLM's engine-core process (TP 1 on CPU: %s compute threads on CPUs %s)",
                env["OMP_NUM_THREADS"], cpus)
    return True


def engine_core_forks(moved: bool, env: Mapping[str, str] = os.environ) -> bool:
    """Whether the worker may fork vLLM's engine-core process rather than let vLLM's CPU backend spawn
    it: where ``model_in_engine_core`` moved the model there (``moved``) and the engine is bound to a
    list of CPUs. A spawned process imports torch and vLLM afresh, about 7 s of CPU; a forked one
    starts with what the worker already imported (a deployment of two SmolLM2 workers on this
    project's 2-core machine served after 17-19 s against 22-23 s, with the same greedy answers).

    Not under ``auto``: its ``OMP_PLACES`` and ``OMP_PROC_BIND`` reach the OpenMP runtime only in a
    process that loads it afterwards, as a spawned one does (libgomp reads them once, when torch loads
    it), while a CPU list needs only the thread count, which ``fork_engine_core`` sets in the running
    runtime. The fork must come before anything in the worker starts threads or uses gRPC, whose core
    does not survive a fork (``services.engine.serve`` starts the engine first)."""
    return moved and env.get(BIND_ENV) not in (None, "", "auto", "nobind")


def fork_engine_core(env: MutableMapping[str, str] = os.environ) -> None:
    """Make vLLM fork its engine-core process from this one: called after vLLM built the engine's
    config (its CPU backend then asks for ``spawn``), before the engine starts. The OpenMP thread
    count ``model_in_engine_core`` chose goes into the running runtime; no parallel region has run in
    this process yet, so the forked one starts its threads afresh."""
    import torch

    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    logger.info("vLLM's engine-core process is forked from the worker's (%s compute threads)", torch.get_num_threads())


def vllm_auto_cpus() -> list[int]:
    """The CPUs vLLM's CPU backend gives the worker process of a TP-1 engine with a KV connector (as
    every worker's is) under ``VLLM_CPU_OMP_THREADS_BIND=auto``, from vLLM's own rule
    (``OMPProcessManager``): one logical CPU per physical core of the first NUMA node this process
    may use; past two such cores, less the two it keeps for other processes."""
    from types import SimpleNamespace

    from vllm.utils.ompmultiprocessing import OMPProcessManager

    parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=None, _api_process_count=1)
    saved = os.environ.get(BIND_ENV)
    os.environ[BIND_ENV] = "auto"
    try:
        manager = OMPProcessManager(SimpleNamespace(parallel_config=parallel, kv_transfer_config=True))
    finally:
        if saved is None:
            os.environ.pop(BIND_ENV)
        else:
            os.environ[BIND_ENV] = saved
    return list(manager.cpu_lists[0]) if manager.cpu_lists else []
