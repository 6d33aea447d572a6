"""Metric arithmetic on synthetic request timings, against values computed by hand
(vLLM benchmark_serving definitions)."""

import math

import pytest

from kvpilot.loadgen.metrics import (
    RequestResult,
    calculate_metrics,
    parse_goodput,
    percentile_key,
    result_dict,
    summarize,
)


def ok(prompt_len, output_tokens, ttft, itl, latency, start, text=""):
    return RequestResult(success=True, prompt_len=prompt_len, output_tokens=output_tokens, generated_text=text,
                         ttft=ttft, itl=list(itl), latency=latency, start_time=start)


def failed(prompt_len):
    return RequestResult(success=False, prompt_len=prompt_len, error="HTTP 503", error_kind="http_503")


# r1: 3 tokens; r2: 5 tokens, overlapping r1; a failed request; r4: completed with 0 tokens.
RUN = [
    ok(10, 3, 0.1, [0.02, 0.04], 0.16, 0.0),
    ok(20, 5, 0.3, [0.05] * 4, 0.5, 0.1),
    failed(30),
    ok(5, 0, 0.2, [], 0.2, 1.0, text=""),
]


def words(text):
    return len(text.split())


def test_counts_and_throughputs_exclude_failed_requests():
    m, lens = calculate_metrics(RUN, 2.0, count_tokens=words)
    assert (m.completed, m.failed) == (3, 1)
    assert lens == [3, 5, 0, 0]
    assert m.total_input == 35  # the failed request's 30 prompt tokens are not counted
    assert m.total_output == 8
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(21.5)


def test_ttft_and_e2el_statistics_in_milliseconds():
    m, _ = calculate_metrics(RUN, 2.0, percentiles=(90, 95, 99), count_tokens=words)
    ttft = m.stats["ttft"]  # [100, 300, 200] ms
    assert ttft.mean == pytest.approx(200.0)
    assert ttft.median == pytest.approx(200.0)
    assert ttft.std == pytest.approx(math.sqrt(20000 / 3))
    assert ttft.percentiles == pytest.approx({90.0: 280.0, 95.0: 290.0, 99.0: 298.0})
    e2el = m.stats["e2el"]  # [160, 500, 200] ms
    assert e2el.mean == pytest.approx(860 / 3)
    assert e2el.median == pytest.approx(200.0)
    assert e2el.percentiles[90.0] == pytest.approx(440.0)


def test_tpot_skips_requests_with_at_most_one_token():
    m, _ = calculate_metrics(RUN, 2.0, count_tokens=words)
    tpot = m.stats["tpot"]  # r1 (160-100)/2 = 30 ms, r2 (500-300)/4 = 50 ms; r4 has 0 tokens
    assert tpot.mean == pytest.approx(40.0)
    assert tpot.median == pytest.approx(40.0)
    assert tpot.percentiles[90.0] == pytest.approx(48.0)


def test_itl_pools_gaps_of_all_requests():
    m, _ = calculate_metrics(RUN, 2.0, count_tokens=words)
    itl = m.stats["itl"]  # [20, 40, 50, 50, 50, 50] ms
    assert itl.mean == pytest.approx(260 / 6)
    assert itl.median == pytest.approx(50.0)
    assert itl.percentiles[90.0] == pytest.approx(50.0)


def test_goodput_counts_requests_meeting_every_slo_inclusive():
    # ttft <= 250 and tpot <= 40: r1 (100, 30) good, r2 (300, 50) bad, r4 (200, tpot 0) good.
    m, _ = calculate_metrics(RUN, 2.0, goodput_slos_ms={"ttft": 250, "tpot": 40}, count_tokens=words)
    assert m.request_goodput == pytest.approx(1.0)
    m, _ = calculate_metrics(RUN, 2.0, goodput_slos_ms={"ttft": 250, "e2el": 180}, count_tokens=words)
    assert m.request_goodput == pytest.approx(0.5)  # r4's 200 ms E2E misses
    m, _ = calculate_metrics(RUN, 2.0, goodput_slos_ms={"ttft": 200}, count_tokens=words)
    assert m.request_goodput == pytest.approx(1.0)  # exactly on the SLO counts as good
    m, _ = calculate_metrics(RUN, 2.0, count_tokens=words)
    assert m.request_goodput == 0.0


