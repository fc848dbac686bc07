"""The ranks of bench/gpu_kv_path.py's two engines (a producer and a consumer), each a thread of the
benchmark or a process of its own, behind one interface: ``call(group, job, **args)`` runs ``job``
(a method of ``RankJobs``) on every rank of ``group`` at once and returns their answers in rank
order. Each job waits at a barrier of its group where its timing starts.

A process rank (``ProcessRanks``: ``torch.multiprocessing``, start method 'spawn') owns its device
(``torch.cuda.set_device``), its worker core, transport, rings and listening port, as an engine's
TP rank does; jobs and their answers (times, counts, file paths) go through queues, and the bytes
the parent compares (blocks, a producer's recorded frames) through files under ``RankSpec.out_dir``.
Thread ranks (``ThreadRanks``) run the same jobs in the benchmark's process.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from gpu_kv_engine import (RecordedWire, Shape, load_recordings, Rank, received, request_ids, save_all,
                           save_recording, settings_for, step_time, sync)
from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec, SendSpec

PRODUCERS, CONSUMERS, EVERYONE = "producers", "consumers", "everyone"
LOOP_PORT = 7000  # consumer rank r's address on a RecordedWire: loop:<LOOP_PORT + r>
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankSpec:
    """One rank of the producer (``producer``) or the consumer engine: ``tp_size`` ranks of its own,
    ``peer_tp`` of the other engine; the consumer's rank r listens at ``port + r``."""
    shape: Shape
    order: str
    codec: str
    tp_size: int
    rank: int
    producer: bool
    peer_tp: int
    device: str
    port: int
    ring_bytes: int | None
    out_dir: str

    @property
    def key(self) -> str:
        return f"{'producer' if self.producer else 'consumer'}-{self.rank}"


class RankJobs:
    """What one rank does when asked; runs in the rank's thread or process."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.src_ids, self.dst_ids = request_ids(spec.shape)
        self.rank = self._rank(settings_for(spec.codec, None if spec.producer else spec.port, spec.ring_bytes))
        self._recorded: list | None = None  # the producers' frames for this consumer rank (``write_round``)

    def forward(self, barrier) -> float:
        """The forward alone, once."""
        sync(self.device)
        barrier.wait()
        return step_time(self.rank, None, self.device, connected=False)

    def step(self, barrier, req: str) -> float | None:
        """A producer's connected prefill step (its time), or a consumer's idle steps until ``req`` is in."""
        sync(self.device)
        if self.spec.producer:
            send = self._send(req, f"127.0.0.1:{self.spec.port}")
            barrier.wait()
            return step_time(self.rank, send, self.device)
        barrier.wait()
        received(self.rank, self._recv(req), req)
        return None

    def blocks(self, barrier, name: str) -> str:
        """A consumer's blocks of the request (zeroed after, so the next round's bytes are its own), or a
        producer's as a consumer should hold them; the file they were saved to."""
        path = Path(self.spec.out_dir) / f"{name}-{self.spec.key}.pt"
        if self.spec.producer:
            torch.save(self.rank.reference(self.src_ids, self.spec.codec), path)
        else:
            torch.save(self.rank.blocks(self.dst_ids), path)
            self.rank.clear(self.dst_ids)
        return str(path)

    def ring_waits(self, barrier) -> int:
        return self.rank.core.producer.saver.ring.num_waits

    def start_rates(self, barrier) -> None:
        """The transfer's core shut down; a core over a ``RecordedWire`` in its place (no TCP)."""
        self.rank.core.shutdown()
        self.rank = None
        wire = partial(RecordedWire, self.spec.codec, f"loop:{LOOP_PORT + self.spec.rank}")
        self.rank = self._rank(settings_for(self.spec.codec, None, self.spec.ring_bytes), wire)

    def save_round(self, barrier, req: str, keep: bool) -> float:
        """A producer's every layer saved back to back (no forward), until every copy was handed on;
        with ``keep``, the frames are written for the consumers (``write_round``)."""
        send = self._send(req, f"loop:{LOOP_PORT}")
        sync(self.device)
        barrier.wait()
        start = time.perf_counter()
        save_all(self.rank, send)
        elapsed = time.perf_counter() - start
        recorded = self.rank.core.streams.take()
        if keep:
            save_recording(self._recording(self.spec.rank), recorded)
        return elapsed

    def write_round(self, barrier, req: str, recorded_id: str) -> float:
        """A consumer's receive of the producers' recorded frames (read into its receive memory
        first, untimed, as they would have arrived): steps until ``req`` is reported."""
        self.rank.core.on_metadata(self._recv(req))
        if self._recorded is None:
            self._recorded = load_recordings([self._recording(r) for r in range(self.spec.peer_tp)],
                                             self.rank.core.streams.address)
        self.rank.core.streams.replay(self._recorded, recorded_id, req)
        sync(self.device)
        barrier.wait()
        start = time.perf_counter()
        received(self.rank, PrfaasConnectorMetadata(), req)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.rank is not None:
            self.rank.core.shutdown()

    def _rank(self, settings, open_streams=None) -> Rank:
        spec = self.spec
        return Rank(spec.shape, spec.order, spec.tp_size, spec.rank, spec.producer, self.device, settings,
                    open_streams=open_streams)

    def _send(self, req: str, peer: str) -> PrfaasConnectorMetadata:
        tokens = self.spec.shape.tokens
        return PrfaasConnectorMetadata(sends=[SendSpec(req, req, peer, (tuple(self.src_ids),), 0, tokens, tokens,
                                                       self.spec.peer_tp)])

    def _recv(self, req: str) -> PrfaasConnectorMetadata:
        return PrfaasConnectorMetadata(recvs=[RecvSpec(req, req, (tuple(self.dst_ids),), 0, self.spec.shape.tokens)])

    def _recording(self, producer_rank: int) -> Path:
        return Path(self.spec.out_dir) / f"frames-producer-{producer_rank}.pkl"


