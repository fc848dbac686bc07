"""support/baseline.py caches reference answers by a hash of everything they depend on: a hit
starts no engine, anything changed (prompts, budgets, engine settings, the checkpoint's bytes) is a
miss that computes again, and a torn cache file is recomputed rather than trusted."""
import json

import pytest

from support import baseline


@pytest.fixture
def engine_runs(tmp_path, monkeypatch):
    """The reference script is not run: each call is recorded and answers from the prompt's length."""
    monkeypatch.setenv("PRFAAS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PRFAAS_REFERENCE_CACHE", raising=False)
    runs = []

    def run_python(code, env=None, timeout=600):
        path = code.split('inputs = json.load(open("', 1)[1].split('"', 1)[0]
        prompts = json.load(open(path))["prompts"]
        runs.append((code, env, prompts))
        return "RESULT" + json.dumps([[f"text-{len(p)}", 1.5, [len(p)]] for p in prompts]) + "\n"

    monkeypatch.setattr(baseline, "run_python", run_python)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "weights.bin").write_bytes(b"\0" * 1024)
    baseline._checkpoint_digest.cache_clear()
    yield runs, model
    baseline._checkpoint_digest.cache_clear()


def test_a_second_identical_call_starts_no_engine(engine_runs):
    runs, model = engine_runs
    first = baseline.colocated_greedy(str(model), [[1, 2, 3], [4, 5]], [2, 2], 8)
    again = baseline.colocated_greedy(str(model), [[1, 2, 3], [4, 5]], [2, 2], 8)
    assert first == again == ["text-3", "text-2"]
    assert len(runs) == 1
    assert baseline.greedy_margins(str(model), [[1, 2, 3], [4, 5]], [2, 2], 8) == [("text-3", 1.5), ("text-2", 1.5)]
    assert len(runs) == 2, "logprobs are part of the key: margins are another reference run"


@pytest.mark.parametrize("change", ["prompt", "budget", "tokens", "engine", "cpu", "weights"])
def test_anything_the_answer_depends_on_is_another_key(engine_runs, change):
    runs, model = engine_runs
    call = {"prompts": [[1, 2, 3]], "budgets": [2], "max_tokens": 8, "cpu": 0, "engine": {}}
    baseline.colocated_greedy(str(model), call["prompts"], call["budgets"], call["max_tokens"], cpu=call["cpu"])
    if change == "weights":
        (model / "weights.bin").write_bytes(b"\1" * 1024)
        baseline._checkpoint_digest.cache_clear()
    changed = {"prompt": {"prompts": [[1, 2, 4]]}, "budget": {"budgets": [3]}, "tokens": {"max_tokens": 9},
               "engine": {"engine": {"block_size": 64}}, "cpu": {"cpu": 1}, "weights": {}}[change]
    call.update(changed)
    baseline.colocated_greedy(str(model), call["prompts"], call["budgets"], call["max_tokens"], cpu=call["cpu"],
                              **call["engine"])
    assert len(runs) == 2


def test_a_torn_cache_file_is_recomputed_and_the_cache_can_be_turned_off(engine_runs, monkeypatch, tmp_path):
    runs, model = engine_runs
    baseline.colocated_greedy(str(model), [[1, 2, 3]], [2], 8)
    (entry,) = (tmp_path / "cache" / "references").glob("*.json")
    entry.write_text('[["text-3", 1.5')
    assert baseline.colocated_greedy(str(model), [[1, 2, 3]], [2], 8) == ["text-3"]
    assert len(runs) == 2 and json.loads(entry.read_text()) == [["text-3", 1.5, [3]]]
    monkeypatch.setenv("PRFAAS_REFERENCE_CACHE", "0")
    baseline.colocated_greedy(str(model), [[1, 2, 3]], [2], 8)
    assert len(runs) == 3
