"""What slows the PrfaaS prefill worker in the running deployment beyond its profile, for
bench/sim_vs_real.py: the colocated worker's decoding (the simulator's ``colocated_interference``), and a
check of the transfer model the benchmark simulates with (``layerwise: true``): that a prefill queued
behind another costs what one alone does.

On this machine ``prefill-0``'s engine and its KV sender threads share one core, and ``decode-0`` runs
on the other core of the same host. A CPU decode step streams the model's weights from the memory the
prefill beside it shares: in isolation, a float32 prefill-sized matmul loop on one core ran 8.5% slower
while the other core ran decode-sized ones. The light calibration loads see little of it (the colocated
worker is mostly idle), and near the knee the simulator came out too fast with float32 engines without
it (mean TTFT -12% and -29% at 0.7x in two full runs).

Measured here on the running deployment, through the router with the official client, ``pairs`` times:

- alone: a long prompt (offloaded), nothing else running: TTFT A = P + E + S(1), its prefill P, the
  part E of its KV transfer that does not fit under the prefill (the KV leaves layer by layer while
  later layers compute) and a decode step S(1);
- back to back: two long prompts, the second sent ``BEHIND`` seconds after the first, so that it waits
  for the first's prefill: the second's first token comes F = 2 P + D + E + S(1) seconds after the
  first was sent, and ``D = F - 2 A + E + S(1)`` is what the second loses against one alone. The
  layer-wise model says 0: the first's KV has left by the time its prefill ends, and each prefill pays
  its own sender's CPU (inside A, so inside the speed factor the benchmark fits). Per MiB of the
  first's KV it is ``behind_ms_per_mib``, printed and recorded, not charged;
- beside decoding: a long prompt sent while ``BACKGROUND`` short prompts (local) are all decoding on
  ``decode-0``, long enough to outlast it: TTFT B. With W the decode side's extra wait there (half the
  step under way at the background batch, then its own step at one more, against one step alone),
  ``colocated_interference`` is (B - A - W) / P.

Each figure is the median over the pairs; every prompt is new (random token ids), so no prefix is cached.

History: this check once set ``send_cpu_ms_per_mib`` with the whole transfer X in place of E, under a
``layerwise: false`` model: about X per request (7-13 ms per MiB in float32 runs, the link's 8.4), where
``prefill-0``'s telemetry put the sender threads' own CPU at 0.62 ms per MiB. It stood in for the transfer
that model freed the instance of early (docs/capacity-planning.md).
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

PROMPT_TOKENS = 1536        # offloaded (above the threshold), and a point the profile measures
BEHIND = 0.25               # the second prompt of a back-to-back pair, after the first: it waits for its step
BACKGROUND = 4              # short prompts decoding: a batch the loads near the knee reach
BACKGROUND_TOKENS = 64      # local (below the threshold)
# Rounds (alone, back to back, beside). Each figure is a difference of seconds-long TTFTs that drift by a few
# percent from one to the next (the back-to-back one scattered from -9.5 to +8.6 ms per MiB per round over
# two float32 runs): five rounds, a median of five.
PAIRS = 5
OUTLAST = 1.5               # background decodes last this many times the alone TTFT
SEED = 7000
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class SenderCpu:
    """A worker's KV sender as its telemetry counts it (``prfaas_kv_link_send_cpu_seconds``): the CPU its
    I/O threads used, kernel work included, and the bytes they sent, summed over its links."""

    cpu_s: float
    bytes_sent: int

    @classmethod
    def of(cls, stats) -> "SenderCpu":
        """From a worker's ``GetStats`` answer."""
        links = stats.kv_links
        return cls(sum(link.send_cpu_seconds for link in links), sum(link.bytes_sent for link in links))

    def ms_per_mib_since(self, before: "SenderCpu") -> float | None:
        """Its CPU per MiB sent since ``before``; None with nothing sent (or a counter that went back: the
        worker restarted)."""
        sent, cpu = self.bytes_sent - before.bytes_sent, self.cpu_s - before.cpu_s
        return cpu * 1000 / (sent / MIB) if sent > 0 and cpu >= 0 else None


