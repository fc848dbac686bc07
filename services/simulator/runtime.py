"""What the runtime does that the paper's closed form ignores: the simulator's inputs for it.

Every input's default leaves the simulator as it was: whole-request prefill, a link with no round
trip, KV sent after the prefill, pool hits loaded in no time. They come from the config's
``simulation:`` section (the same keys a measured profile can supply) and ``prfaas simulate`` flags.

- ``chunk_tokens``: the engine's token budget per step (vLLM's ``max_num_batched_tokens``); 0
  prefills each request whole. See :mod:`services.simulator.prefill` for how steps are formed.
- ``link_rtt_ms``: the cross-cluster round trip. Each transfer's last byte lands half of it after it
  is sent, and each of the transfer's ``connections`` TCP connections carries at most
  ``connection_window_bytes`` per round trip (:meth:`RuntimeModel.window_bytes_per_s`).
- ``connections``: TCP connections per peer pair (the transport's ``connections_per_peer``).
- ``connection_window_bytes``: bytes one connection keeps in flight. The default is the send buffer
  Linux autotunes up to (``tcp_wmem``'s maximum, 4 MiB) less what ``TCP_NOTSENT_LOWAT`` lets wait
  unsent in it (the transport's ``notsent_lowat_bytes``, 1 MiB). 0: unbounded.
- ``layerwise``: the prefill worker streams each layer's KV while later layers compute (as the
  runtime does), so only the part of the transfer that does not fit under the prefill is exposed
  (:func:`exposed_transfer_s`). Off: the KV is sent after the prefill, as the closed form assumes.
- ``pool_load_gbps``: how fast a prefill instance loads a cache-pool hit (the prefix given by the
  workload's ``prefix_hit``); 0: loads take no time.
- ``per_instance``: the router's choice is one instance, not a cluster: every worker is its own
  ``WorkerView`` with its load, ``choose_route`` picks the decode worker and the prefill worker, and
  each instance queues its own requests (:mod:`services.simulator.instances`). Off: one view per
  role and one shared FIFO queue per cluster.
- ``local_both``: N > 0 replaces the local PD cluster (its N_p prefill and N_d decode instances)
  with N colocated ``both`` workers, each one engine that prefills local-path requests and decodes
  every path (:mod:`services.simulator.colocated`); implies ``per_instance``.
- ``host_cpu_s_per_request``, ``host_cores``: CPU engines that share their host with the serving
  processes (the router, the API clients, the workers' front ends) lose the time those take: at an
  offered rate λ the others use ``λ * host_cpu_s_per_request`` of the host's ``host_cores`` cores,
  and every engine's prefill and decode steps take ``1 / (1 - that share)`` times what the profile
  measured on a core of its own (:meth:`RuntimeModel.contention_factor`). 0: nothing else runs on the
  engines' cores (GPU engines; a router on a host of its own).
- ``colocated_interference``: engines on one host share its memory system, and a CPU decode step
  streams the whole model's weights: while a share s of the colocated workers (``local_both``) run
  steps that advance decodes, the PrfaaS prefill instances compute at ``1 / (1 + this * s)`` of the
  profile's speed (a prefill in flight slows and speeds up as s changes). 0: engines on hosts of their
  own (GPU deployments). ``bench/sim_vs_real.py`` measures it on its host.
- ``send_cpu_ms_per_mib``: what a PrfaaS prefill instance loses per MiB of KV it sends, out of its compute:
  the prefill (step) that starts as a transfer starts takes that much longer (with ``layerwise``, its own
  prefill; without, the next in its queue); an idle instance pays it from its idle time. 0: the sender
  has cores of its own (GPU deployments), or a measured profile already holds it. On the embedded
  default the sender threads take under 1 ms per MiB of the engine's core
  (``prfaas_kv_link_send_cpu_seconds``), and ``bench/sim_vs_real.py``, which simulates it layer-wise,
  leaves this 0: the speed it fits for the PrfaaS prefill worker includes it (docs/capacity-planning.md).
- ``decode_step_s_by_batch``: ``[[batch size, seconds], ...]``, at least two, batch sizes
  increasing: a colocated worker's decode step time by the number decoding (the profile's decode
  points, at the context the workload decodes at), interpolated and extrapolated linearly. Empty: every
  step costs the decode profile's ``step_time_s`` (the step at its largest batch), whatever the batch.
- ``admission``: the router's admission control (``services.scheduling.admission.admit``) judges
  each routed request; rejected requests are counted and enter no queue. ``max_in_flight``: its
  capacity (the router's ``max_in_flight_requests``; 0: ``max_batch_size`` per generating
  instance); ``admission_ttft_slo_s``: the TTFT SLO of its one QoS class (0: none).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

MIB = 1 << 20
GBPS = 1e9 / 8
CONNECTIONS_PER_PEER = 8            # services.kv_transport.settings.TransportSettings.connections_per_peer
TCP_WMEM_MAX_BYTES = 4 * MIB        # Linux's default net.ipv4.tcp_wmem maximum
NOTSENT_LOWAT_BYTES = 1 * MIB       # TransportSettings.notsent_lowat_bytes
MAX_HOST_SHARE = 0.9                # the most of the host's cores the serving processes take from engines


class RuntimeInputError(ValueError):
    """A ``simulation:`` input that cannot be used; the message names the key."""


@dataclass(frozen=True, slots=True)
class RuntimeModel:
    chunk_tokens: int = 0
    link_rtt_ms: float = 0.0
    connections: int = CONNECTIONS_PER_PEER
    connection_window_bytes: int = TCP_WMEM_MAX_BYTES - NOTSENT_LOWAT_BYTES
    layerwise: bool = False
    pool_load_gbps: float = 0.0
    per_instance: bool = False
    local_both: int = 0
    host_cpu_s_per_request: float = 0.0
    host_cores: int = 0
    decode_step_s_by_batch: tuple[tuple[float, float], ...] = ()
    colocated_interference: float = 0.0
    send_cpu_ms_per_mib: float = 0.0
    admission: bool = False
    max_in_flight: int = 0
    admission_ttft_slo_s: float = 0.0

    def __post_init__(self) -> None:
        checks = [("chunk_tokens", self.chunk_tokens >= 0, "must be 0 (whole requests) or positive"),
                  ("link_rtt_ms", self.link_rtt_ms >= 0, "must not be negative"),
                  ("connections", self.connections >= 1, "must be at least 1"),
                  ("connection_window_bytes", self.connection_window_bytes >= 0, "must be 0 (unbounded) or positive"),
                  ("pool_load_gbps", self.pool_load_gbps >= 0, "must be 0 (loads take no time) or positive"),
                  ("local_both", self.local_both >= 0, "must be 0 (a prefill/decode split) or positive"),
                  ("host_cpu_s_per_request", self.host_cpu_s_per_request >= 0,
                   "must be 0 (nothing else on the engines' cores) or positive"),
                  ("host_cores", self.host_cores >= 0, "must be 0 (unknown: no contention) or positive"),
                  ("colocated_interference", self.colocated_interference >= 0,
                   "must be 0 (engines on hosts of their own) or positive"),
                  ("send_cpu_ms_per_mib", self.send_cpu_ms_per_mib >= 0,
                   "must be 0 (the sender has cores of its own) or positive"),
                  ("max_in_flight", self.max_in_flight >= 0, "must be 0 (max_batch_size per instance) or positive"),
                  ("admission_ttft_slo_s", self.admission_ttft_slo_s >= 0, "must be 0 (no SLO) or positive")]
        curve = self.decode_step_s_by_batch
        checks.append(("decode_step_s_by_batch",
                       not curve or (len(curve) >= 2 and all(b > a for (a, _), (b, _) in zip(curve, curve[1:]))
                                     and all(batch >= 1 and step > 0 for batch, step in curve)),
                       "needs at least two [batch size, seconds] points, batch sizes increasing from 1 up, "
                       "seconds positive"))
        for key, ok, message in checks:
            if not ok:
                raise RuntimeInputError(f"simulation.{key}: {message}, got {getattr(self, key)!r}")

    @property
    def dispatches_per_instance(self) -> bool:
        return self.per_instance or self.local_both > 0

    @property
    def one_way_s(self) -> float:
        return self.link_rtt_ms / 2000.0

    @property
    def window_bytes_per_s(self) -> float:
        """The most one transfer's connections carry: ``connections * window / RTT`` (infinite with
        no round trip or an unbounded window)."""
        if self.link_rtt_ms <= 0 or self.connection_window_bytes <= 0:
            return math.inf
        return self.connections * self.connection_window_bytes / (self.link_rtt_ms / 1000.0)

    def link_bytes_per_s(self, gbps: float) -> float:
        """What one transfer gets from a link of ``gbps``: the link's rate, or less when the
        connections' windows bound it."""
        return min(gbps * GBPS, self.window_bytes_per_s)

    def contention_factor(self, rate: float) -> float:
        """How much longer engine steps take than profiled at an offered ``rate`` (requests/s), with
        the host's other processes taking ``rate * host_cpu_s_per_request`` of its ``host_cores``
        cores (at most ``MAX_HOST_SHARE`` of them)."""
        if self.host_cpu_s_per_request <= 0 or self.host_cores <= 0 or rate <= 0:
            return 1.0
        return 1.0 / (1.0 - min(MAX_HOST_SHARE, rate * self.host_cpu_s_per_request / self.host_cores))

    def load_s(self, kv_bytes: float) -> float:
        return kv_bytes / (self.pool_load_gbps * GBPS) if self.pool_load_gbps > 0 else 0.0

    def with_overrides(self, overrides: Mapping[str, Any]) -> RuntimeModel:
        """These inputs with the non-None ``overrides`` (command-line flags) applied."""
        return replace(self, **{key: value for key, value in overrides.items() if value is not None})


