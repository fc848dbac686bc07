import pytest

from services.config import ConfigError, load_config, parse_config

VALID_WORKER = {"name": "d0", "service": "decode_worker", "port": 50071}


def test_embedded_default_config_loads():
    config = load_config("deploy/local.yaml")
    assert config.model.name == "smollm2-135m-instruct"
    assert {w.service for w in config.workers} == {"prefill_worker", "decode_worker"}


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"workers": [VALID_WORKER], "router": {"port": "x"}}, "router.port: expected int, got 'x'"),
        ({"workers": [{**VALID_WORKER, "role": "x"}]},
         "workers[0].role: 'x' is not allowed (allowed: prefill, decode, both)"),
        ({"workers": [VALID_WORKER], "foo": 1}, "foo: unknown key"),
        ({"workers": []}, "at least one decode_worker"),
        ({"workers": [{"service": "decode_worker", "port": 1}]}, "workers[0].name: required key is missing"),
        ({"workers": [VALID_WORKER, {**VALID_WORKER, "port": 50072}]}, "workers[1].name: duplicate worker name"),
        ({"workers": [VALID_WORKER, {**VALID_WORKER, "name": "d1"}]},
         "workers[1].port: 127.0.0.1:50071 is already used"),
        ({"workers": [{**VALID_WORKER, "engine": {"bogus": 1}}]}, "workers[0].engine.bogus: unknown engine key"),
        ({"workers": [{**VALID_WORKER, "kv_port": 50080, "engine": {"tensor_parallel_size": 2}},
                      {**VALID_WORKER, "name": "d1", "port": 50081}]},
         "workers[1].port: 127.0.0.1:50081 is already used"),
        ({"workers": [{**VALID_WORKER, "kv_port": 50080, "health_port": 50083}], "engine": {"tensor_parallel_size": 4}},
         "workers[0].health_port: 127.0.0.1:50083 is already used"),
        ({"workers": [{**VALID_WORKER, "kv_port": 50080}, {**VALID_WORKER, "name": "d1", "port": 50072,
                                                          "kv_port": 50079, "engine": {"tensor_parallel_size": 2}}]},
         "workers[1].kv_port: 127.0.0.1:50080 (TP rank 1's KV port) is already used"),
        ({"workers": [{**VALID_WORKER, "kv_port": 65535, "engine": {"tensor_parallel_size": 2}}]},
         "workers[0].kv_port: 65535 leaves no port for each of the engine's 2 TP ranks"),
        ({"workers": [{**VALID_WORKER, "engine": {"tensor_parallel_size": 0}}]},
         "workers[0].engine.tensor_parallel_size: 0 is not a positive number of ranks"),
        ({"workers": [{**VALID_WORKER, "engine": {"block_size": 0}}]},
         "workers[0].engine.block_size: 0 is not a positive number of tokens"),
        ({"workers": [VALID_WORKER], "engine": {"block_size": -32}}, "engine.block_size: -32 is not a positive"),
        ({"workers": [VALID_WORKER], "router": {"api_keys": "k"}}, "router.api_keys: expected a list"),
        ({"workers": [VALID_WORKER], "engine": {"enforce_eager": 1}}, "engine.enforce_eager: expected bool"),
        ({"workers": [VALID_WORKER], "model": []}, "model: expected a mapping"),
        ({"workers": [VALID_WORKER], "engine": {"enable_chunked_prefill": False, "max_num_batched_tokens": 512}},
         "engine.max_num_batched_tokens: 512 is below model.max_model_len"),
        ({"workers": [{**VALID_WORKER, "engine": {"enable_chunked_prefill": False}}],
          "engine": {"max_num_batched_tokens": 512}},
         "workers[0].engine.max_num_batched_tokens: 512 is below model.max_model_len"),
    ],
)
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ConfigError) as excinfo:
        parse_config(raw)
    assert message in str(excinfo.value)


def test_per_worker_engine_overrides_apply_only_to_that_worker():
    config = parse_config({"workers": [{**VALID_WORKER, "engine": {"max_num_seqs": 4}},
                                       {**VALID_WORKER, "name": "d1", "port": 50072}]})
    assert config.engine_for(config.worker("d0")).max_num_seqs == 4
    assert config.engine_for(config.worker("d1")).max_num_seqs == config.engine.max_num_seqs


def test_a_worker_dtype_overrides_the_models_for_that_worker_only():
    config = parse_config({"workers": [{**VALID_WORKER, "dtype": "bfloat16"}, {**VALID_WORKER, "name": "d1",
                                                                              "port": 50072}],
                           "model": {"dtype": "float32"}})
    assert config.model_for(config.worker("d0")).dtype == "bfloat16"
    assert config.model_for(config.worker("d1")) == config.model


def test_whole_prompt_steps_are_accepted_when_a_step_holds_the_longest_prompt():
    config = parse_config({"workers": [VALID_WORKER], "model": {"max_model_len": 2048},
                           "engine": {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}})
    assert not config.engine_for(config.worker("d0")).enable_chunked_prefill


def test_unreadable_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_the_kv_targets_a_prefill_may_dial_name_each_engines_tp_size():
    from services.security.peers import decode_kv_targets

    config = parse_config({"workers": [{**VALID_WORKER, "kv_port": 50080, "engine": {"tensor_parallel_size": 2}},
                                       {**VALID_WORKER, "name": "d1", "port": 50072, "kv_port": 50090}]})
    targets = decode_kv_targets(config)
    assert targets.refusal("127.0.0.1:50080", 2) is None and targets.refusal("127.0.0.1:50090") is None
    assert "runs 2 TP rank(s) in the deployment config, not 1" in targets.refusal("127.0.0.1:50080", 1)
    assert "runs 1 TP rank(s) in the deployment config, not 4" in targets.refusal("127.0.0.1:50090", 4)
    assert "is not one of the deployment's worker KV ports" in targets.refusal("127.0.0.1:50081", 1)
