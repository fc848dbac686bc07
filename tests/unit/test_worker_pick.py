import pytest

from services.router.policy import WorkerView, pick_least_loaded


def view(name, healthy=True, generate=True, in_flight=0, active=0, running=0, waiting=0, kv=0.0):
    return WorkerView(name, healthy, generate, in_flight, active, running, waiting, kv)


@pytest.mark.parametrize(
    "workers, exclude, expected",
    [
        ((), frozenset(), None),
        ((view("a"), view("b")), frozenset(), "a"),
        ((view("a", in_flight=2), view("b", in_flight=1)), frozenset(), "b"),
        ((view("a", running=3), view("b", active=1)), frozenset(), "b"),
        ((view("a", waiting=1), view("b", waiting=1, kv=0.5)), frozenset(), "a"),
        ((view("a", healthy=False), view("b", in_flight=9)), frozenset(), "b"),
        ((view("a", generate=False), view("b", in_flight=9)), frozenset(), "b"),
        ((view("a"), view("b", in_flight=9)), frozenset({"a"}), "b"),
        ((view("a", healthy=False),), frozenset(), None),
    ],
)
def test_pick_least_loaded(workers, exclude, expected):
    assert pick_least_loaded(workers, exclude) == expected
