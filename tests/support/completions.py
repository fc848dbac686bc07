"""Greedy completions through a deployment's router, and random-token prompts (for random-weight models)."""
from __future__ import annotations

import asyncio
import random

import openai


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(length)]


def greedy_completions(deployment, model: str, prompts: list[list[int]], max_tokens: int) -> list:
    """The router's replies (official client, all in flight at once), ``max_tokens`` each."""
    async def run():
        async with openai.AsyncOpenAI(base_url=deployment.base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(client.completions.create(
                model=model, prompt=p, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts))

    return asyncio.run(run())
