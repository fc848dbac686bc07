"""The workers' own role state (services/engine/worker_state.RoleState) behind routers' pools that
have no real worker: ``SetRole`` is a compare-and-set on it, and ``poll`` is what a stats poll
brings each pool (several pools share one owner: several routers in front of the same workers)."""
from __future__ import annotations

from services.engine.worker_state import NotFlippable, RoleState, StaleGeneration
from services.router.workers import RoleConflict, WorkerPool


class WorkerRoles:
    def __init__(self, *pools: WorkerPool) -> None:
        first = pools[0]
        self.states = {h.name: RoleState(h.config.role) for h in first.handles}
        self.num_refused = 0
        for pool in pools:
            pool.set_role = self._set_role_for(pool)
            self.poll(pool)

    def _set_role_for(self, pool: WorkerPool):
        async def set_role(handle, role: str, draining: bool) -> None:
            try:
                state = self.states[handle.name].compare_and_set(handle.role_generation, role, draining)
            except (StaleGeneration, NotFlippable) as exc:
                self.num_refused += 1
                raise RoleConflict(str(exc)) from None
            pool._take_role(handle, state.role, state.draining, state.generation)
        return set_role

    def poll(self, pool: WorkerPool) -> None:
        for handle in pool.handles:
            state = self.states[handle.name].current
            pool._take_role(handle, state.role, state.draining, state.generation)
