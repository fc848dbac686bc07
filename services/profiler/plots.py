"""The profile as a picture: prefill latency by prompt length and prefix hit, decode step time by batch."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from services.planner.plots import import_pyplot


def write_profile_plot(document: dict[str, Any], path: Path) -> str:
    plt = import_pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    points = document["prefill"]["points"]
    for ratio in sorted({p["hit_ratio"] for p in points}):
        row = [p for p in points if p["hit_ratio"] == ratio]
        left.plot([p["input_tokens"] for p in row], [p["latency_s"] * 1000 for p in row], marker="o",
                  label=f"{ratio:.0%} prefix hit")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("prefill latency (ms)")
    left.set_title("Prefill")
    left.legend()
    decode = document["decode"]
    measured = [p for p in decode["points"] if "step_time_s" in p]
    for context in sorted({p["context_tokens"] for p in measured}):
        row = sorted((p for p in measured if p["context_tokens"] == context), key=lambda p: p["batch_size"])
        right.plot([p["batch_size"] for p in row], [p["step_time_s"] * 1000 for p in row], marker="o",
                   label=f"context {context:,}")
    right.axhline(decode["tpot_target_s"] * 1000, linestyle="--", color="gray", label="TPOT target")
    right.axvline(decode["max_batch_size"], linestyle=":", color="gray")
    right.set_xlabel("decode batch size")
    right.set_ylabel("step time (ms)")
    right.set_title(f"Decode: batch {decode['max_batch_size']} meets the target" if decode["meets_target"]
                    else "Decode: no batch meets the target")
    right.legend()
    for axis in (left, right):
        axis.grid(alpha=0.3)
    fig.suptitle(f"{document['model']} (vLLM {document['measured']['vllm_version']}, {document['engine']['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
