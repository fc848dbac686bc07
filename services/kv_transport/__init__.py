"""The KV data plane's wire: authenticated, framed, striped TCP between prefill and decode workers.

``KVTransport`` is the only entry point (see ``transport.py``); it knows nothing about vLLM.
"""
from services.kv_transport.protocol import PROTOCOL_VERSION
from services.kv_transport.settings import TransportSettings
from services.kv_transport.telemetry import PeerSnapshot, TransportSnapshot
from services.kv_transport.transport import Frame, KVTransport, TransferDone, TransferFailed

__all__ = ["PROTOCOL_VERSION", "Frame", "KVTransport", "PeerSnapshot", "TransferDone", "TransferFailed",
           "TransportSettings", "TransportSnapshot"]
