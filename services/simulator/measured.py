"""The simulator's arrival process for a measured rate and inter-arrival CV.

``make_arrivals`` offers Poisson (CV 1) and two 2-state Markov-modulated Poisson processes whose
burstiness grows with the mean state length T: ``mmpp`` (1.6x / 0.4x the rate; CV from 1 to
sqrt(2.125) ~ 1.46 as T grows) and ``onoff`` (2x / silent; CV^2 = 1 + rate * T, unbounded). A
measured CV not significantly above 1 maps to Poisson (a CV below 1, more regular than Poisson,
too: the nearest process on offer), a moderate one to ``mmpp`` and a larger one to ``onoff``, with
T chosen so that the process's CV equals the measured one. The CV of an MMPP's gaps is computed
exactly: the gap after an arrival is phase-type with initial vector pi*Lambda/rate and generator
Q - Lambda.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

STATE_RATES = {"mmpp": (1.6, 0.4), "onoff": (2.0, 0.0)}
MIN_BURSTY_CV_EXCESS = 0.1
MMPP_SHARE_OF_MAX = 0.95  # past this share of mmpp's largest CV^2, onoff fits better


@dataclass(frozen=True, slots=True)
class ArrivalFit:
    kind: str
    burst_seconds: float | None
    model_cv: float


def arrival_process_for(rate: float, cv: float, num_gaps: int) -> ArrivalFit:
    """The process (and mean state length) whose inter-arrival CV matches ``cv`` at ``rate``."""
    if cv <= 1.0 + max(MIN_BURSTY_CV_EXCESS, 2.0 / math.sqrt(max(num_gaps, 1))):
        return ArrivalFit("poisson", None, 1.0)
    kind = "mmpp" if cv * cv < MMPP_SHARE_OF_MAX * mmpp_max_cv2("mmpp") else "onoff"
    burst = _solve_burst(kind, rate, cv * cv)
    return ArrivalFit(kind, burst, math.sqrt(modulated_cv2(kind, rate, burst)))


def modulated_cv2(kind: str, rate: float, burst_seconds: float) -> float:
    """Squared CV of the gaps of ``make_arrivals(kind, rate, burst_seconds=...)``."""
    high, low = (rate * share for share in STATE_RATES[kind])
    switch = 1.0 / burst_seconds
    mean_rate = (high + low) / 2  # equal mean state lengths: half the time in each state
    phi = (high / 2 / mean_rate, low / 2 / mean_rate)
    # -(Q - Lambda) with equal switching rates, and its inverse M
    a, b, c, d = switch + high, -switch, -switch, switch + low
    det = a * d - b * c
    m = ((d / det, -b / det), (-c / det, a / det))
    m_one = (m[0][0] + m[0][1], m[1][0] + m[1][1])
    first = phi[0] * m_one[0] + phi[1] * m_one[1]
    m2_one = (m[0][0] * m_one[0] + m[0][1] * m_one[1], m[1][0] * m_one[0] + m[1][1] * m_one[1])
    second = 2 * (phi[0] * m2_one[0] + phi[1] * m2_one[1])
    return second / (first * first) - 1.0


def mmpp_max_cv2(kind: str) -> float:
    """The CV^2 a process approaches as its states grow long: a mixture of the states' exponentials."""
    high, low = STATE_RATES[kind]
    if low == 0:
        return math.inf
    share_high, share_low = high / (high + low), low / (high + low)
    mean = share_high / high + share_low / low
    return 2 * (share_high / high ** 2 + share_low / low ** 2) / mean ** 2 - 1.0


def _solve_burst(kind: str, rate: float, cv2: float) -> float:
    lo, hi = math.log(1e-6 / rate), math.log(1e9 / rate)
    for _ in range(200):
        mid = (lo + hi) / 2
        if modulated_cv2(kind, rate, math.exp(mid)) < cv2:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def fill_arrivals(args, measured: dict) -> None:
    """``prfaas simulate``: fill ``--arrivals`` and ``--burst-seconds`` left unset, with the process
    fitted to a measured workload (recorded in it), else Poisson and 30 s."""
    workload = measured.get("measured_workload")
    if workload is not None:
        fit = arrival_process_for(workload["rate"], workload["interarrival_cv"], workload["num_requests"] - 1)
        used = args.arrivals is None and args.burst_seconds is None
        workload["fitted_arrivals"] = {"kind": fit.kind, "burst_seconds": fit.burst_seconds,
                                       "model_cv": fit.model_cv, "used": used}
        if used:
            args.arrivals, args.burst_seconds = fit.kind, fit.burst_seconds
    args.arrivals = args.arrivals or "poisson"
    args.burst_seconds = args.burst_seconds or 30.0


def offered_rate(args, measured: dict, lambda_max: float) -> float:
    """``--rate``; else a measured workload's rate unless ``--load-factor`` is given; else that factor
    (0.9 by default) of the planner's Lambda_max."""
    if args.rate is not None:
        return args.rate
    if args.load_factor is None and "measured_workload" in measured:
        return measured["measured_workload"]["rate"]
    return (args.load_factor or 0.9) * lambda_max


def measured_lines(out: dict) -> list[str]:
    """Console lines on the measured profiles and workload a run used."""
    from services.planner.cli import measured_text

    lines = measured_text(out)
    fit = out.get("measured_workload", {}).get("fitted_arrivals")
    if fit:
        burst = f", mean state {fit['burst_seconds']:.2f} s" if fit["burst_seconds"] else ""
        verdict = "used" if fit["used"] else "not used: --arrivals/--burst-seconds given"
        lines.append(f"fitted arrivals: {fit['kind']}{burst} (CV {fit['model_cv']:.2f}; {verdict})")
    return lines