def exposed_transfer_s(transfer_s: float, overlap_s: float) -> float:
    """The part of a transfer left after the work it overlaps: ``max(0, transfer - overlap)``.
    With layer-wise streaming a request's KV goes out while its prefill computes, so the overlap is
    the prefill's duration; sent after the prefill, the overlap is 0."""
    return max(0.0, transfer_s - overlap_s)


def parse_runtime(raw: Any, path: str = "simulation") -> RuntimeModel:
    """A ``simulation:`` mapping (absent: the defaults); unknown keys and wrong types are errors."""
    if raw is None:
        return RuntimeModel()
    if not isinstance(raw, Mapping):
        raise RuntimeInputError(f"{path}: expected a mapping, got {type(raw).__name__}")
    known = {f.name: type(f.default) for f in fields(RuntimeModel)}
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise RuntimeInputError(f"{path}.{key}: unknown key (allowed: {', '.join(known)})")
        values[key] = _typed(value, known[key], f"{path}.{key}")
    try:
        return RuntimeModel(**values)
    except RuntimeInputError as exc:
        raise RuntimeInputError(str(exc).replace("simulation.", f"{path}.", 1)) from None


def _typed(value: Any, kind: type, path: str) -> Any:
    if kind is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
            raise RuntimeInputError(f"{path}: expected a list of [batch size, seconds] pairs, got {value!r}")
        return tuple((_typed(b, float, path), _typed(t, float, path)) for b, t in value)
    if kind is bool:
        if not isinstance(value, bool):
            raise RuntimeInputError(f"{path}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RuntimeInputError(f"{path}: expected a number, got {value!r}")
    if kind is int:
        if value != int(value):
            raise RuntimeInputError(f"{path}: expected an integer, got {value!r}")
        return int(value)
    return float(value)
