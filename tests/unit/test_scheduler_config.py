"""The scheduler section: QoS classes, admission and adaptive-threshold keys; errors name the key."""
import pytest

from services.config import ConfigError, parse_config

WORKERS = [{"name": "d0", "service": "decode_worker", "port": 50071}]


def scheduler(**section):
    return parse_config({"workers": WORKERS, "scheduler": section}).scheduler


def test_everything_is_off_by_default():
    config = scheduler()
    assert not config.admission_control and not config.adaptive_threshold
    assert config.qos_classes == () and config.default_qos_class == "default"


def test_qos_classes_parse():
    config = scheduler(admission_control=True, default_qos_class="batch",
                       qos_classes=[{"name": "interactive", "priority": 10, "reserved_fraction": 0.3,
                                     "ttft_slo_ms": 2000, "api_keys": ["k1"]},
                                    {"name": "batch"}])
    assert [q.name for q in config.qos_classes] == ["interactive", "batch"]
    assert config.qos_classes[0].api_keys == ("k1",) and config.qos_classes[1].priority == 0


@pytest.mark.parametrize("section, message", [
    ({"qos_classes": [{"priority": 1}]}, "scheduler.qos_classes[0].name: required key is missing"),
    ({"qos_classes": [{"name": "a", "colour": 1}]}, "scheduler.qos_classes[0].colour: unknown key"),
    ({"qos_classes": [{"name": "a", "priority": "high"}]}, "scheduler.qos_classes[0].priority: expected int"),
    ({"qos_classes": [{"name": "default"}, {"name": "default"}]}, "scheduler.qos_classes[1].name: duplicate"),
    ({"qos_classes": [{"name": ""}]}, "scheduler.qos_classes[0].name: must not be empty"),
    ({"qos_classes": [{"name": "default", "reserved_fraction": 1.5}]},
     "scheduler.qos_classes[0].reserved_fraction: 1.5 is not within [0, 1]"),
    ({"qos_classes": [{"name": "default", "reserved_fraction": 0.6}, {"name": "b", "reserved_fraction": 0.6}]},
     "scheduler.qos_classes: reserved_fraction values add up to more than 1"),
    ({"qos_classes": [{"name": "default", "ttft_slo_ms": -1}]},
     "scheduler.qos_classes[0].ttft_slo_ms: must be at least 0"),
    ({"qos_classes": [{"name": "default", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]},
     "scheduler.qos_classes[1].api_keys: key already mapped"),
    ({"qos_classes": [{"name": "gold"}]},
     "scheduler.default_qos_class: 'default' is not a configured class (allowed: gold)"),
    ({"default_qos_class": "gold"}, "scheduler.default_qos_class: 'gold' is not a configured class (allowed: default)"),
    ({"prefill_tokens_per_s": {"remote": 1}}, "scheduler.prefill_tokens_per_s.remote: unknown path"),
    ({"prefill_tokens_per_s": {"local": 0}}, "scheduler.prefill_tokens_per_s.local: expected a positive number"),
    ({"max_in_flight_requests": -1}, "scheduler.max_in_flight_requests: must be at least 0"),
    ({"retry_after_s": 0}, "scheduler.retry_after_s: must be at least 1"),
    ({"admission_control": "yes"}, "scheduler.admission_control: expected bool"),
    ({"link_capacity_gbps": 0}, "scheduler.link_capacity_gbps: expected a positive number"),
    ({"threshold_lower_utilization": 0.9}, "scheduler.threshold_lower_utilization: must be above 0 and below"),
    ({"threshold_step": 1}, "scheduler.threshold_step: must be greater than 1"),
    ({"max_offload_threshold_tokens": 100}, "scheduler.max_offload_threshold_tokens: 100 is below"),
    ({"congestion_queue_depth": 0}, "scheduler.congestion_queue_depth: must be at least 1"),
])
def test_bad_scheduler_config_names_the_key(section, message):
    with pytest.raises(ConfigError) as excinfo:
        scheduler(**section)
    assert message in str(excinfo.value)


def test_every_scheduler_key_is_documented():
    from dataclasses import fields

    from services.config.schema import QosClassConfig, SchedulerConfig

    for cls in (SchedulerConfig, QosClassConfig):
        assert all(f.metadata.get("help") for f in fields(cls)), cls.__name__


def test_new_scheduler_policies_are_off_by_default():
    config = scheduler()
    assert not config.decode_load_admission and not config.role_flips.enabled
    assert config.cache_kv_groups == ("full",) and config.cache_model_key is None


@pytest.mark.parametrize("section, message", [
    ({"cache_block_size": 0}, "scheduler.cache_block_size: must be at least 1"),
    ({"cache_kv_groups": []}, "scheduler.cache_kv_groups: must list at least one group"),
    ({"cache_kv_groups": ["mamba"]}, "scheduler.cache_kv_groups[0]: 'mamba' is not allowed"),
    ({"kv_high_watermark": 1.5}, "scheduler.kv_high_watermark: 1.5 is not within (0, 1]"),
    ({"worker_backoff_s": 5, "max_worker_backoff_s": 2}, "scheduler.max_worker_backoff_s: must be at least 5"),
    ({"decode_kv_limit": 0.0}, "scheduler.decode_kv_limit: 0.0 is not within (0, 1]"),
    ({"decode_kv_capacity_tokens": -1}, "scheduler.decode_kv_capacity_tokens: must be at least 0"),
    ({"role_flips": {"enabled": "yes"}}, "scheduler.role_flips.enabled: expected bool"),
    ({"role_flips": {"min_dwell_s": -1}}, "scheduler.role_flips.min_dwell_s: must be at least 0"),
    ({"role_flips": {"prefill_queue_low": 5}}, "scheduler.role_flips.prefill_queue_low: must be at least 0 and below"),
    ({"role_flips": {"decode_utilization_high": 1.2}}, "scheduler.role_flips.decode_utilization_low: need"),
    ({"role_flips": {"min_workers_per_role": 0}}, "scheduler.role_flips.min_workers_per_role: must be at least 1"),
])
def test_new_keys_are_checked(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        scheduler(**section)
