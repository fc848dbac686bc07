"""What a worker holds for every router: its run-time role (compare-and-set over the authenticated
SetRole RPC, a stale generation refused naming both) and its hand-off slots."""
import asyncio
import datetime

import grpc
import pytest
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.decode_worker.server import DecodeWorkerServicer
from services.engine.serve import CallerGuard
from services.engine.worker_state import Busy, HandoffSlots, NotFlippable, RoleState, StaleGeneration
from services.router.leadership import lease_decision
from services.security import GrpcSecurity, Rejections

TOKEN = "t0ken"


def test_a_flip_is_a_compare_and_set_on_the_generation():
    roles = RoleState("decode")
    assert (roles.current.role, roles.current.draining, roles.current.generation) == ("decode", False, 1)
    roles.compare_and_set(1, "decode", True)
    with pytest.raises(StaleGeneration, match="role generation 1 is stale: the worker is at generation 2"):
        roles.compare_and_set(1, "prefill", False)
    assert roles.compare_and_set(2, "prefill", False).generation == 3
    with pytest.raises(NotFlippable):
        roles.compare_and_set(3, "both", False)
    with pytest.raises(NotFlippable):
        RoleState("both").compare_and_set(1, "prefill", False)


@pytest.mark.parametrize("changes, generate_busy, prefill_busy", [
    ([], False, False),
    ([("decode", True)], True, True),                       # draining: nothing new of either kind
    ([("decode", True), ("prefill", False)], True, False),  # flipped to prefill: no more generations
    ([("prefill", True), ("decode", False)], False, False),
])
def test_what_a_worker_refuses_while_it_drains_or_after_a_flip(changes, generate_busy, prefill_busy):
    roles = RoleState("decode")
    for role, draining in changes:
        roles.compare_and_set(roles.current.generation, role, draining)
    for check, busy in ((roles.check_generate, generate_busy), (roles.check_prefill, prefill_busy)):
        if busy:
            with pytest.raises(Busy):
                check()
        else:
            check()


def test_hand_off_slots_refuse_past_the_limit_and_free_on_exit():
    slots = HandoffSlots(1)
    with slots.held():
        with pytest.raises(Busy, match="1 of 1"):
            with slots.held():
                pass
    assert slots.num_held == 0
    with HandoffSlots(0).held(), HandoffSlots(0).held():  # 0: no limit
        pass


def test_reservations_are_served_first_come_first_served_and_a_prefill_cannot_overtake_them():
    async def main():
        slots = HandoffSlots(1)
        first = await slots.reserve(0)
        waiters = [asyncio.create_task(slots.reserve(5)) for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(Busy, match="1 of 1"):  # a Prefill without a reservation
            with slots.held():
                pass
        granted = []
        with slots.held(first):
            assert slots.num_held == 1 and slots.num_waiting == 3
        for _ in range(3):  # each slot that frees goes to the next waiter, in order
            await asyncio.sleep(0.01)
            done = [i for i, w in enumerate(waiters) if w.done() and i not in granted]
            assert len(done) == 1 and slots.num_held == 1
            granted += done
            with slots.held(waiters[done[0]].result()):
                pass
        return granted, slots.num_held, slots.peak_held
    assert asyncio.run(main()) == ([0, 1, 2], 0, 1)


def test_a_reservation_times_out_expires_and_leaves_the_queue_when_its_caller_goes():
    async def main():
        slots = HandoffSlots(1, ttl_s=0.1)
        unclaimed = await slots.reserve(0)
        with pytest.raises(Busy, match=r"waited 0\.05 s"):
            await slots.reserve(0.05)
        gone = asyncio.create_task(slots.reserve(5))
        await asyncio.sleep(0)
        gone.cancel()  # the router gave up: it leaves the queue
        await asyncio.sleep(0.2)  # the unclaimed reservation expires; its slot is free again
        assert slots.num_held == 0 and slots.num_waiting == 0
        with slots.held(unclaimed):  # expired: a free slot is taken instead
            assert slots.num_held == 1
        reservation = await slots.reserve(0)
        slots.cancel(reservation)  # its Prefill was refused before it started
        assert slots.num_held == 0
        held = await slots.reserve(0)
        draining = asyncio.create_task(slots.reserve(5))
        await asyncio.sleep(0)
        slots.refuse_waiters("the worker is draining for a role flip")
        with pytest.raises(Busy, match="draining"):
            await draining
        slots.cancel(held)
        return slots.num_held, await HandoffSlots(0).reserve(0)
    assert asyncio.run(main()) == (0, "")


def test_set_role_over_grpc_needs_the_token_and_names_both_generations():
    async def main():
        security = GrpcSecurity(token=TOKEN, accepted_tokens=(TOKEN,))
        rejections = Rejections("w")
        guard = CallerGuard(kv_targets=None, rejections=rejections, roles=RoleState("decode"))
        server = grpc.aio.server(options=security.options, interceptors=security.aio_interceptors(rejections))
        pb_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(None, None, guard), server)
        port = security.add_port(server, "127.0.0.1:0")
        await server.start()
        codes = []
        try:
            for caller, request in [
                (security, pb.SetRoleRequest(expected_generation=1, role="decode", draining=True)),
                (security, pb.SetRoleRequest(expected_generation=1, role="prefill")),
                (security, pb.SetRoleRequest(expected_generation=2, role="both")),
                (GrpcSecurity(), pb.SetRoleRequest(expected_generation=2, role="prefill")),
                (security, pb.SetRoleRequest(expected_generation=2, role="prefill")),
            ]:
                async with caller.aio_channel(f"127.0.0.1:{port}") as channel:
                    try:
                        state = await pb_grpc.DecodeWorkerStub(channel).SetRole(request, timeout=5)
                        codes.append(("OK", state.role, state.draining, state.generation))
                    except grpc.aio.AioRpcError as exc:
                        codes.append((exc.code().name, exc.details()))
        finally:
            await server.stop(0)
        return codes
    codes = asyncio.run(main())
    assert codes[0] == ("OK", "decode", True, 2)
    assert codes[1] == ("FAILED_PRECONDITION", "role generation 1 is stale: the worker is at generation 2")
    assert codes[2][0] == "INVALID_ARGUMENT" and "prefill, decode" in codes[2][1]
    assert codes[3][0] == "UNAUTHENTICATED"
    assert codes[4] == ("OK", "prefill", False, 3)


NOW = datetime.datetime(2026, 12, 6, 12, 0, 0, tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize("spec, allowed", [
    ({}, True),                                                                      # nobody holds it
    ({"holderIdentity": "me", "renewTime": "2026-12-06T11:59:59.000000Z", "leaseDurationSeconds": 15}, True),
    ({"holderIdentity": "other", "renewTime": "2026-12-06T11:59:50.000000Z", "leaseDurationSeconds": 15}, False),
    ({"holderIdentity": "other", "renewTime": "2026-12-06T11:59:40.000000Z", "leaseDurationSeconds": 15}, True),
])
def test_a_lease_is_taken_only_from_nobody_or_a_holder_that_stopped_renewing(spec, allowed):
    assert lease_decision(spec, "me", NOW) is allowed
