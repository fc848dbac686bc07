"""``PrfaasConnector``: the class vLLM loads (``kv_connector="PrfaasConnector"``,
``kv_connector_module_path="services.kv_connector.connector"``).

A thin facade: the scheduler role delegates to ``PrfaasConnectorScheduler`` (engine-core process,
no network), the worker role to the worker core ``PrfaasConnectorWorker`` (worker process, owns the
transport, the producer, the consumer and the pool half; imports no vLLM). This class only reads
vLLM's configuration and translates its hooks into plain calls on those. Settings come from
``kv_connector_extra_config`` (see ``settings.ConnectorSettings``).
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.metadata import PrfaasConnectorMetadata
from services.kv_connector.pool.planner import PoolPlanner
from services.kv_connector.pool.worker import PoolWorker
from services.kv_connector.scheduler import PrfaasConnectorScheduler
from services.kv_connector.settings import ConnectorSettings
from services.kv_connector.stats_file import StatsPublisher, rank_path
from services.kv_connector.worker import PrfaasConnectorWorker
from services.kv_connector.layouts.spec import LayoutSpec
from services.kv_connector.layouts.from_vllm import engine_cache_layout, spec_from_vllm, with_cache_layout
from services.logs import setup_package_logging

logger = logging.getLogger(__name__)

KVConnectorMetadata.register(PrfaasConnectorMetadata)  # a plain dataclass (metadata.py), vLLM's kind


class PrfaasConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.of(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        if self.settings.logging:
            setup_package_logging(**self.settings.logging)
        pool = self.settings.open_pool(kv_cache_config, vllm_config.parallel_config.tensor_parallel_size,
                                       engine_cache_layout(kv_cache_config, vllm_config.cache_config.cache_dtype))
        self.pool_io = pool[0] if pool else None
        self.scheduler = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = PrfaasConnectorScheduler(PoolPlanner(*pool) if pool else None)
        if role == KVConnectorRole.WORKER:
            self._tp_rank = _tp_rank()
            self.worker = PrfaasConnectorWorker(partial(self.settings.open_streams, self._tp_rank),
                                                self.settings.worker_settings,
                                                PoolWorker(*pool, rank=self._tp_rank) if pool else None)
        self.publisher: StatsPublisher | None = None

    # Scheduler side (engine-core process) ------------------------------------------------------

    def on_new_request(self, request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> PrfaasConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """A streamed request restores every transfer group, state groups included."""
        return self._kv_cache_config.transfer_group_ids

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    # Worker side (worker process, engine thread) -----------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        layout = KVLayout(self._kv_cache_config, kv_caches,
                          engine_cache_layout(self._kv_cache_config, self._vllm_config.cache_config.cache_dtype))
        self.worker.register_kv_caches(layout, rank_spec(self._vllm_config, self._kv_cache_config, list(kv_caches),
                                                         layout.physical))
        if self.settings.stats_dir is not None:
            self.publisher = StatsPublisher(rank_path(self.settings.stats_dir, self._tp_rank), self.worker.snapshot)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.on_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Loads are applied in ``get_transfer_results``, after the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only after all its KV is in place."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self.worker.get_transfer_results()
        return KVConnectorTransferResults(finished_recving=results.finished_recving,
                                          failed_recving=results.failed_recving)

    def get_finished(self, finished_req_ids: set[str]):
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: sends are taken in ``save_kv_layer``, which the replay of a FULL CUDA graph skips (in
        FULL_AND_PIECEWISE a step of one-token chunks runs as one), and the transfer would then end
        without them. Receives need no layer hook (a request runs once ``finished_recving`` names it,
        after its copies completed), so they alone would keep FULL graphs safe (docs/gpu.md)."""
        return True

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.worker is not None:
            self.worker.shutdown()
        if self.pool_io is not None:
            self.pool_io.close()


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):  # model parallelism not initialised: a single rank
        return 0


def rank_spec(vllm_config, kv_cache_config, layer_names: list[str], physical: dict | None = None) -> LayoutSpec | None:
    """This worker rank's ``LayoutSpec``, from the engine's real ``KVCacheConfig``; None (receive
    only from identical layouts) where it cannot be described."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    model_config = vllm_config.model_config
    try:
        spec = spec_from_vllm(model_config.served_model_name, kv_cache_config, layer_names,
                              get_tensor_model_parallel_rank(), vllm_config.parallel_config.tensor_parallel_size,
                              model_config.get_total_num_kv_heads(), conv_layout=get_conv_state_layout())
        return with_cache_layout(spec, vllm_config.cache_config.cache_dtype, physical)
    except (ValueError, AttributeError, TypeError) as error:
        logger.warning("this worker's KV layout has no description (it receives KV only from identical "
                       "layouts): %s", error)
        return None