@dataclass(frozen=True, slots=True)
class Interference:
    behind_ms_per_mib: float        # what a prefill queued behind another loses against one alone (the model: 0)
    colocated: float                # colocated_interference
    behind_samples: tuple[float, ...]
    colocated_samples: tuple[float, ...]
    alone_s: tuple[float, ...]      # TTFTs alone
    behind_s: tuple[float, ...]     # the second of a back-to-back pair: its first token after the first was sent
    beside_s: tuple[float, ...]     # TTFTs beside decoding
    kv_mib: float                   # one prompt's KV
    exposed_s: float                # its transfer's part beyond the prefill, in the model
    extra_s: float                  # the decode side's extra wait beside decoding
    note: str = ""

    def describe(self) -> str:
        alone = statistics.median(self.alone_s)
        return (f"{PROMPT_TOKENS}-token prompts ({self.kv_mib:.0f} MiB of KV): TTFT alone {alone:.3f} s, of which "
                f"{self.exposed_s:.3f} s the transfer left after the prefill; the colocated worker's decoding slows "
                f"the prefill by x = {self.colocated:.3f} (per pair "
                f"{', '.join(f'{s:+.3f}' for s in self.colocated_samples)}; TTFT beside {BACKGROUND} decoding requests "
                f"{statistics.median(self.beside_s):.3f} s, of which {self.extra_s * 1000:.0f} ms their decode steps "
                f"add); a prefill queued behind another loses {self.behind_ms_per_mib:+.1f} ms per MiB of the "
                f"first's KV against one alone, as layer-wise streaming says 0 (per pair "
                f"{', '.join(f'{s:+.1f}' for s in self.behind_samples)}; the second's first token "
                f"{statistics.median(self.behind_s):.3f} s after the first was sent; not charged){self.note}")


def fit(alone: list[float], behind: list[float], beside: list[float], exposed_s: float, kv_bytes: float, step_s,
        background: int = BACKGROUND) -> Interference:
    """Both figures from the measured times; ``exposed_s``: the part of a prompt's KV transfer the model
    leaves after its prefill (0 when the link carries it within the prefill); ``step_s(batch)``: the
    profile's decode step."""
    extra = 0.5 * step_s(background) + step_s(background + 1) - step_s(1)
    prefill = [max(a - exposed_s - step_s(1), 1e-9) for a in alone]
    kv_mib = kv_bytes / MIB
    behind_samples = tuple((f - 2 * a + exposed_s + step_s(1)) * 1000 / kv_mib for a, f in zip(alone, behind))
    colocated = tuple((b - a - extra) / p for a, b, p in zip(alone, beside, prefill))
    colocated_value, note = statistics.median(colocated), ""
    if colocated_value < 0:
        colocated_value, note = 0.0, "; x below 0 (noise): 0"
    return Interference(statistics.median(behind_samples), colocated_value, behind_samples, colocated, tuple(alone),
                        tuple(behind), tuple(beside), kv_mib, exposed_s, extra, note)


def measure(base_url: str, decode_tokens: int, pairs: int = PAIRS,
            seed: int = SEED) -> tuple[list[float], list[float], list[float]]:
    """Times alone, back to back and beside ``BACKGROUND`` short prompts decoding ``decode_tokens`` each."""
    import openai

    async def run() -> tuple[list[float], list[float], list[float]]:
        rng = random.Random(seed)

        def prompt(tokens: int) -> list[int]:
            return [rng.randrange(3, 1024) for _ in range(tokens)]

        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=600) as client:
            model = (await client.models.list()).data[0].id

            async def first_token(tokens: int, max_tokens: int, decoding: asyncio.Event | None = None) -> float:
                """When the first token came (monotonic clock)."""
                first = None
                try:
                    stream = await client.completions.create(model=model, prompt=prompt(tokens), max_tokens=max_tokens,
                                                             temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True})
                    async for _ in stream:
                        if first is None:
                            first = time.monotonic()
                            if decoding is not None:
                                decoding.set()
                finally:
                    if decoding is not None:
                        decoding.set()
                return first if first is not None else time.monotonic()

            async def ttft(tokens: int, max_tokens: int = 1) -> float:
                sent = time.monotonic()
                return await first_token(tokens, max_tokens) - sent

            async def behind() -> float:
                sent = time.monotonic()
                first = asyncio.create_task(first_token(PROMPT_TOKENS, 1))
                await asyncio.sleep(BEHIND)
                second = await first_token(PROMPT_TOKENS, 1)
                await first
                return second - sent

            async def beside() -> float:
                started = [asyncio.Event() for _ in range(BACKGROUND)]
                background = [asyncio.create_task(first_token(BACKGROUND_TOKENS, decode_tokens, event))
                              for event in started]
                await asyncio.gather(*(event.wait() for event in started))
                await asyncio.sleep(0)
                for task in background:         # one that failed before its first token set its event too
                    if task.done() and task.exception() is not None:
                        raise task.exception()
                took = await ttft(PROMPT_TOKENS)
                await asyncio.gather(*background)
                return took

            alone, behinds, besides = [], [], []
            for _ in range(pairs):
                alone.append(await ttft(PROMPT_TOKENS))
                behinds.append(await behind())
                besides.append(await beside())
            return alone, behinds, besides

    return asyncio.run(run())