def _groups(specs: list[RankSpec]) -> dict[str, list[str]]:
    return {PRODUCERS: [s.key for s in specs if s.producer], CONSUMERS: [s.key for s in specs if not s.producer],
            EVERYONE: [s.key for s in specs]}


class ThreadRanks:
    """Every rank a thread of this process."""

    def __init__(self, specs: list[RankSpec]) -> None:
        self._groups = _groups(specs)
        self._jobs: dict[str, RankJobs] = {}
        try:
            for spec in specs:
                self._jobs[spec.key] = RankJobs(spec)
        except BaseException:
            self.close()
            raise

    def call(self, group: str, job: str, **args) -> list:
        keys = self._groups[group]
        barrier, answers, errors = threading.Barrier(len(keys)), {}, []

        def run(key: str) -> None:
            try:
                answers[key] = getattr(self._jobs[key], job)(barrier, **args)
            except BaseException as error:  # noqa: BLE001 - re-raised below
                barrier.abort()
                errors.append(error)
        threads = [threading.Thread(target=run, args=(key,)) for key in keys]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return [answers[key] for key in keys]

    def close(self) -> None:
        for jobs in self._jobs.values():
            jobs.close()


def _serve(index: int, asks, answers, barriers) -> None:
    """A rank process, serving one case's rank after another: ``("open", spec)`` builds its
    ``RankJobs``, ``("call", job, parties, args)`` runs a job (at the barrier of ``parties`` ranks),
    ``("close",)`` shuts the rank down; None ends the process."""
    jobs = None
    while (asked := asks.get()) is not None:
        try:
            if asked[0] == "open":
                if jobs is not None:  # the last case ended with an error before closing it
                    jobs.close()
                jobs = RankJobs(asked[1])
                answer = "ready"
            elif asked[0] == "call":
                _, job, parties, args = asked
                answer = getattr(jobs, job)(barriers[parties], **args)
            else:
                jobs, answer = jobs.close(), "closed"
            answers.put((index, True, answer))
        except BaseException:  # noqa: BLE001 - reported to the parent
            if asked[0] == "call":
                barriers[asked[2]].abort()
            answers.put((index, False, traceback.format_exc()))
    if jobs is not None:
        jobs.close()


