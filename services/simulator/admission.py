"""The router's admission control in the simulator, judged as ``services.router.admission.AdmissionControl``
judges it: after routing, ``services.scheduling.admission.admit`` over a snapshot of the requests in
flight (admitted, last token not yet out), the capacity (``max_in_flight``, else ``max_batch_size`` per
generating instance), and the chosen path's :class:`~services.scheduling.admission.PrefillQueue`
(prompt tokens routed to it and not at their first token, and its prefill rate measured over its busy
time). One QoS class, with ``admission_ttft_slo_s`` as its TTFT SLO. The decode-load check
(``decode_load_admission``) is not modelled.
"""
from __future__ import annotations

from array import array

from services.scheduling.admission import AdmissionSnapshot, PrefillQueue, QosClass, admit
from services.simulator.runtime import RuntimeModel

PATHS = ("local", "pd", "prfaas")


class SimAdmission:
    def __init__(self, runtime: RuntimeModel, num_generating_slots: int, num_requests: int) -> None:
        self.qos = QosClass("default", ttft_slo_s=runtime.admission_ttft_slo_s)
        self.classes = (self.qos,)
        self.capacity = runtime.max_in_flight or num_generating_slots
        self.queues = [PrefillQueue() for _ in PATHS]
        self.path = bytearray(num_requests)
        self.tokens = array("q", bytes(8 * num_requests))
        self.num_in_flight = 0
        self.rejected: dict[str, int] = {}

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def admitted(self, now: float, rid: int, path: str, num_prompt_tokens: float) -> bool:
        """Admit ``rid`` (counting it in flight and in its path's prefill queue) or count its rejection."""
        index = PATHS.index(path)
        queue, tokens = self.queues[index], round(num_prompt_tokens)
        snapshot = AdmissionSnapshot(can_serve=True, capacity=self.capacity, num_in_flight=self.num_in_flight,
                                     num_queued_prefill_tokens=queue.num_queued_tokens,
                                     prefill_tokens_per_s=queue.tokens_per_s)
        rejection = admit(self.qos, self.classes, tokens, snapshot)
        if rejection is not None:
            self.rejected[rejection.reason] = self.rejected.get(rejection.reason, 0) + 1
            return False
        self.num_in_flight += 1
        self.path[rid], self.tokens[rid] = index, tokens
        queue.enqueue(tokens, now)
        return True

    def first_token(self, now: float, rid: int) -> None:
        self.queues[self.path[rid]].dequeue(self.tokens[rid], now, prefilled=True)

    def finished(self) -> None:
        self.num_in_flight -= 1
