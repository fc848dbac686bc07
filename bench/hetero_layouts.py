"""Bytes on the wire and transfer time when prefill and decode engines lay out KV differently.

For each pairing of block sizes that the KV data path carries, one request's KV (``--tokens``
tokens of the embedded model's shape: its layer count, KV heads, head size and dtype, in vLLM's CPU
cache layout) goes from a producer's connector worker to a consumer's, through ``KVTransport`` over
loopback TCP with its checksums and authentication, as a prefill worker streams it: layer by layer,
in prefill chunks of ``--chunk`` tokens. The consumer re-blocks it into its own blocks, and every
token's K and V is checked against the producer's. The baseline is the KV itself: the bytes the
consumer needs (tokens x layers x KV heads x K and V x head size x dtype). Wire bytes are everything
the sender wrote: frame headers, the LAYOUT frame (fingerprint and layout spec), END, payload,
including the padding of a partial last block (none when the token count is a multiple of every
block size). Time is from the first layer handed to the transport to the consumer's report of the
finished receive, the median of ``--rounds``, after an unmeasured transfer that opens connections.

Pairings between tensor-parallel sizes are planned (``layout_map.wire_cost``: each KV head crosses
once) but not carried yet; they are printed as planned and take no part in the verdict.

    python bench/hetero_layouts.py [--tokens 8192] [--chunk 2048] [--rounds 3]
"""
from __future__ import annotations

import argparse
import math
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import _common  # noqa: F401  (puts the project on sys.path)
import torch
from _common import median, verdict

from services.engine.args import checkpoint_config, resolve_dtype
from services.kv_connector.layout import KVLayout
from services.kv_connector.layout_apply import TORCH_DTYPES, attention_view, token_view
from services.kv_connector.layout_map import Unmappable, plan_mapping, wire_cost
from services.kv_connector.layout_spec import CPU_K_TRANSPOSED, DTYPE_BYTES, LayoutSpec
from services.kv_connector.layout_vllm import spec_from_vllm
from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec, SendSpec
from services.kv_connector.worker import PrfaasConnectorWorker
from services.kv_transport import KVTransport, TransportSettings

PAIRINGS = ((128, 128), (64, 128), (128, 64), (32, 128), (128, 32))  # (prefill, decode) block sizes
PLANNED_TP = ((1, 3), (3, 1))
SECRET = "bench-hetero-secret"
TARGET = 1.01  # wire bytes per KV byte: the KV once, framing under 1%
RECEIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: str

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * 2 * self.head_size * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Result:
    prefill_block: int
    decode_block: int
    wire_bytes: int
    kv_bytes: int
    payload_bytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.wire_bytes / self.kv_bytes


