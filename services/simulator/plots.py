"""Queue lengths over time, one panel per simulated policy (needs matplotlib, imported only here)."""
from __future__ import annotations

from pathlib import Path

from services.planner.plots import import_pyplot
from services.simulator.results import QUEUES, SimResult

LABELS = {"prfaas_prefill": "PrfaaS prefill queue", "local_prefill": "local prefill queue",
          "link": "KV transfers (link)", "decode": "waiting for a decode slot"}


def write_queue_plot(results: list[SimResult], directory: Path,
                     bandwidth_trace: tuple[tuple[float, float], ...] = ()) -> str:
    plt = import_pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "queues.png"
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * len(results)), sharex=True, squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        times = [s[0] for s in result.samples]
        for column, name in enumerate(QUEUES, start=1):
            values = [s[column] for s in result.samples]
            if any(values):
                ax.plot(times, values, label=LABELS[name], linewidth=1)
        for at, _gbps in bandwidth_trace:
            ax.axvline(at, color="gray", linestyle=":", linewidth=0.8)
        ax.set_ylabel("requests queued")
        ax.set_title(f"{result.policy}: {result.offered_rate:.2f} req/s offered", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[-1, 0].set_xlabel("simulated time (s)" + ("; dotted: bandwidth steps" if bandwidth_trace else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
