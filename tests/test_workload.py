from __future__ import annotations

import json
import statistics

import pytest

from tuner.errors import TunerError
from tuner.measure.workload import WorkloadSpec, arrival_times, build_workload, parse_range, read_trace, with_arrivals


@pytest.fixture(scope="module")
def tok():
    """The real SmolLM2 tokenizer (from the cached safetensors conversion of the bundled GGUF)."""
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    return load_tokenizer(checkpoint_dir("smollm2-135m"))


def test_seeded_and_lengths_in_range(tok):
    spec = WorkloadSpec(requests=50, rate=2.0, input_len=(20, 40), output_len=(5, 9), seed=3)
    from tuner.corpus import paragraphs

    a, b = build_workload(spec, tok), build_workload(spec, tok)
    assert a == b
    assert build_workload(WorkloadSpec(requests=50, seed=4), tok) != a
    corpus = "\n\n".join(paragraphs())
    for r in a:
        assert 20 <= len(r.prompt_ids) <= 40
        assert 5 <= r.max_tokens <= 9
        assert r.prompt in corpus  # a window of the real text, not random ids
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)


def test_shared_prefix(tok):
    reqs = build_workload(WorkloadSpec(requests=10, shared_prefix=16, input_len=(30, 30)), tok)
    prefixes = {r.prompt_ids[:16] for r in reqs}
    assert len(prefixes) == 1
    assert len({r.prompt_ids for r in reqs}) == 10


def test_poisson_rate_and_constant():
    t = arrival_times(4000, 5.0, "poisson", 0)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.1)  # exponential: sd == mean
    c = arrival_times(5, 4.0, "constant", 0)
    assert c == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])


def test_arrivals_are_seeded_and_common_across_rates():
    """One seed, one arrival pattern: the same again, another seed another, and at 4x the rate the same pattern
    4x compressed (common random numbers across a rate sweep)."""
    a = arrival_times(50, 2.0, "poisson", 7)
    assert a == arrival_times(50, 2.0, "poisson", 7)
    assert a != arrival_times(50, 2.0, "poisson", 8)
    assert arrival_times(50, 8.0, "poisson", 7) == pytest.approx([x / 4 for x in a])


def test_prompts_do_not_depend_on_the_arrivals(tok):
    """Arrivals have their own random stream: every rate, arrival kind and the closed loop serve the same prompts
    with the same output lengths."""
    import dataclasses

    base = WorkloadSpec(requests=20, rate=2.0, input_len=(10, 30), output_len=(3, 9), seed=5)
    variants = [dataclasses.replace(base, rate=9.0), dataclasses.replace(base, arrival="constant"),
                dataclasses.replace(base, rate=None, concurrency=4)]
    first = [(r.prompt_ids, r.max_tokens) for r in build_workload(base, tok)]
    for v in variants:
        assert [(r.prompt_ids, r.max_tokens) for r in build_workload(v, tok)] == first, v


def test_with_arrivals_retimes_a_slice(tok):
    reqs = build_workload(WorkloadSpec(requests=10, rate=None, concurrency=2, input_len=(8, 12),
                                       output_len=(2, 3)), tok)
    part = reqs[4:8]
    timed = with_arrivals(part, 3.0, "poisson", 1)
    assert [r.index for r in timed] == [0, 1, 2, 3]  # any slice of a workload is a workload
    assert [(r.prompt_ids, r.max_tokens) for r in timed] == [(r.prompt_ids, r.max_tokens) for r in part]
    assert [r.arrival_s for r in timed] == arrival_times(4, 3.0, "poisson", 1)
    assert [r.arrival_s for r in timed] != [r.arrival_s for r in with_arrivals(part, 3.0, "poisson", 2)]
    assert all(r.arrival_s is None for r in with_arrivals(timed, None, "poisson", 1))  # closed loop
    assert [r.index for r in part] == [4, 5, 6, 7]  # the input is left as it was


def test_closed_loop_has_no_arrivals(tok):
    reqs = build_workload(WorkloadSpec(requests=3, rate=None, concurrency=2), tok)
    assert all(r.arrival_s is None for r in reqs)


def test_trace_replay(tmp_path, tok):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "The second request arrives later.", "max_tokens": 3, "arrival_s": 1.5},
        {"prompt": "Hello there.", "max_tokens": 2, "arrival_s": 0.0},
    ]) + "\n")
    reqs = build_workload(WorkloadSpec(trace=str(p)), tok)
    assert [r.arrival_s for r in reqs] == [0.0, 1.5]
    assert [r.max_tokens for r in reqs] == [2, 3]
    assert reqs[0].prompt == "Hello there." and tok.decode(reqs[0].prompt_ids) == "Hello there."


@pytest.mark.parametrize("content,needle", [
    ("not json\n", "line 1 is invalid"),
    ('{"prompt": "x", "max_tokens": 0, "arrival_s": 0}\n', "line 1 is invalid"),
    ('{"prompt": "x", "arrival_s": 0}\n', "line 1 is invalid"),
    ("", "has no requests"),
])
def test_bad_trace(tmp_path, content, needle):
    p = tmp_path / "t.jsonl"
    p.write_text(content)
    with pytest.raises(TunerError, match=needle):
        read_trace(str(p))


def test_unreadable_trace(tmp_path):
    with pytest.raises(TunerError, match="unreadable"):
        read_trace(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("text", ["0:5", "9:3", "a:b", "1:2:3", "-1"])
def test_bad_range(text):
    with pytest.raises(TunerError, match="--input-len"):
        parse_range(text, "--input-len")


def test_range_single_number():
    assert parse_range("128", "--x") == (128, 128)


@pytest.mark.parametrize("kwargs", [{"requests": 0}, {"rate": 0.0}, {"concurrency": 0}, {"arrival": "burst"},
                                    {"shared_prefix": -1}])
def test_bad_spec(kwargs):
    with pytest.raises(TunerError):
        WorkloadSpec(**kwargs)