def test_peak_tokens_per_second_and_peak_concurrency():
    m, _ = calculate_metrics(RUN, 2.0, count_tokens=words)
    # second 0 holds r1's 3 chunks and r2's 5; r4's single chunk lands at 1.2 s
    assert m.max_output_tokens_per_s == 8.0
    assert m.max_concurrent_requests == 2  # r1 [0, 0.16) overlaps r2 [0.1, 0.6)


def test_back_to_back_requests_do_not_count_as_concurrent():
    run = [ok(1, 2, 0.1, [0.1], 0.2, 0.0), ok(1, 2, 0.1, [0.1], 0.2, 0.2)]
    m, _ = calculate_metrics(run, 1.0)
    assert m.max_concurrent_requests == 1


def test_output_length_falls_back_to_tokenizer_then_chunk_count():
    no_usage = ok(4, None, 0.1, [0.1, 0.1], 0.3, 0.0, text="three word reply")
    m, lens = calculate_metrics([no_usage], 1.0, count_tokens=words)
    assert lens == [3]
    m, lens = calculate_metrics([no_usage], 1.0)
    assert lens == [3]  # three chunks arrived
    assert m.stats["tpot"].mean == pytest.approx(100.0)


def test_all_failed_run_reports_zeros():
    m, lens = calculate_metrics([failed(3), failed(4)], 1.0)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (0, 2, 0, 0)
    assert lens == [0, 0]
    assert m.stats["ttft"].mean == 0.0 and m.stats["itl"].percentiles[99.0] == 0.0
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (0.0, 0)


def test_non_positive_duration_is_rejected():
    with pytest.raises(ValueError, match="duration_s"):
        calculate_metrics(RUN, 0.0)


def test_summarize_uses_linear_interpolation():
    s = summarize([0.001, 0.002, 0.003, 0.004], [25, 50, 99.9])
    assert s.percentiles == pytest.approx({25.0: 1.75, 50.0: 2.5, 99.9: 3.997})


def test_parse_goodput_accepts_vllm_pairs():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:0"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 0.0}


@pytest.mark.parametrize("pair, message", [
    ("ttft=500", "KEY:VALUE"), ("ttft:fast", "KEY:VALUE"), ("itl:50", "one of"), ("ttft:-1", "non-negative"),
])
def test_parse_goodput_rejects_bad_pairs(pair, message):
    with pytest.raises(ValueError, match=message):
        parse_goodput([pair])


def test_result_dict_has_vllm_keys():
    m, lens = calculate_metrics(RUN, 2.0, percentiles=(90, 95, 99, 99.9), goodput_slos_ms={"ttft": 250},
                                count_tokens=words)
    out = result_dict(m, RUN, lens, 2.0, goodput_slos_ms={"ttft": 250})
    vllm_keys = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                 "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                 "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
                 "max_output_tokens_per_s", "max_concurrent_requests"}
    for name in ("ttft", "tpot", "itl", "e2el"):
        vllm_keys |= {f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", f"p99_{name}_ms",
                      f"p90_{name}_ms", f"p95_{name}_ms", f"p99.9_{name}_ms"}
    assert vllm_keys <= out.keys()
    assert out["request_goodput"] == pytest.approx(1.0)
    assert out["p90_ttft_ms"] == pytest.approx(280.0)
    assert out["errors"][2] == "HTTP 503"
    assert result_dict(m, RUN, lens, 2.0)["request_goodput"] is None  # no SLOs given
    assert percentile_key(99.0) == "p99" and percentile_key(99.9) == "p99.9"


def test_token_times_reconstruct_arrivals():
    r = ok(1, 3, 0.5, [0.25, 0.25], 1.0, 10.0)
    assert r.token_times == pytest.approx([10.5, 10.75, 11.0])
    assert failed(1).token_times == []
