"""Connector settings, passed by the worker through vLLM's ``kv_connector_extra_config``."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

from services.kv_connector.device import CPU_FRAME_BYTES, DEFAULT_SLOT_BYTES

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    listen_host: str = "127.0.0.1"
    listen_port: int | None = None  # None: this engine only sends
    max_early_bytes: int = 256 << 20
    # Stream each layer's KV as soon as it is computed; False holds it all until the prefill ends
    # (only useful to measure what layer-wise streaming saves: bench/layerwise_overlap.py).
    layerwise: bool = True
    transport: dict = field(default_factory=dict)
    security: dict = field(default_factory=dict)  # the deployment's `security` section (gRPC to the pool)
    # The cluster's cache pool (host:port); None: no pool, nothing is looked up, loaded or stored.
    cache_pool_address: str | None = None
    cache_pool_model: str = ""  # the pool's model key (names the model and its KV layout)
    cache_pool_lookup_timeout_s: float = 0.5  # a slow lookup delays only its own request
    # The worker's `logging` section and name: the connector's log lines in the engine's processes.
    logging: dict = field(default_factory=dict)
    # The worker's private directory, where each rank writes its telemetry between engine steps
    # (stats_file.py); None: the telemetry rides on vLLM's connector stats, which need engine steps.
    stats_dir: str | None = None
    # Pinned host memory per direction for KV between the cache and the transport (docs/gpu.md sizes
    # it): a full ring makes a save wait, it never allocates. Slots hold at least one block. None: the
    # device's defaults (``device.save_ring_bytes`` / ``receive_ring_bytes``: 1 GiB / 256 MiB on CUDA,
    # 256 MiB on CPU).
    host_ring_bytes: int | None = None
    host_ring_slot_bytes: int = DEFAULT_SLOT_BYTES
    # Code the attention KV this engine sends with the codec its peer agreed on (`transport.codec`): set
    # for the PrfaaS cluster's workers, whose KV crosses the inter-datacenter link; others send raw.
    code_sends: bool = False
    # One scale per frame instead of one per (block, head, K or V): what an FP8 cache with a static
    # per-tensor scale does. Only for measuring the codec against it (bench/wire_codec_quality.py).
    codec_scale_per_tensor: bool = False

    @classmethod
    def of(cls, extra: dict) -> "ConnectorSettings":
        known = {k: v for k, v in extra.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def to_extra_config(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @property
    def worker_settings(self):
        """The worker core's settings (``worker.WorkerSettings``) from these and the transport's."""
        from services.kv_connector.consumer import ReceiveSettings
        from services.kv_connector.producer import SendSettings
        from services.kv_connector.worker import WorkerSettings

        transport = self.transport_settings
        return WorkerSettings(
            ReceiveSettings(transport.recv_idle_timeout_s, self.max_early_bytes, transport.recv_first_frame_timeout_s),
            SendSettings(self.layerwise, self.code_sends),
            self.host_ring_bytes, self.host_ring_slot_bytes)

    @property
    def transport_settings(self):
        from services.kv_transport import TransportSettings

        return TransportSettings.of(self.transport)

    def open_pool(self, kv_cache_config, tp_size: int = 1, cache_layout: str = ""):
        """The pool's I/O bridge and this engine's pool keys (one per TP rank; ``cache_layout``: the
        CPU kernel's, ``KVLayout``); None when no pool is configured or the model has KV-cache groups
        the pool cannot hold."""
        from services.kv_connector.pool.io import PoolIO

        if not self.cache_pool_address:
            return None
        model = pool_model(self.cache_pool_model, kv_cache_config, tp_size, cache_layout)
        if model is None:
            logger.warning("cache pool %s not used: the model has KV-cache groups it cannot hold",
                           self.cache_pool_address)
            return None
        from services.kv_transport import TransportSettings

        return PoolIO(self.cache_pool_address, self.cache_pool_lookup_timeout_s,
                      TransportSettings.of(self.transport), self.listen_host, self.grpc_security), model

    @property
    def grpc_security(self):
        from services.config.load import build
        from services.config.schema import SecurityConfig
        from services.security import GrpcSecurity

        return GrpcSecurity.from_sections(build(SecurityConfig, self.security, "security"), self.transport)

    def open_streams(self, tp_rank: int = 0, frame_bytes: int = CPU_FRAME_BYTES):
        """The transport of one TP rank: rank r of a receiving engine listens at ``listen_port + r``
        and asks producers for frames of ``frame_bytes`` (its device's default: ``PrfaasConnectorWorker``
        passes it) unless ``transport.frame_bytes`` is set."""
        from services.kv_connector.codecs import encode
        from services.kv_transport import KVTransport, TransportSettings

        port = self.listen_port + tp_rank if self.listen_port is not None else None
        encoder = partial(encode, per_tensor=self.codec_scale_per_tensor) if self.code_sends else None
        return KVTransport(TransportSettings.of(self.transport), self.listen_host, port, encoder, frame_bytes)


def pool_model(model: str, kv_cache_config, tp_size: int = 1, cache_layout: str = ""):
    """This engine's ``PoolModel`` from vLLM's ``KVCacheConfig``; None when a group is neither full
    attention nor a recurrent state (e.g. sliding window), or the full-attention groups disagree on
    the block size: the pool is then not used."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

    from services.cache_pool_client.types import GroupKind, KvCacheGroup, layout_key
    from services.kv_connector.layouts.pages import spec_fingerprint
    from services.kv_connector.pool.io import PoolModel

    groups, block_sizes = [], set()
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if isinstance(spec, MambaSpec):
            groups.append(KvCacheGroup(group_id, GroupKind.LINEAR_ATTENTION))
        elif all(type(s) is FullAttentionSpec for s in specs):
            groups.append(KvCacheGroup(group_id, GroupKind.FULL_ATTENTION))
            block_sizes.add(spec.block_size)
        else:
            return None
    if len(block_sizes) != 1:
        return None
    return PoolModel(layout_key(model, spec_fingerprint(kv_cache_config, cache_layout)), block_sizes.pop(),
                     tuple(groups), tp_size)
