"""Figure-5-style plots of a plan (needs matplotlib, imported only here)."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from services.planner.model import PrfaasModel
from services.planner.report import PlanResult
from services.planner.search import bounds_by_threshold, lambda_by_split

MATPLOTLIB_HINT = "matplotlib is required for --plot (pip install matplotlib)"


class MatplotlibMissing(RuntimeError):
    pass


def import_pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError:
        raise MatplotlibMissing(MATPLOTLIB_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plan_plots(result: PlanResult, directory: Path) -> list[str]:
    """Lambda_max vs N_p at the best t, and the prefill bounds vs t at the best split; returns the paths."""
    plt = import_pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    model = PrfaasModel(result.inputs, exact=result.exact)
    plan = result.prfaas
    paths = [directory / "lambda_vs_split.png", directory / "bounds_vs_threshold.png"]

    splits = lambda_by_split(model, plan.threshold_tokens)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([n for n, _ in splits], [v for _, v in splits], marker="o")
    ax.axvline(plan.num_prefill, linestyle=":", color="gray")
    ax.set_xlabel("local prefill instances N_p (N_d = count - N_p)")
    ax.set_ylabel("Lambda_max (req/s)")
    ax.set_title(f"Lambda_max vs split at t = {plan.threshold_tokens:,.0f} tokens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    rows = bounds_by_threshold(model, plan.num_prefill)
    ts = [t / 1000 for t, _ in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ts, [b.prfaas_limit for _, b in rows], label="Theta_prfaas / p")
    ax.plot(ts, [b.local_prefill_limit for _, b in rows], label="Theta_pd_p / (1 - p)")
    ax.plot(ts, [b.theta_pd_d for _, b in rows], label="Theta_pd_d", linestyle="--")
    ax.axvline(plan.threshold_tokens / 1000, linestyle=":", color="gray")
    ax.set_ylim(0, 3 * plan.lambda_max)
    ax.set_xscale("log")
    ax.set_xlabel("threshold t (K tokens)")
    ax.set_ylabel("sustainable arrival rate (req/s)")
    ax.set_title(f"Bounds vs threshold at N_p = {plan.num_prefill}, N_d = {plan.num_decode}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return [str(p) for p in paths]
