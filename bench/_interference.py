"""How much slower the PrfaaS prefill worker computes while the colocated worker decodes, for
bench/sim_vs_real.py (the simulator's ``colocated_interference``).

On this machine ``prefill-0`` and ``decode-0`` run on two cores of one host. A CPU decode step streams
the model's weights from memory (about 540 MB a step with float32 SmolLM2), and the prefill beside it
shares that memory system: measured in isolation, a float32 prefill-sized matmul loop on one core ran
8.5% slower while the other core ran decode-sized ones. The light calibration loads cannot see it (the
colocated worker is mostly idle there), and with float32 engines the simulator came out too fast near
the knee (-12% and -29% mean TTFT at 0.7x in two full runs).

Measured here on the running deployment, through the router with the official client: pairs of one long
prompt (offloaded) sent alone, and the same length sent while ``background`` short prompts (local) are
all decoding on ``decode-0``, long enough to outlast the prefill. Each prompt is new (random token ids),
so no prefix is cached. With D the extra decode-side wait of the busy case (half the step under way at
the background batch, then its own step at one more, against one step alone), P the alone prefill (its
TTFT less the KV transfer and its decode step) and B, A the busy and alone TTFTs:

    interference = median over pairs of (B - A - D) / P

which is the factor a share of 1 of decoding colocated workers costs the prefill (``RuntimeModel``).
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

PROMPT_TOKENS = 1536        # offloaded (above the threshold), and a point the profile measures
BACKGROUND = 4              # short prompts decoding during the busy half: a batch the loads near the knee reach
BACKGROUND_TOKENS = 64      # local (below the threshold)
PAIRS = 3
OUTLAST = 1.5               # background decodes last this many times the alone TTFT
SEED = 7000


@dataclass(frozen=True, slots=True)
class Interference:
    value: float                    # the simulator's colocated_interference
    samples: tuple[float, ...]      # per pair
    alone_s: tuple[float, ...]      # TTFTs
    busy_s: tuple[float, ...]
    extra_s: float                  # the decode side's extra wait in the busy case
    note: str = ""

    def describe(self) -> str:
        return (f"{self.value:.3f} (per pair {', '.join(f'{s:+.3f}' for s in self.samples)}; {PROMPT_TOKENS}-token "
                f"prompts, TTFT alone {statistics.median(self.alone_s):.3f} s, with {BACKGROUND} requests decoding "
                f"{statistics.median(self.busy_s):.3f} s, of which {self.extra_s * 1000:.0f} ms their decode "
                f"steps add){self.note}")


def fit(alone: list[float], busy: list[float], transfer_s: float, step_s, background: int = BACKGROUND) -> Interference:
    """The interference from the measured TTFT pairs; ``step_s(batch)``: the profile's decode step."""
    extra = 0.5 * step_s(background) + step_s(background + 1) - step_s(1)
    samples = tuple((b - a - extra) / max(a - transfer_s - step_s(1), 1e-9) for a, b in zip(alone, busy))
    value, note = statistics.median(samples), ""
    if value < 0:
        value, note = 0.0, "; below 0 (noise): 0"
    return Interference(value, samples, tuple(alone), tuple(busy), extra, note)


def measure(base_url: str, decode_tokens: int, pairs: int = PAIRS, seed: int = SEED) -> tuple[list[float], list[float]]:
    """TTFTs of long prompts alone and with ``BACKGROUND`` short ones decoding ``decode_tokens`` each."""
    import openai

    async def run() -> tuple[list[float], list[float]]:
        rng = random.Random(seed)

        def prompt(tokens: int) -> list[int]:
            return [rng.randrange(3, 1024) for _ in range(tokens)]

        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=600) as client:
            model = (await client.models.list()).data[0].id

            async def ttft(tokens: int, max_tokens: int, decoding: asyncio.Event | None = None) -> float:
                started = time.monotonic()
                first = None
                try:
                    stream = await client.completions.create(model=model, prompt=prompt(tokens), max_tokens=max_tokens,
                                                             temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True})
                    async for _ in stream:
                        if first is None:
                            first = time.monotonic() - started
                            if decoding is not None:
                                decoding.set()
                finally:
                    if decoding is not None:
                        decoding.set()
                return first if first is not None else time.monotonic() - started

            alone, busy = [], []
            for _ in range(pairs):
                alone.append(await ttft(PROMPT_TOKENS, 1))
                started = [asyncio.Event() for _ in range(BACKGROUND)]
                background = [asyncio.create_task(ttft(BACKGROUND_TOKENS, decode_tokens, event)) for event in started]
                await asyncio.gather(*(event.wait() for event in started))
                await asyncio.sleep(0)
                for task in background:         # one that failed before its first token set its event too
                    if task.done() and task.exception() is not None:
                        raise task.exception()
                busy.append(await ttft(PROMPT_TOKENS, 1))
                await asyncio.gather(*background)
            return alone, busy

    return asyncio.run(run())
