"""Measure every point of a grid on one engine, through the point cache, with progress.

The engine starts only when a point is missing from the cache. Prompts are random token ids drawn
from a seed per point, so no point gets prefix hits it did not ask for; a prefix-hit point prefills
its prefix first (whole blocks) and times the full prompt. A decode point at context C reuses the
prompts of smaller batches at C: they come from vLLM's prefix cache, each request keeps its own KV
blocks, so the decode step reads as much KV as with fresh prompts.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from services.profiler.cache import PointCache
from services.profiler.engine import EngineInfo, EngineStartError, EngineStepError
from services.profiler.grid import DecodePoint, Grid, PrefillPoint, largest_passing, next_search_batch
from services.profiler.kv import KvGroup
from services.profiler.progress import Progress, point_cost

ENGINE_POINT = "engine"


class Engine(Protocol):
    def start(self) -> EngineInfo: ...
    def prefill(self, prompt: list[int]) -> tuple[float, int]: ...
    def decode_steps(self, prompts: list[list[int]], num_steps: int) -> list[float]: ...
    def shutdown(self) -> None: ...


@dataclass(slots=True)
class ProfileResults:
    info: EngineInfo
    grid: Grid
    tpot_target_s: float
    prefill: list[dict[str, Any]] = field(default_factory=list)
    decode: list[dict[str, Any]] = field(default_factory=list)
    max_batch_size: int = 1
    max_batch_step_s: float = 0.0
    meets_target: bool = False
    limited_by: str = ""
    num_cached: int = 0
    num_measured: int = 0


class Profiler:
    def __init__(self, grid: Grid, cache: PointCache, make_engine: Callable[[], Engine], tpot_target_s: float,
                 progress: Progress | None = None, seed: int = 0) -> None:
        self._grid, self._cache, self._make_engine = grid, cache, make_engine
        self._tpot_target_s, self._seed = tpot_target_s, seed
        self._progress = progress
        self._engine: Engine | None = None

    def run(self) -> ProfileResults:
        try:
            info = self._engine_info()
            grid = self._grid.clipped(info.max_model_len)
            results = ProfileResults(info, grid, self._tpot_target_s)
            self._start_progress(grid, info)
            results.prefill = [self._point(p, info, results) for p in grid.prefill_points(info.block_size)]
            results.decode = [self._point(p, info, results) for p in grid.decode_points()]
            self._search(results)
            return results
        finally:
            if self._engine is not None:
                self._engine.shutdown()

    def _engine_info(self) -> EngineInfo:
        cached = self._cache.get(ENGINE_POINT)
        if cached is not None:
            return EngineInfo(**{**cached, "groups": tuple(KvGroup(**g) for g in cached["groups"])})
        info = self._started_engine()[1]
        self._cache.put(ENGINE_POINT, asdict(info))
        return info

    def _started_engine(self) -> tuple[Engine, EngineInfo]:
        started = time.monotonic()
        try:
            engine = self._make_engine()
            self._engine = engine
            info = engine.start()
        except Exception as exc:  # vLLM raises many kinds; all mean "this engine does not start here"
            raise EngineStartError(" ".join(str(exc).split())[:500] or type(exc).__name__) from exc
        if self._progress:
            self._progress.note(f"engine ready in {time.monotonic() - started:.1f} s (vLLM {info.vllm_version}, "
                                f"{info.dtype}, {info.chunk_tokens} tokens per step, KV cache "
                                f"{info.kv_capacity_tokens:,} tokens)")
        return engine, info

    def _engine_for_point(self) -> Engine:
        return self._engine if self._engine is not None else self._started_engine()[0]

    def _point(self, point: PrefillPoint | DecodePoint, info: EngineInfo, results: ProfileResults) -> dict[str, Any]:
        cached = self._cache.get(point.name)
        started = time.monotonic()
        if cached is not None:
            result, seconds = cached, None
            results.num_cached += 1
        else:
            result = self._measure(point, info)
            seconds = time.monotonic() - started
            self._cache.put(point.name, result)
            results.num_measured += 1
        if self._progress:
            self._progress.done(point.describe(), _summary(result), self._cost(point), seconds)
        return result

    def _measure(self, point: PrefillPoint | DecodePoint, info: EngineInfo) -> dict[str, Any]:
        if isinstance(point, PrefillPoint):
            return self._measure_prefill(point, info)
        problem = self._decode_problem(point, info)
        if problem:
            return {**asdict(point), "skipped": problem}
        try:
            return self._measure_decode(point, info)
        except EngineStepError as exc:
            return {**asdict(point), "skipped": str(exc)}

    def _measure_prefill(self, point: PrefillPoint, info: EngineInfo) -> dict[str, Any]:
        engine = self._engine_for_point()
        prefix = point.cached_prefix(info.block_size)
        latencies, cached = [], []
        for repeat in range(self._grid.repeats):
            prompt = self._prompt(info, point.input_tokens, "prefill", point.name, repeat)
            if prefix:
                engine.prefill(prompt[:prefix])
            latency, num_cached = engine.prefill(prompt)
            latencies.append(latency)
            cached.append(num_cached)
        return {**asdict(point), "cached_tokens": min(cached), "latency_s": statistics.median(latencies),
                "samples_s": latencies}

    def _measure_decode(self, point: DecodePoint, info: EngineInfo) -> dict[str, Any]:
        engine = self._engine_for_point()
        prompts = [self._prompt(info, point.context_tokens, "decode", point.context_tokens, i)
                   for i in range(point.batch_size)]
        steps = engine.decode_steps(prompts, self._grid.decode_steps)
        return {**asdict(point), "step_time_s": statistics.median(steps), "samples_s": steps}

    def _decode_problem(self, point: DecodePoint, info: EngineInfo) -> str | None:
        if point.batch_size > info.max_num_seqs:
            return f"batch above the engine's max_num_seqs ({info.max_num_seqs})"
        if point.blocks_needed(info.block_size, self._grid.decode_steps) > info.num_blocks:
            return f"the KV cache holds {info.kv_capacity_tokens:,} tokens"
        return None

    def _search(self, results: ProfileResults) -> None:
        """The largest batch whose step time at the reference context meets the TPOT target."""
        info, grid, target = results.info, results.grid, results.tpot_target_s
        context = grid.reference_context
        limit = self._batch_limit(info, context)
        measured = [r for r in results.decode if r["context_tokens"] == context and "step_time_s" in r]
        times = {r["batch_size"]: r["step_time_s"] for r in measured}
        for _ in range(grid.search_steps):
            batch = next_search_batch(times, target, limit)
            if batch is None:
                break
            point = DecodePoint(batch, context)
            if self._progress:
                self._progress.add_points(1, self._cost(point))
            result = self._point(point, info, results)
            results.decode.append(result)
            times[batch] = result.get("step_time_s", float("inf"))
        best = largest_passing(times, target)
        results.meets_target = best is not None
        results.max_batch_size = best or 1
        results.max_batch_step_s = times.get(results.max_batch_size, min(times.values(), default=0.0))
        failing = [b for b, t in times.items() if t > target and b > results.max_batch_size]
        results.limited_by = ("tpot" if failing else
                              "engine" if results.max_batch_size >= limit else "search")

    def _batch_limit(self, info: EngineInfo, context: int) -> int:
        per_request = DecodePoint(1, context).blocks_needed(info.block_size, self._grid.decode_steps)
        return max(1, min(info.max_num_seqs, info.num_blocks // per_request))

    def _prompt(self, info: EngineInfo, length: int, *seed: object) -> list[int]:
        rng = random.Random("-".join(map(str, (self._seed, *seed))))
        lo, hi = info.vocab_size // 10, info.vocab_size * 9 // 10
        return [rng.randrange(lo, hi) for _ in range(length)]

    def _start_progress(self, grid: Grid, info: EngineInfo) -> None:
        if self._progress:
            points = [*grid.prefill_points(info.block_size), *grid.decode_points()]
            self._progress.add_points(len(points), sum(self._cost(p) for p in points))

    def _cost(self, point: PrefillPoint | DecodePoint) -> float:
        if isinstance(point, PrefillPoint):
            return point_cost("prefill", point.input_tokens * self._grid.repeats)
        return point_cost("decode", point.context_tokens, point.batch_size, self._grid.decode_steps)


def _summary(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    if "latency_s" in result:
        return f"{result['latency_s'] * 1000:,.1f} ms ({result['cached_tokens']:,} tokens cached)"
    return f"{result['step_time_s'] * 1000:,.2f} ms per step"
