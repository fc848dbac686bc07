"""vLLM's own OpenAI server on the model and engine settings of one PrfaaS worker: the reference of
the API parity tests (tests/e2e/embedded/test_api_parity.py) and of bench/api_parity.py.

Its engine is the worker's, field for field: the launcher (``main``, run as this module in the
server's own process) builds the worker's ``AsyncEngineArgs`` with ``services.engine.args.engine_args``
from the deployment's config, turns them into vLLM's command-line flags, parses those back with
vLLM's own parser and refuses to start unless every field comes back equal. It sets the worker's
environment as the worker does: the worker's ``env`` (its ``VLLM_CPU_OMP_THREADS_BIND``, one core),
``VLLM_CPU_KVCACHE_SPACE`` (set by ``engine_args``), and the model in vLLM's engine-core process with
one OpenMP thread (``services.engine.cpus``): the thread count changes the order of bfloat16 sums.

What differs, on purpose:
- no KV connector and no KV-event publisher: the reference computes every prompt itself;
- vLLM's tool-call parser (``--enable-auto-tool-choice --tool-call-parser``) is the one the config
  names in ``model.tool_parser``, none when it names none: it decides how vLLM serves a named or
  ``required`` ``tool_choice`` (a parser with a structural tag, as ``hermes``, forces its own call
  format; without a parser vLLM forces a JSON schema of the arguments) and whether ``auto`` is served;
- ``--generation-config vllm``. The worker's engine keeps vLLM's default (``auto``), under which
  both engines read the checkpoint's generation_config.json for its special tokens (EOS): vLLM loads
  the file for that under ``vllm`` too. What ``vllm`` turns off is only what vLLM's OpenAI server
  (not the engine) does with the file: take its sampling fields (temperature, top_p, top_k,
  repetition_penalty, ...) as the defaults of every request that leaves them out. The router sends
  the worker only what the client asked, so with ``auto`` the same request could mean something else
  on the reference. (The embedded model's file has no sampling fields today: this keeps it so.)
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.launcher import supervisor
from services.launcher.cli import DEFAULT_CONFIG
from services.procs import group_alive
from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "reference-key"
START_TIMEOUT_S = 300.0
DEFAULT_WORKER = "decode-0"  # the worker that decodes both paths' requests in the embedded default
# Engine fields the reference leaves out (see the module's docstring).
NOT_CARRIED = ("kv_transfer_config", "kv_events_config")
OVERRIDES = {"generation_config": "vllm"}


@dataclasses.dataclass(slots=True)
class ReferenceServer:
    """One `vllm serve` in a process group of its own, on a free loopback port."""

    directory: Path
    config_path: Path = DEFAULT_CONFIG
    worker: str = DEFAULT_WORKER
    api_key: str = API_KEY
    port: int = 0
    tool_parser: str | None = None  # None: the config's `model.tool_parser`
    child: supervisor.Child | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ReferenceServer":
        self.port = self.port or free_port()
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "support.reference_server", "--config", str(self.config_path),
                "--worker", self.worker, "--port", str(self.port), "--api-key", self.api_key]
        if self.tool_parser:
            argv += ["--tool-parser", self.tool_parser]
        self.child = supervisor.Child("reference", argv, self.directory / "reference.log",
                                      stage=supervisor.WORKER_STAGE)
        path = [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        self.child.env = {"PYTHONPATH": os.pathsep.join(filter(None, path))}
        self.child.start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM to the server, then what is left of its group is killed; raises if anything is left."""
        if self.child is None or self.child.process is None:
            return
        supervisor.stop_all([self.child])
        if group_alive(self.child.process.pid):
            raise AssertionError(f"the reference server's process group outlived it:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return self.child.log_tail(lines) if self.child is not None else ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.child.exited:
                raise RuntimeError(f"the reference server exited during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the reference server did not answer /health in {START_TIMEOUT_S:.0f} s:\n"
                           f"{self.log_tail()}")


def configured_tool_parser(config_path: Path = DEFAULT_CONFIG) -> str | None:
    """The tool-call parser the deployment names (``model.tool_parser``), None when it names none."""
    from services.config import load_config

    return getattr(load_config(config_path).model, "tool_parser", None) or None


def worker_engine_args(config_path: Path, worker_name: str):
    """The ``AsyncEngineArgs`` the worker builds for its engine (with no connector)."""
    from services.config import load_config
    from services.engine.args import engine_args

    config = load_config(config_path)
    worker = config.worker(worker_name)
    return engine_args(config.model_for(worker), config.engine_for(worker))


def engine_flags(args) -> list[str]:
    """vLLM's command-line flags for every field of ``args`` that differs from vLLM's default."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    defaults = AsyncEngineArgs()
    flags = []
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if field.name in NOT_CARRIED or field.name in OVERRIDES or value == getattr(defaults, field.name):
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + field.name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif value is None:
            raise ValueError(f"engine field {field.name} is None where vLLM's default is not: no flag says that")
        else:
            flags += [flag, str(value)]
    for name, value in OVERRIDES.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def _check_parsed(args, parsed) -> None:
    """Every engine field the worker sets (differing from vLLM's default) comes back equal from vLLM's
    parser (but ``NOT_CARRIED`` and ``OVERRIDES``). Fields the worker leaves at their default may come
    back as the parser's own spelling of it (``None`` for ``False``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    defaults, served = AsyncEngineArgs(), AsyncEngineArgs.from_cli_args(parsed)
    differing = [f"{f.name}: worker {getattr(args, f.name)!r}, reference {getattr(served, f.name)!r}"
                 for f in dataclasses.fields(args)
                 if f.name not in NOT_CARRIED and f.name not in OVERRIDES
                 and getattr(args, f.name) != getattr(defaults, f.name)
                 and getattr(args, f.name) != getattr(served, f.name)]
    if differing:
        raise SystemExit("reference engine differs from the worker's: " + "; ".join(differing))


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--worker", default=DEFAULT_WORKER)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", default=API_KEY)
    parser.add_argument("--tool-parser", help="vLLM's tool-call parser (`none`: none); default: the config's "
                                              "`model.tool_parser`, none when it names none")
    options = parser.parse_args(argv)

    from services.config import load_config
    from services.engine.cpus import confine_worker, model_in_engine_core
    from services.procs import end_with_supervisor

    end_with_supervisor()
    config = load_config(options.config)
    worker = config.worker(options.worker)
    os.environ.update({str(k): str(v) for k, v in worker.env.items()})  # as services.engine.command does
    confine_worker()
    model_in_engine_core(config.engine_for(worker).tensor_parallel_size)
    args = worker_engine_args(options.config, options.worker)
    server_flags = ["--host", "127.0.0.1", "--port", str(options.port), "--api-key", options.api_key,
                    "--uvicorn-log-level", "warning"]
    tool_parser = options.tool_parser or configured_tool_parser(options.config)
    if tool_parser and tool_parser != "none":
        server_flags += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]

    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    sys.argv = ["vllm-reference", *engine_flags(args), *server_flags]
    print("reference server:", " ".join(sys.argv[1:]), flush=True)
    _check_parsed(args, make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]))
    entry.main()


if __name__ == "__main__":
    main(sys.argv[1:])
