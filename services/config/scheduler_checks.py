"""Cross-field checks of the `scheduler` section; errors name the key, like the loader's."""
from __future__ import annotations

from services.config.errors import ConfigError
from services.config.schema import RoleFlipsConfig, SchedulerConfig

PATHS = ("local", "pd", "prfaas")


def check_scheduler(config: SchedulerConfig) -> None:
    _check_admission(config)
    _check_qos_classes(config)
    _check_adaptive(config)
    _check_placement(config)
    _check_role_flips(config.role_flips)


def _check_admission(config: SchedulerConfig) -> None:
    _at_least(config.max_in_flight_requests, 0, "scheduler.max_in_flight_requests")
    _at_least(config.retry_after_s, 1, "scheduler.retry_after_s")
    for path, rate in config.prefill_tokens_per_s.items():
        key = f"scheduler.prefill_tokens_per_s.{path}"
        if path not in PATHS:
            raise ConfigError(f"{key}: unknown path (allowed: {', '.join(PATHS)})")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
            raise ConfigError(f"{key}: expected a positive number, got {rate!r}")


def _check_qos_classes(config: SchedulerConfig) -> None:
    names: list[str] = []
    keys: set[str] = set()
    for i, qos in enumerate(config.qos_classes):
        path = f"scheduler.qos_classes[{i}]"
        if not qos.name:
            raise ConfigError(f"{path}.name: must not be empty")
        if qos.name in names:
            raise ConfigError(f"{path}.name: duplicate QoS class {qos.name!r}")
        names.append(qos.name)
        if not 0 <= qos.reserved_fraction <= 1:
            raise ConfigError(f"{path}.reserved_fraction: {qos.reserved_fraction} is not within [0, 1]")
        _at_least(qos.ttft_slo_ms, 0, f"{path}.ttft_slo_ms")
        for key in qos.api_keys:
            if key in keys:
                raise ConfigError(f"{path}.api_keys: key already mapped to another class")
            keys.add(key)
    if sum(q.reserved_fraction for q in config.qos_classes) > 1:
        raise ConfigError("scheduler.qos_classes: reserved_fraction values add up to more than 1")
    allowed = names or ["default"]
    if config.default_qos_class not in allowed:
        raise ConfigError(f"scheduler.default_qos_class: {config.default_qos_class!r} is not a configured "
                          f"class (allowed: {', '.join(allowed)})")


def _check_adaptive(config: SchedulerConfig) -> None:
    if config.link_capacity_gbps <= 0:
        raise ConfigError(f"scheduler.link_capacity_gbps: expected a positive number, got {config.link_capacity_gbps}")
    if not 0 < config.threshold_lower_utilization < config.threshold_raise_utilization:
        raise ConfigError("scheduler.threshold_lower_utilization: must be above 0 and below "
                          f"threshold_raise_utilization ({config.threshold_raise_utilization})")
    if config.threshold_step <= 1:
        raise ConfigError(f"scheduler.threshold_step: must be greater than 1, got {config.threshold_step}")
    _at_least(config.threshold_hold_s, 0, "scheduler.threshold_hold_s")
    _at_least(config.congestion_retransmit_ratio, 0, "scheduler.congestion_retransmit_ratio")
    _at_least(config.congestion_rtt_increase_ms, 0, "scheduler.congestion_rtt_increase_ms")
    _at_least(config.congestion_queue_depth, 1, "scheduler.congestion_queue_depth")
    _at_least(config.reoptimize_interval_s, 0, "scheduler.reoptimize_interval_s")
    ceiling = config.max_offload_threshold_tokens
    if ceiling is not None and ceiling < config.offload_threshold_tokens:
        raise ConfigError(f"scheduler.max_offload_threshold_tokens: {ceiling} is below "
                          f"offload_threshold_tokens ({config.offload_threshold_tokens})")


def _check_placement(config: SchedulerConfig) -> None:
    _at_least(config.cache_block_size, 1, "scheduler.cache_block_size")
    if not config.cache_kv_groups:
        raise ConfigError("scheduler.cache_kv_groups: must list at least one group")
    _at_least(config.cache_lookup_timeout_ms, 0, "scheduler.cache_lookup_timeout_ms")
    _fraction(config.kv_high_watermark, "scheduler.kv_high_watermark")
    _at_least(config.worker_backoff_s, 0, "scheduler.worker_backoff_s")
    _at_least(config.max_worker_backoff_s, config.worker_backoff_s, "scheduler.max_worker_backoff_s")
    _at_least(config.decode_kv_capacity_tokens, 0, "scheduler.decode_kv_capacity_tokens")
    _fraction(config.decode_kv_limit, "scheduler.decode_kv_limit")


def _check_role_flips(flips: RoleFlipsConfig) -> None:
    for key in ("min_dwell_s", "sustain_s", "max_drain_s"):
        _at_least(getattr(flips, key), 0, f"scheduler.role_flips.{key}")
    if not 0 <= flips.prefill_queue_low < flips.prefill_queue_high:
        raise ConfigError("scheduler.role_flips.prefill_queue_low: must be at least 0 and below "
                          f"prefill_queue_high ({flips.prefill_queue_high})")
    if not 0 <= flips.decode_utilization_low < flips.decode_utilization_high <= 1:
        raise ConfigError("scheduler.role_flips.decode_utilization_low: need 0 <= decode_utilization_low < "
                          "decode_utilization_high <= 1")
    _at_least(flips.min_workers_per_role, 1, "scheduler.role_flips.min_workers_per_role")


def _fraction(value: float, key: str) -> None:
    if not 0 < value <= 1:
        raise ConfigError(f"{key}: {value} is not within (0, 1]")


def _at_least(value: float, low: float, key: str) -> None:
    if value < low:
        raise ConfigError(f"{key}: must be at least {low}, got {value}")
