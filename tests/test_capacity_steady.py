"""A capacity that holds under sustained load: the real capacity search driven by a simulated engine (virtual time,
deterministic), its claims checked against long sustained simulations of the same engine, and the statistics under
each verdict (per-request ITL, a mean broken by a failure, throughput from the first measured send, the canary's
own noise)."""

from __future__ import annotations

import math
import random

import pytest

from tuner.measure.capacity import CapacityOptions, CapacitySearch, engine_drift, judge, unsteady
from tuner.measure.metrics import RequestResult
from tuner.measure.workload import Request, with_arrivals
from tuner.predict.simulate import SimulatedEngine, StepModel
from tuner.slo import SLO, parse_slo
from tuner.stats import bound_verdict, effective_n

# ~llama-server -np 4 serving SmolLM2-135M on 2 cores: ~2.5 req/s at 24:48 output tokens (issue 24's case)
MODEL = StepModel(decode_base_s=0.020, decode_per_seq_s=0.005, prefill_base_s=0.005, prefill_per_token_s=0.0004,
                  noise_sigma=0.15)
CAP = 4


def workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, "x", tuple(range(rng.randint(64, 192))), rng.randint(24, 48), None) for i in range(n)]


def sustained_ttft_p90_ms(rate: float, n: int = 12_000) -> float:
    """TTFT p90 of a long Poisson load at `rate` on the same engine (the first 15% left out): the truth."""
    engine = SimulatedEngine(MODEL, CAP, seed=777)
    load = engine.run(with_arrivals(workload(n, 777), rate, "poisson", 777), timeout_s=1e6)
    vals = sorted(r.ttft_ms if r.ok else math.inf for r in load.results[n * 15 // 100:])
    return vals[math.ceil(0.9 * len(vals)) - 1]


def simulated_search(seed: int, slo: str = "ttft:p90<2s", **kw) -> dict:
    engine = SimulatedEngine(MODEL, CAP, seed=seed)
    opts = CapacityOptions(slo=SLO(tuple(parse_slo(slo))), seed=seed, **{"max_wall_s": 3600.0, **kw})
    return CapacitySearch(engine.run, workload(opts.pool_size(CAP), 1000 + seed), CAP, opts,
                          clock=engine.clock).search()


def test_a_claimed_capacity_holds_under_sustained_load():
    """Issue 24: probes of 30 requests from an idle engine claimed ~94% of the saturation rate, where a sustained
    load misses the SLO. Over several seeds, every capacity the search reports meets TTFT p90 < 2 s under a long
    sustained load at that rate, and the figure is no trivial one (most seeds claim over 55% of saturation)."""
    caps = [simulated_search(seed) for seed in range(6)]
    rates = [c["requests_per_s"] for c in caps]
    assert all(c["verdict"] == "meets" for c in caps)
    for rate in sorted(set(rates)):
        assert sustained_ttft_p90_ms(rate) <= 2000.0, rate
    assert sum(r > 0.55 * c["saturation"]["requests_per_s"] for r, c in zip(rates, caps)) >= 4


@pytest.mark.parametrize("seed", [1, 2])
def test_a_budget_too_short_for_the_next_lower_rate_probes_the_lowest_rate_it_holds(seed: int):
    """Issue 24's done-check ran out of its capacity budget: the first rate missed, the next (half of it) stayed
    undecided, and half of that again would not fit the time left, so the search ended with no rate (these 2 of 4 seeds
    at 7d0b03a). A rate that may lie just below an undecided one is stepped to gently, and when
    the planned rate does not fit what is left, the lowest rate in the bracket that does is probed (said in a
    note): a rate shown to meet, which holds under sustained load."""
    c = simulated_search(seed, slo="ttft:p90<500ms", max_wall_s=250.0)
    assert c["verdict"] == "meets", (c["probes"], c["notes"])
    assert any("would not fit the capacity budget left" in n for n in c["notes"])
    assert sustained_ttft_p90_ms(c["requests_per_s"]) <= 500.0
    assert c["requests_per_s"] > 0.25 * c["saturation"]["requests_per_s"]


def test_rates_too_close_to_saturation_are_not_claimed():
    """A loose SLO that any rate below saturation meets in a short probe: the search still claims no rate whose
    queue a probe cannot reach and span (it names them), and what it claims holds under sustained load."""
    cap = simulated_search(3, slo="ttft:p90<20s")
    sat = cap["saturation"]["requests_per_s"]
    assert cap["verdict"] == "meets" and cap["requests_per_s"] < 0.9 * sat
    assert any("not probed" in n and "relaxation times" in n for n in cap["notes"])
    assert sustained_ttft_p90_ms(cap["requests_per_s"]) <= 20_000.0


def test_a_probe_whose_queue_still_builds_is_unsteady():
    """A rate above the service rate: the queue grows through the probe, TTFT rises half to half; a rate well below
    it is steady."""
    slo = SLO(tuple(parse_slo("ttft:p90<30s")))
    engine = SimulatedEngine(MODEL, CAP, seed=5)
    over = engine.run(with_arrivals(workload(120, 5), 3.5, "poisson", 5), timeout_s=1e6).results
    under = engine.run(with_arrivals(workload(120, 6), 0.8, "poisson", 6), timeout_s=1e6).results
    why = unsteady(over, slo)
    assert why is not None and "ttft p90 rose" in why and "queue was still building" in why
    assert unsteady(under, slo) is None


def test_throughput_at_a_rate_counts_from_the_first_measured_send():
    """The probe's achieved rate is its measured requests over their own span: at a constant 1.2 req/s that is
    ~1.2 (the former figure divided by a span that included the lead-in: 1.55/1.80/1.90 at 1.89/2.21/2.36)."""
    engine = SimulatedEngine(MODEL, CAP, seed=1)
    opts = CapacityOptions(slo=SLO(tuple(parse_slo("ttft:p90<5s"))), arrival="constant", max_wall_s=3600.0)
    s = CapacitySearch(engine.run, workload(opts.pool_size(CAP), 1), CAP, opts, clock=engine.clock)
    s.sat_rps = 2.5
    p = s.probe(1.2, lead=30)
    assert p["ramp"] >= 30 and p["verdict"] == "meets"
    assert p["achieved_rps"] == pytest.approx(1.2, rel=0.06)


def result(i: int, gaps: list[float], ok: bool = True) -> RequestResult:
    r = RequestResult(index=i, prompt_tokens=3, output_tokens=len(gaps) + 1, ttft_ms=50.0,
                      e2e_ms=50.0 + sum(gaps), send_s=float(i))
    r.itl_ms = list(gaps)
    if not ok:
        r.error = "boom"
    return r


def test_itl_is_judged_per_request_not_per_gap():
    """10 requests of 200 gaps, all within: 2,000 pooled gaps would show itl:p90 at any confidence, but 10
    requests cannot (57 needed at the search's per-look confidence); 80 can."""
    slo = SLO(tuple(parse_slo("itl:p90<100ms")))
    conf = CapacityOptions(slo=slo).look_confidence()
    assert judge([result(i, [20.0] * 200) for i in range(10)], slo, conf)["verdict"] == "indeterminate"
    assert judge([result(i, [20.0] * 200) for i in range(80)], slo, conf)["verdict"] == "meets"
    # one request in five with every gap late: 80% of requests' gaps within, not 90%
    mixed = [result(i, [500.0 if i % 5 == 0 else 20.0] * 50) for i in range(200)]
    assert judge(mixed, slo, conf)["verdict"] == "misses"


def test_a_mean_bound_is_decided_by_a_failure_alone():
    """A failed request is infinitely late: the mean is infinite whatever the others did (it stayed 'indeterminate'
    forever before)."""
    values = [10.0] * 50 + [math.inf]
    assert bound_verdict(values, "mean", 100.0) == "misses"
    assert bound_verdict([10.0] * 50, "mean", 100.0) == "meets"


def test_effective_sample_size_of_a_correlated_series():
    rng = random.Random(0)
    iid = [rng.random() for _ in range(2000)]
    assert effective_n(iid) == pytest.approx(2000, rel=0.25)
    x, ar = 0.0, []
    for _ in range(2000):  # AR(1), phi 0.9: n (1 - phi) / (1 + phi) = 105
        x = 0.9 * x + rng.gauss(0, 1)
        ar.append(x)
    assert 50 <= effective_n(ar) <= 220


def canaries(itls: list[float]) -> list[dict]:
    return [{"at": f"step {i}", "itl_ms": v, "n": 45} for i, v in enumerate(itls)]


def test_the_canary_threshold_follows_its_own_noise():
    """Quiet runs moved 6-13% from their median (stop 22's figures): a fixed 10% re-measured most of them. The
    threshold is 3 robust spreads of the measurement's own canaries: those quiet moves stay below it, one canary
    35% slow among steady ones does not."""
    notes: list[str] = []
    quiet = engine_drift(canaries([62.0, 66.5, 58.0, 71.3, 60.0]), notes)
    assert abs(quiet["drift"]) > 0.10 and abs(quiet["drift"]) < quiet["threshold"] and not notes
    moved = engine_drift(canaries([62.0, 63.0, 96.3, 61.5, 62.5]), notes)
    assert abs(moved["drift"]) > moved["threshold"] >= 0.10 and len(notes) == 1



def test_near_saturation_a_probe_is_judged_on_its_effective_sample_size():
    """Raising --probe-requests lets probes reach rates near saturation (the capacity's note advises it), where a
    window's requests share the queue's slow swings; counted as independent, 13 of 60 simulated searches with the cap
    at 2000 claimed above the sustained capacity (up to 8% above). 400 requests, 20 late ones in one burst: as 400
    independent ones they show p90 within the limit; as the one queue swing they are, they do not."""
    slo = SLO(tuple(parse_slo("ttft:p90<2s")))
    ttft = [500.0] * 200 + [5000.0] * 20 + [500.0] * 180
    results = [RequestResult(index=i, send_s=i * 0.5, ttft_ms=v, output_tokens=2, itl_ms=[20.0], e2e_ms=v + 20.0)
               for i, v in enumerate(ttft)]
    assert judge(results, slo, 0.995)["verdict"] == "meets"
    assert judge(results, slo, 0.995, correlated=True)["verdict"] == "indeterminate"
    cap = simulated_search(100, probe_requests=(30, 2000), max_requests=4000)
    near = [p for p in cap["probes"] if p.get("judged_on")]
    assert cap["verdict"] == "meets" and near
    assert all(p["rate_rps"] > 0.8 * cap["saturation"]["requests_per_s"] for p in near)
    short = [p for p in cap["probes"] if not p.get("judged_on")]
    assert all(p["rate_rps"] <= 0.82 * cap["saturation"]["requests_per_s"] for p in short)
