"""Layer-wise KV streaming vs sending after prefill: how much transfer time stays exposed.

A real vLLM engine (the embedded SmolLM2, in this process) prefills a long prompt with the PrfaaS
connector and streams its KV to a receiver in a network namespace behind a capped link. The link is
sized from a first, uncapped prefill so that moving the whole KV takes ``--transfer-fraction`` of
the prefill time (a large fraction, yet a link that could keep up). Exposed transfer time = KV fully
received minus prefill end, measured with layer-wise streaming (the default) and with every frame
held until the prefill ends. Needs root (namespace, tc).

    python bench/layerwise_overlap.py [--prompt-tokens 4000] [--transfer-fraction 0.6]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import _common  # noqa: F401  (puts the project on sys.path)
from _common import start_receiver, verdict, wait_transfer, wan_link

from services.engine.args import resolve_dtype

SECRET = "bench-secret"
PORT = 47112
BUDGET = 512

def run_mode(layerwise: bool, prompt: list[int], receiver, model: str, peer: str) -> tuple[float, float]:
    """(prefill seconds, exposed transfer seconds) for one engine in one mode."""
    import uuid

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from services.kv_connector.params import produce
    from services.kv_connector.settings import ConnectorSettings

    settings = ConnectorSettings(layerwise=layerwise, transport={"secret": SECRET})
    llm = LLM(model=model, max_model_len=len(prompt) + 16, dtype=resolve_dtype("auto", model), enforce_eager=True,
              max_num_batched_tokens=BUDGET, enable_prefix_caching=False,
              kv_transfer_config=KVTransferConfig(kv_connector="PrfaasConnector",
                                                  kv_connector_module_path="services.kv_connector.connector",
                                                  kv_role="kv_both",
                                                  kv_connector_extra_config=settings.to_extra_config()))
    try:
        run_id = uuid.uuid4().hex[:8]  # the receiver ignores a transfer id it has seen finish
        warm = produce(f"warm-{run_id}", peer)
        llm.generate([TokensPrompt(prompt_token_ids=prompt[:BUDGET])],
                     SamplingParams(max_tokens=1, extra_args=warm.to_extra_args()), use_tqdm=False)
        wait_transfer(receiver, warm.transfer_id)
        params = produce(f"run-{run_id}", peer)
        start = time.time()
        llm.generate([TokensPrompt(prompt_token_ids=list(prompt))],
                     SamplingParams(max_tokens=1, extra_args=params.to_extra_args()), use_tqdm=False)
        prefill_end = time.time()
        done_at = wait_transfer(receiver, params.transfer_id)
        # The last frames may land before generate() returns: then nothing of the transfer is exposed.
        return prefill_end - start, max(0.0, done_at - prefill_end)
    finally:
        del llm


def kv_bits(model: str, num_tokens: int) -> float:
    """Bits of full-attention KV the producer sends for ``num_tokens`` prompt tokens (bf16 K and V)."""
    import json
    from pathlib import Path

    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2
    return per_token * num_tokens * 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="prompt length (default 4000)")
    parser.add_argument("--transfer-fraction", type=float, default=0.6,
                        help="whole-KV transfer time on the capped link over the prefill time (default 0.6)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from services.models import smollm2

    model = str(smollm2.prepare())
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    with wan_link(10000, 0) as link:
        receiver, _ = start_receiver(SECRET, link.ns_addr, PORT, netns=link.ns)
        peer = f"{link.ns_addr}:{PORT}"
        try:
            prefill_s, _ = run_mode(False, prompt, receiver, model, peer)
            rate_mbit = max(10, round(kv_bits(model, len(prompt)) / (args.transfer_fraction * prefill_s) / 1e6))
            link.set_rate(rate_mbit)
            print(f"prefill {prefill_s:.2f} s uncapped: link capped at {rate_mbit} Mbit/s", file=sys.stderr)
            after_prefill, exposed_after = run_mode(False, prompt, receiver, model, peer)
            print(f"send after prefill: prefill {after_prefill:.2f} s, exposed transfer {exposed_after:.3f} s",
                  file=sys.stderr)
            layerwise, exposed_layerwise = run_mode(True, prompt, receiver, model, peer)
            print(f"layer-wise:         prefill {layerwise:.2f} s, exposed transfer {exposed_layerwise:.3f} s",
                  file=sys.stderr)
        finally:
            receiver.kill()
    ratio = exposed_layerwise / exposed_after
    return verdict("layer-wise exposed transfer time / send-after-prefill transfer time", ratio, 0.10,
                   f"{exposed_layerwise * 1000:.0f} ms vs {exposed_after * 1000:.0f} ms; {args.prompt_tokens}-token "
                   f"prompt, {rate_mbit} Mbit/s link", higher_is_better=False)


if __name__ == "__main__":
    sys.exit(main())