def embedded_model() -> Model:
    from services.models import smollm2

    path = smollm2.prepare()
    config = checkpoint_config(path)
    heads = config["num_attention_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // heads
    return Model(smollm2.NAME, config["num_hidden_layers"],
                 config.get("num_key_value_heads") or heads, head_size, resolve_dtype("auto", str(path)))


class Engine:
    """One side's paged KV cache (vLLM's CPU layout) and its connector worker with a real transport."""

    def __init__(self, model: Model, block_size: int, num_tokens: int, fill: bool, listen: bool) -> None:
        self.block_size = block_size
        self.num_blocks = math.ceil(num_tokens / block_size) + 1  # block 0 is vLLM's null block
        attention = SimpleNamespace(block_size=block_size, num_kv_heads=model.kv_heads, head_size=model.head_size,
                                    dtype=TORCH_DTYPES[model.dtype])
        self.names = [f"layers.{i}" for i in range(model.layers)]
        config = SimpleNamespace(num_blocks=self.num_blocks, kv_cache_groups=[
            SimpleNamespace(layer_names=self.names, kv_cache_spec=attention)])
        shape = (self.num_blocks, model.kv_heads, block_size, 2 * model.head_size)
        generator = torch.Generator().manual_seed(block_size)
        caches = {name: (torch.randn(shape, generator=generator) if fill else torch.zeros(shape))
                  .to(TORCH_DTYPES[model.dtype]) for name in self.names}
        self.spec = spec_from_vllm(model.name, config, self.names, 0, 1, model.kv_heads, cache_layout=CPU_K_TRANSPOSED)
        settings = TransportSettings(secret=SECRET)
        self.worker = PrfaasConnectorWorker(lambda: KVTransport(settings, listen_port=0 if listen else None),
                                            idle_timeout_s=RECEIVE_TIMEOUT_S, max_early_bytes=1 << 32)
        self.worker.register_kv_caches(KVLayout(config, caches), self.spec)
        self.block_ids = tuple(range(1, self.num_blocks))

    def tokens(self, layer: str, num_tokens: int) -> torch.Tensor:
        """K and V of the first ``num_tokens`` tokens of one layer, [tokens, heads, 2, head_size]."""
        view = attention_view(self.worker.layout.caches[layer], self.spec.layers[0], self.block_size)
        positions = torch.arange(num_tokens)
        blocks = torch.tensor(self.block_ids)[positions // self.block_size]
        return torch.stack([token_view(view, half)[blocks, :, positions % self.block_size] for half in (0, 1)], dim=2)

    def close(self) -> None:
        self.worker.shutdown()


def transfer(producer: Engine, consumer: Engine, transfer_id: str, num_tokens: int, chunk: int) -> float:
    """Stream one request's KV; returns the seconds until the consumer reported it received."""
    peer = f"127.0.0.1:{consumer.worker.streams.port}"
    consumer.worker.on_metadata(PrfaasConnectorMetadata(recvs=[RecvSpec(
        "r", transfer_id, (consumer.block_ids,), 0, num_tokens)]))
    outcome: dict[str, float | str] = {}

    def receive() -> None:
        deadline = time.monotonic() + RECEIVE_TIMEOUT_S
        while time.monotonic() < deadline:
            results = consumer.worker.get_transfer_results()
            if results.failed_recving:
                outcome["error"] = "the consumer failed the receive (see the log)"
                return
            if results.finished_recving:
                outcome["done"] = time.perf_counter()
                return
            time.sleep(0.0005)
        outcome["error"] = f"no complete receive in {RECEIVE_TIMEOUT_S:.0f} s"

    receiver = threading.Thread(target=receive)
    receiver.start()
    start = time.perf_counter()
    for first in range(0, num_tokens, chunk):
        send = SendSpec("r", transfer_id, peer, (producer.block_ids,), first, min(first + chunk, num_tokens),
                        num_tokens)
        producer.worker.on_metadata(PrfaasConnectorMetadata(sends=[send]))
        for name in producer.names:
            producer.worker.save_kv_layer(name)
        producer.worker.wait_for_save()
    receiver.join()
    if "error" in outcome:
        raise RuntimeError(f"transfer {transfer_id}: {outcome['error']}")
    return float(outcome["done"]) - start


def run_pairing(model: Model, prefill_block: int, decode_block: int, args) -> Result:
    producer = Engine(model, prefill_block, args.tokens, fill=True, listen=False)
    consumer = Engine(model, decode_block, args.tokens, fill=False, listen=True)
    try:
        transfer(producer, consumer, "warm-up", args.tokens, args.chunk)
        before = sent_bytes(producer)
        seconds = [transfer(producer, consumer, f"round-{i}", args.tokens, args.chunk) for i in range(args.rounds)]
        wire = (sent_bytes(producer) - before) // args.rounds
        for name in consumer.names:
            if not torch.equal(consumer.tokens(name, args.tokens), producer.tokens(name, args.tokens)):
                raise RuntimeError(f"{prefill_block} -> {decode_block}: layer {name} differs after the transfer")
        payload = model.kv_bytes_per_token * _sent_tokens(args, prefill_block)
        return Result(prefill_block, decode_block, wire, model.kv_bytes_per_token * args.tokens, payload,
                      median(seconds))
    finally:
        producer.close()
        consumer.close()


def _sent_tokens(args, block_size: int) -> int:
    """Tokens of KV the producer sends: whole blocks, the last one padded."""
    return math.ceil(args.tokens / block_size) * block_size


def sent_bytes(engine: Engine) -> int:
    return sum(peer.bytes_sent for peer in engine.worker.streams.snapshot().peers)


def planned_rows(model: Model) -> list[str]:
    rows = []
    for src_tp, dst_tp in PLANNED_TP:
        def ranks(tp: int) -> list[LayoutSpec]:
            engine = SimpleNamespace(block_size=128, num_kv_heads=max(1, model.kv_heads // tp),
                                     head_size=model.head_size, dtype=TORCH_DTYPES[model.dtype])
            names = [f"layers.{i}" for i in range(model.layers)]
            config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=engine)])
            return [spec_from_vllm(model.name, config, names, rank, tp, model.kv_heads) for rank in range(tp)]

        plan = plan_mapping(ranks(src_tp), ranks(dst_tp))
        what = plan.reason if isinstance(plan, Unmappable) else f"planned wire/KV {wire_cost(plan).ratio:.3f}"
        rows.append(f"  TP {src_tp} -> TP {dst_tp}: {what} (head slicing: not carried yet)")
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of KV per transfer (default 8192)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk in tokens (default 2048)")
    parser.add_argument("--rounds", type=int, default=3, help="measured transfers per pairing (default 3)")
    args = parser.parse_args(argv)
    for name in ("tokens", "chunk", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model = embedded_model()
    print(f"model {model.name}: {model.layers} layers, {model.kv_heads} KV heads of {model.head_size}, "
          f"{model.dtype}: {model.kv_bytes_per_token} B of KV per token; {args.tokens} tokens per transfer, "
          f"chunks of {args.chunk}, {args.rounds} rounds", flush=True)
    results = []
    for prefill_block, decode_block in PAIRINGS:
        print(f"block size {prefill_block} -> {decode_block} ...", flush=True)
        results.append(run_pairing(model, prefill_block, decode_block, args))
    same = next(r.seconds for r in results if r.prefill_block == r.decode_block)
    print(f"\n{'blocks':>12} {'KV MB':>8} {'wire MB':>8} {'wire/KV':>8} {'padding':>8} {'framing':>8} "
          f"{'ms':>7} {'GB/s':>6} {'time vs same':>12}")
    for r in results:
        padding = (r.payload_bytes - r.kv_bytes) / r.kv_bytes
        framing = (r.wire_bytes - r.payload_bytes) / r.kv_bytes
        print(f"{r.prefill_block:>5} -> {r.decode_block:<4} {r.kv_bytes / 1e6:>8.1f} {r.wire_bytes / 1e6:>8.1f} "
              f"{r.ratio:>8.4f} {padding:>8.2%} {framing:>8.3%} {r.seconds * 1e3:>7.1f} "
              f"{r.kv_bytes / r.seconds / 1e9:>6.2f} {r.seconds / same:>12.2f}")
    print("planned, not measured:")
    print("\n".join(planned_rows(model)))
    worst = max(results, key=lambda r: r.ratio)
    return verdict("hetero layouts: worst wire bytes per KV byte", worst.ratio, TARGET,
                   f"block sizes {worst.prefill_block} -> {worst.decode_block}, {len(results)} pairings, "
                   f"{args.tokens} tokens, every token checked", higher_is_better=False)


if __name__ == "__main__":
    raise SystemExit(main())
