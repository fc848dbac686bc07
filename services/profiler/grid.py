"""The points a profile measures: prefill (prompt length x prefix-hit ratio) and decode (batch size x
context length), sized for ``--quick`` or a full run, and clipped to what the engine can hold."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    input_tokens: int
    hit_ratio: float

    @property
    def name(self) -> str:
        return f"prefill-{self.input_tokens}-hit{round(self.hit_ratio * 100)}"

    def describe(self) -> str:
        return f"prefill {self.input_tokens:,} tokens, {self.hit_ratio:.0%} prefix hit"

    def cached_prefix(self, block_size: int) -> int:
        """Tokens of the prompt prefilled first: whole blocks, as vLLM's prefix cache matches them."""
        return int(self.input_tokens * self.hit_ratio) // block_size * block_size


@dataclass(frozen=True, slots=True)
class DecodePoint:
    batch_size: int
    context_tokens: int

    @property
    def name(self) -> str:
        return f"decode-b{self.batch_size}-ctx{self.context_tokens}"

    def describe(self) -> str:
        return f"decode batch {self.batch_size}, context {self.context_tokens:,} tokens"

    def blocks_needed(self, block_size: int, num_steps: int) -> int:
        return self.batch_size * math.ceil((self.context_tokens + num_steps + 1) / block_size)


@dataclass(frozen=True, slots=True)
class Grid:
    input_tokens: tuple[int, ...]
    hit_ratios: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    context_tokens: tuple[int, ...]
    repeats: int
    decode_steps: int
    search_steps: int

    def prefill_points(self, block_size: int = 1) -> list[PrefillPoint]:
        """Every length at every hit ratio, less the hits too short to cover one whole cached block."""
        points = [PrefillPoint(n, h) for n in self.input_tokens for h in self.hit_ratios]
        return [p for p in points if p.hit_ratio == 0 or p.cached_prefix(block_size) > 0]

    def decode_points(self) -> list[DecodePoint]:
        return [DecodePoint(b, c) for c in self.context_tokens for b in self.batch_sizes]

    @property
    def reference_context(self) -> int:
        """The context at which the TPOT target is checked: the longest measured."""
        return max(self.context_tokens)

    def clipped(self, max_model_len: int) -> Grid:
        """Lengths the engine accepts: prompts leave room for one output token, contexts for the
        decode steps."""
        lengths = sorted({min(n, max_model_len - 1) for n in self.input_tokens})
        contexts = sorted({min(c, max_model_len - self.decode_steps - 2) for c in self.context_tokens})
        return Grid(tuple(lengths), self.hit_ratios, self.batch_sizes, tuple(contexts), self.repeats,
                    self.decode_steps, self.search_steps)


QUICK = Grid(input_tokens=(128, 512, 1024), hit_ratios=(0.0, 0.5), batch_sizes=(1, 4, 16),
             context_tokens=(512,), repeats=2, decode_steps=8, search_steps=3)
FULL = Grid(input_tokens=(128, 256, 512, 1024, 1536, 2048), hit_ratios=(0.0, 0.25, 0.5, 0.75),
            batch_sizes=(1, 2, 4, 8, 16, 32), context_tokens=(256, 1024), repeats=3, decode_steps=12,
            search_steps=4)


def next_search_batch(step_times: dict[int, float], target_s: float, limit: int) -> int | None:
    """The next batch size to measure in the search for the largest batch whose step time meets
    ``target_s``: bisect between the largest passing and the next failing size, or, when every
    measured size passes, double past the largest (up to ``limit``). None when the answer is known."""
    passing = [b for b, t in step_times.items() if t <= target_s]
    best = max(passing, default=0)
    failing = [b for b, t in step_times.items() if t > target_s and b > best]
    if best == 0:
        candidate = 1
    elif failing:
        candidate = (best + min(failing)) // 2
    else:
        candidate = min(2 * best, limit)
    return candidate if candidate not in step_times and candidate <= limit else None


def largest_passing(step_times: dict[int, float], target_s: float) -> int | None:
    return max((b for b, t in step_times.items() if t <= target_s), default=None)
