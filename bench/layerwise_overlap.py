"""Layer-wise KV streaming vs sending after prefill: how much transfer time stays exposed.

A real vLLM engine (the embedded SmolLM2, in this process) prefills a long prompt with the PrfaaS
connector and streams its KV to a receiver in a network namespace behind a capped link, sized so
that moving the whole KV takes a large fraction of the prefill time. Exposed transfer time = KV
fully received minus prefill end. Run twice: layer-wise streaming (the default) and holding every
frame until the prefill ends. Needs root (namespace, tc).

    python bench/layerwise_overlap.py [--prompt-tokens 4000] [--rate-mbit 200]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import _common  # noqa: F401  (puts the project on sys.path)
from _common import start_receiver, verdict, wait_transfer
from _netns import NS_ADDR, wan_link

SECRET = "bench-secret"
PORT = 47112
BUDGET = 512

def run_mode(layerwise: bool, prompt: list[int], receiver, model: str) -> tuple[float, float]:
    """(prefill seconds, exposed transfer seconds) for one engine in one mode."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from services.kv_connector.params import produce
    from services.kv_connector.settings import ConnectorSettings

    settings = ConnectorSettings(layerwise=layerwise, transport={"secret": SECRET})
    llm = LLM(model=model, max_model_len=len(prompt) + 16, dtype="bfloat16", enforce_eager=True,
              max_num_batched_tokens=BUDGET, enable_prefix_caching=False,
              kv_transfer_config=KVTransferConfig(kv_connector="PrfaasConnector",
                                                  kv_connector_module_path="services.kv_connector.connector",
                                                  kv_role="kv_both",
                                                  kv_connector_extra_config=settings.to_extra_config()))
    try:
        peer = f"{NS_ADDR}:{PORT}"
        warm = produce(f"warm-{layerwise}", peer)
        llm.generate([TokensPrompt(prompt_token_ids=prompt[:BUDGET])],
                     SamplingParams(max_tokens=1, extra_args=warm.to_extra_args()), use_tqdm=False)
        wait_transfer(receiver, warm.transfer_id)
        params = produce(f"run-{layerwise}", peer)
        start = time.time()
        llm.generate([TokensPrompt(prompt_token_ids=list(prompt))],
                     SamplingParams(max_tokens=1, extra_args=params.to_extra_args()), use_tqdm=False)
        prefill_end = time.time()
        done_at = wait_transfer(receiver, params.transfer_id)
        return prefill_end - start, done_at - prefill_end
    finally:
        del llm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="prompt length (default 4000)")
    parser.add_argument("--rate-mbit", type=int, default=200, help="link cap in Mbit/s (default 200)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from services.models import smollm2

    model = str(smollm2.prepare())
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    with wan_link(args.rate_mbit, 0) as ns:
        receiver, _ = start_receiver(SECRET, NS_ADDR, PORT, netns=ns)
        try:
            after_prefill, exposed_after = run_mode(False, prompt, receiver, model)
            print(f"send after prefill: prefill {after_prefill:.2f} s, exposed transfer {exposed_after:.3f} s",
                  file=sys.stderr)
            layerwise, exposed_layerwise = run_mode(True, prompt, receiver, model)
            print(f"layer-wise:         prefill {layerwise:.2f} s, exposed transfer {exposed_layerwise:.3f} s",
                  file=sys.stderr)
        finally:
            receiver.kill()
    ratio = exposed_layerwise / exposed_after
    return verdict("layer-wise exposed transfer time / send-after-prefill transfer time", ratio, 0.10,
                   f"{exposed_layerwise * 1000:.0f} ms vs {exposed_after * 1000:.0f} ms; {args.prompt_tokens}-token "
                   f"prompt, {args.rate_mbit} Mbit/s link", higher_is_better=False)


if __name__ == "__main__":
    sys.exit(main())
