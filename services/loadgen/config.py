"""What one benchmark run does: a frozen tree of settings, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

DATASETS = ("random", "lognormal", "shared-prefix", "multi-turn", "trace")
ENDPOINTS = ("completions", "chat")
ARRIVALS = ("poisson", "onoff")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
EMBEDDED_TOKENIZER = "smollm2-135m-instruct"


class ConfigError(ValueError):
    """A setting is invalid; the message names it (the CLI exits 2)."""


@dataclass(frozen=True, slots=True)
class Slo:
    """Per-request latency limits in milliseconds; a request meeting all of them counts as goodput."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str]) -> "Slo":
        values = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or key not in SLO_KEYS:
                raise ConfigError(f"--slo: {item!r} is not KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ConfigError(f"--slo: {key}: {value!r} is not a number") from None
            if values[key] <= 0:
                raise ConfigError(f"--slo: {key} must be positive")
        return cls(**values)

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in SLO_KEYS if getattr(self, k) is not None}


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    dataset: str = "random"
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    length_scale: float = 1.0
    lognormal_mu: float = 9.90
    lognormal_sigma: float = 1.00
    lognormal_min: int = 128
    lognormal_max: int = 131072
    num_prefixes: int = 4
    prefix_len: int = 512
    num_turns: int = 4
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"--dataset: {self.dataset!r} is not one of {', '.join(DATASETS)}")
        for name in ("input_len", "output_len", "num_prefixes", "num_turns"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.prefix_len < 0:
            raise ConfigError("--prefix-len must be at least 0")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ConfigError("--range-ratio must be in [0, 1)")
        if not self.length_scale > 0:
            raise ConfigError("--length-scale must be positive")
        if not 1 <= self.lognormal_min <= self.lognormal_max:
            raise ConfigError("lognormal bounds: need 1 <= min <= max")
        if self.dataset == "trace" and not self.trace_path:
            raise ConfigError("--dataset trace needs --trace PATH")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything `run_benchmark` needs; the CLI builds one from its arguments."""

    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    tokenizer: str | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    num_prompts: int | None = 100
    duration_s: float | None = None
    warmup: int = 0
    request_rate: float = math.inf
    burstiness: float = 1.0
    arrivals: str = "poisson"
    on_s: float = 10.0
    off_s: float = 10.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    seed: int = 0
    slo: Slo = field(default_factory=Slo)
    timeout_s: float = 600.0
    scrape_router: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"--endpoint: {self.endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        if self.arrivals not in ARRIVALS:
            raise ConfigError(f"--arrivals: {self.arrivals!r} is not one of {', '.join(ARRIVALS)}")
        if self.num_prompts is None and self.duration_s is None:
            raise ConfigError("give --num-prompts or --duration")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError("--num-prompts must be at least 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ConfigError("--duration must be positive")
        if not self.request_rate > 0:
            raise ConfigError("--request-rate must be positive (inf sends everything at once)")
        if not self.burstiness > 0:
            raise ConfigError("--burstiness must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("--max-concurrency must be at least 1")
        if self.warmup < 0:
            raise ConfigError("--warmup must be at least 0")
        if not (self.on_s > 0 and self.off_s >= 0):
            raise ConfigError("--on-s must be positive and --off-s at least 0")
        unbounded = math.isinf(self.request_rate) and self.max_concurrency is None
        if self.duration_s is not None and self.num_prompts is None and unbounded \
                and self.workload.dataset != "trace":
            raise ConfigError("--duration without --num-prompts needs --request-rate or --max-concurrency")

    @property
    def root_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url
