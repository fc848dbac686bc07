"""`prfaas profile`: measure the configured model on a real engine and write a profile for plan and simulate."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"
DEFAULT_TPOT_MS = 50.0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure the configured model on a real engine; write a profile for plan and simulate",
        description="Start one vLLM engine with the deployment's model, engine settings and a worker's "
        "environment (in this process) and measure: prefill latency over prompt lengths and prefix-hit ratios "
        "(hits from vLLM's own prefix cache: the prefix is prefilled first), KV bytes per token of each "
        "KV-cache group (from the engine's KV cache config), decode step time by batch size and context length, "
        "and the largest decode batch whose step time meets the TPOT target. Writes a profile YAML that "
        "`prfaas plan --profile FILE` and `prfaas simulate --profile FILE` read, and a PNG plot (with "
        "matplotlib). Progress goes to stderr. Every measured point is cached (keyed by the model, engine "
        "settings, vLLM version and device), so an interrupted run resumes where it stopped.",
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="deployment YAML (default: deploy/local.yaml)")
    parser.add_argument("--worker", metavar="NAME",
                        help="take the engine overrides and environment of this worker (default: the first)")
    parser.add_argument("--output", "-o", type=Path, default=Path("prfaas-profile.yaml"),
                        help="profile YAML to write (default: %(default)s)")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="plot to write (default: the output with .png)")
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid (about a minute on a 2-core CPU): prompts of 128/512/1024 tokens at 0 and "
                        "50%% prefix hit, decode batches 1/4/16 (and up to 3 searched) at 512 tokens of context. "
                        "Default: 6 lengths x 4 hit ratios, batches 1..32 at 256 and 1024 tokens (a few minutes)")
    parser.add_argument("--tpot-ms", type=float, default=DEFAULT_TPOT_MS,
                        help="TPOT target for the largest decode batch, ms per output token (default: %(default)s)")
    grid = parser.add_argument_group("grid (defaults: the quick or full grid)")
    grid.add_argument("--lengths", type=_ints, metavar="N,N,...", help="prompt lengths in tokens")
    grid.add_argument("--hit-ratios", type=_ratios, metavar="R,R,...", help="prefix-hit ratios in [0, 1)")
    grid.add_argument("--batch-sizes", type=_ints, metavar="B,B,...", help="decode batch sizes")
    grid.add_argument("--contexts", type=_ints, metavar="N,N,...",
                      help="decode context lengths; the TPOT target is checked at the longest")
    grid.add_argument("--repeats", type=_positive, help="prefill runs per point (median)")
    grid.add_argument("--decode-steps", type=_positive, help="decode steps timed per point (median)")
    grid.add_argument("--search-steps", type=_non_negative,
                      help="extra decode points measured to find the largest batch")
    parser.add_argument("--cache-dir", type=Path, help="point cache (default: $PRFAAS_CACHE_DIR/profiles, "
                        "i.e. ~/.cache/prfaas/profiles)")
    parser.add_argument("--no-cache", action="store_true", help="measure every point again and cache nothing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's log")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from services.config import ConfigError, load_config
    from services.profiler.setup import ProfileSetupError, grid_of, target_of

    try:
        config = load_config(args.config)
        target = target_of(config, args.worker)
        grid = grid_of(args.quick, {"input_tokens": args.lengths, "hit_ratios": args.hit_ratios,
                                    "batch_sizes": args.batch_sizes, "context_tokens": args.contexts,
                                    "repeats": args.repeats, "decode_steps": args.decode_steps,
                                    "search_steps": args.search_steps})
    except (ConfigError, ProfileSetupError) as exc:
        return _fail(str(exc))
    if args.tpot_ms <= 0:
        return _fail("--tpot-ms: must be positive")
    try:
        cpus = _set_environment(target.env, args.verbose)
    except ProfileSetupError as exc:
        return _fail(str(exc))
    return _profile(args, target, grid, cpus)


def _profile(args: argparse.Namespace, target, grid, cpus: list[int] | None) -> int:
    from services.profiler.cache import PointCache
    from services.profiler.engine import EngineStartError
    from services.profiler.measure import Profiler
    from services.profiler.progress import Progress
    from services.profiler.setup import identity

    cache_dir = None if args.no_cache else (args.cache_dir or _default_cache_dir())
    cache = PointCache(cache_dir, identity(target, grid, args.seed))
    progress = Progress(0.0, 0)
    worker = f" as worker {target.worker.name}" if target.worker else ""
    bound = f" on CPUs {','.join(map(str, cpus))}" if cpus else ""
    progress.note(f"profiling {target.model.name}{worker}{bound} ({'quick' if args.quick else 'full'} grid; "
                  f"cache {cache.directory or 'off'})")
    started = time.monotonic()
    profiler = Profiler(grid, cache, lambda: _engine(target), args.tpot_ms / 1000.0, progress, args.seed)
    try:
        results = profiler.run()
    except EngineStartError as exc:
        return _fail(f"cannot start an engine for model {target.model.name!r} ({target.model_path}): {exc}")
    except KeyboardInterrupt:
        print(f"prfaas profile: interrupted; measured points are cached in {cache.directory}: run it again to "
              "resume", file=sys.stderr)
        return 130
    return _write(args, target, results, time.monotonic() - started, cache, cpus)


def _write(args: argparse.Namespace, target, results, wall_s: float, cache, cpus: list[int] | None) -> int:
    from datetime import datetime, timezone

    from services.planner.inputs import PlanInputError
    from services.planner.measured_profile import parse_profile
    from services.profiler.report import profile_document, profile_yaml, summary_text
    from services.profiler.setup import device

    measured = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "vllm_version":
                results.info.vllm_version, "device": device(), "config": str(args.config),
                "worker": target.worker.name if target.worker else None, "env": target.env, "cpus": cpus,
                "quick": args.quick,
                "wall_s": round(wall_s, 1), "points_measured": results.num_measured,
                "points_cached": results.num_cached, "cache_key": cache.key[:20]}
    document = profile_document(results, target.model.name, measured)
    try:
        parse_profile(document, str(args.output))
    except PlanInputError as exc:
        return _fail(f"the measured profile is not usable by the planner: {exc}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(profile_yaml(document))
    print(summary_text(document, str(args.output)))
    if not args.no_plot:
        _plot(document, args.plot or args.output.with_suffix(".png"), explicit=args.plot is not None)
    return 0


def _plot(document: dict, path: Path, explicit: bool) -> None:
    from services.planner.plots import MatplotlibMissing
    from services.profiler.plots import write_profile_plot

    try:
        print(f"plot: {write_profile_plot(document, path)}")
    except MatplotlibMissing as exc:
        if explicit:
            print(f"prfaas profile: {exc}", file=sys.stderr)


def _engine(target):
    from services.engine.args import engine_args
    from services.profiler.engine import ProfilingEngine

    return ProfilingEngine(engine_args(target.model, target.engine))


def _set_environment(env: dict[str, str], verbose: bool) -> list[int] | None:
    """The worker's environment, the engine in this process, and on CPU hosts the worker's CPUs (vLLM
    binds them only in a worker process it spawns). Returns the CPUs bound, if any."""
    from services.engine.cpus import engine_cpus
    from services.profiler.setup import ProfileSetupError

    os.environ.update(env)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: see profiler/engine.py
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if Path("/dev/nvidiactl").exists():
        return None
    try:
        cpus = engine_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), os.sched_getaffinity(0))
        if cpus:
            os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as exc:
        raise ProfileSetupError(f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')!r}: "
                                f"cannot bind these CPUs: {exc}") from None
    if cpus:
        os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    return cpus


def _default_cache_dir() -> Path:
    from services.models.cache import cache_dir

    return cache_dir() / "profiles"


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(sorted(set(values)))


def _ratios(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ratios, got {text!r}") from None
    if not all(0.0 <= v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"ratios must be in [0, 1), got {text!r}")
    return tuple(sorted(set(values) | {0.0}))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _fail(message: str) -> int:
    print(f"prfaas profile: error: {message}", file=sys.stderr)
    return 2