class RankProcesses:
    """``size`` processes ('spawn') that serve as ranks, one case after another: each start costs a
    Python and a torch import, so they are started once, ahead of the cases that need them. Each
    makes its own CUDA context on the device."""

    def __init__(self, size: int) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self._answers = context.Queue()
        self._asks = [context.Queue() for _ in range(size)]
        self._barriers = {parties: context.Barrier(parties) for parties in range(1, size + 1)}
        self._processes = [context.Process(target=_serve, name=f"gpu-kv-rank-{i}", daemon=True,
                                           args=(i, self._asks[i], self._answers, self._barriers))
                           for i in range(size)]
        for process in self._processes:
            process.start()

    def ranks(self, specs: list[RankSpec]) -> ProcessRanks:
        """The first ``len(specs)`` processes as these ranks."""
        for barrier in self._barriers.values():
            barrier.reset()
        return ProcessRanks(self, specs)

    def ask(self, messages: dict[int, tuple], timeout_s: float | None = None) -> list:
        """Each message to its process; their answers, in that order. Raises the first error a process
        reported, or when one died (or, with ``timeout_s``, took longer) without answering."""
        indexes = list(messages)
        for index, message in messages.items():
            self._asks[index].put(message)
        answers, errors = {}, []
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        while len(answers) + len(errors) < len(indexes):
            try:
                index, ok, answer = self._answers.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i in indexes if i not in answers and self._processes[i].exitcode is not None]
                if dead or (deadline is not None and time.monotonic() > deadline):
                    raise RuntimeError(f"rank process {(dead or indexes)[0]} ended or stalled without "
                                       "answering") from None
                continue
            if ok:
                answers[index] = answer
            else:
                errors.append(f"rank process {index} failed:\n{answer}")
        if errors:
            raise RuntimeError(errors[0])
        return [answers[index] for index in indexes]

    def close(self) -> None:
        for asks in self._asks:
            asks.put(None)
        for process in self._processes:
            process.join(timeout=60.0)
            if process.is_alive():
                process.terminate()
                process.join()


class ProcessRanks:
    """One case's ranks on ``RankProcesses``: each rank a process of its own."""

    def __init__(self, processes: RankProcesses, specs: list[RankSpec]) -> None:
        self._processes = processes
        self._index = {spec.key: i for i, spec in enumerate(specs)}
        self._groups = _groups(specs)
        processes.ask({i: ("open", spec) for i, spec in enumerate(specs)}, READY_TIMEOUT_S)

    def call(self, group: str, job: str, **args) -> list:
        indexes = [self._index[key] for key in self._groups[group]]
        return self._processes.ask(dict.fromkeys(indexes, ("call", job, len(indexes), args)))

    def close(self) -> None:
        self._processes.ask(dict.fromkeys(self._index.values(), ("close",)), 60.0)


class Ranks:
    """The two engines' ranks: processes (of ``processes``) when either engine has more than one (its
    TP ranks), threads of this process otherwise."""

    def __init__(self, specs: list[RankSpec], processes: RankProcesses | None) -> None:
        self._specs = specs
        self._processes = processes

    def __enter__(self) -> ThreadRanks | ProcessRanks:
        several = any(spec.tp_size > 1 for spec in self._specs)
        self._ranks = self._processes.ranks(self._specs) if several else ThreadRanks(self._specs)
        return self._ranks

    def __exit__(self, exc_type, *_) -> None:
        try:
            self._ranks.close()
        except RuntimeError:
            if exc_type is None:
                raise  # else the error that ended the case is the one to see

