"""`kvpilot bench sweep`: grid parsing, the study-conclusion checks on hand-made results,
the report folder, and one small real sweep against `kvpilot serve`."""

import json

import pytest

from kvpilot.bench import sweep, sweep_report
from kvpilot.loadgen.datasets import SampleRequest


def test_budget_list_and_power_of_two_range():
    assert sweep.parse_int_list("256,64,128,64") == [64, 128, 256]
    assert sweep.parse_int_list("64-8192") == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert sweep.parse_int_list("64-300,1000") == [64, 128, 256, 1000]
    for bad in ["", "0", "x", "100-200", "512-64"]:
        with pytest.raises(ValueError):
            sweep.parse_int_list(bad)


def test_chunked_settings_and_grid_order():
    assert sweep.parse_chunked("on,off") == [True, False]
    assert sweep.parse_chunked("OFF") == [False]
    with pytest.raises(ValueError, match="on/off"):
        sweep.parse_chunked("maybe")
    assert sweep.grid([256, 64], [True, False]) == [(64, True), (256, True), (64, False), (256, False)]


def test_fit_requests_caps_outputs_and_drops_what_cannot_fit():
    reqs = [SampleRequest("a", 200, 100), SampleRequest("b", 250, 10), SampleRequest("c", 100, 500)]
    fitted = sweep.fit_requests(reqs, 256, 16, 2)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in fitted] == [("a", 200, 16), ("c", 100, 16)]
    with pytest.raises(ValueError, match="only 0 ShareGPT requests fit max_model_len 256"):
        sweep.fit_requests(reqs, 256, None, 2)


def test_bad_grid_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--max-num-batched-tokens", "abc"])
    assert exc.value.code == 2 and "invalid literal" in capsys.readouterr().err


def run(budget, chunked, duration, ttft, itl, tput, tpot=20.0):
    return {"max_num_batched_tokens": budget, "enable_chunked_prefill": chunked, "status": "ok", "message": "",
            "completed": 8, "failed": 0, "duration": duration, "output_throughput": tput, "mean_ttft_ms": ttft,
            "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot, "mean_itl_ms": itl,
            "p99_itl_ms": 3 * itl, "error_counts": {}}


def refused(budget):
    return {"max_num_batched_tokens": budget, "enable_chunked_prefill": False, "status": "refused",
            "exit_code": 2, "message": f"max_num_batched_tokens ({budget}) is smaller than max_model_len (512)"}


# The study's shape: on, small budgets slow and good ITL; flat above 2048; off better TTFT, worse ITL.
AGREEING = [
    run(64, True, 60.0, 5000, 20, 10), run(128, True, 40.0, 4000, 22, 15), run(256, True, 30.0, 3000, 25, 20),
    run(2048, True, 25.0, 2000, 30, 24), run(4096, True, 25.5, 2050, 30.5, 23.8),
    refused(64), refused(128), refused(256),
    run(2048, False, 26.0, 1500, 40, 23), run(4096, False, 26.2, 1520, 41, 22.9),
]


def test_every_conclusion_agrees_on_study_shaped_results():
    verdicts = sweep_report.study_verdicts(AGREEING)
    assert [v.agrees for v in verdicts] == [True, True, True, True]
    off_on = verdicts[0].evidence
    assert "TTFT lower with off at 2/2" in off_on and "2048: TTFT off 1500 vs on 2000 ms" in off_on
    assert "budget 64 vs 4096" in verdicts[1].evidence and "64: 60.0 s" in verdicts[2].evidence


def test_conclusions_disagree_on_contrary_results():
    contrary = [
        run(64, True, 20.0, 1000, 40, 30), run(128, True, 30.0, 2000, 30, 20), run(256, True, 40.0, 3000, 20, 15),
        run(2048, True, 50.0, 4000, 10, 10), run(4096, True, 80.0, 6000, 9, 6),
        run(2048, False, 50.0, 5000, 5, 10), run(4096, False, 80.0, 7000, 4, 6),
    ]
    verdicts = sweep_report.study_verdicts(contrary)
    assert [v.agrees for v in verdicts] == [False, False, False, False]
    assert "duration 46%" in verdicts[3].evidence  # (80 - 50) / 65


def test_conclusions_not_tested_without_the_runs_they_need():
    verdicts = sweep_report.study_verdicts([run(512, True, 10.0, 100, 10, 10), refused(64)])
    assert [v.agrees for v in verdicts] == [None, None, None, None]
    assert [v.label for v in verdicts] == ["not tested"] * 4


def test_report_folder_has_runs_plots_and_summary(tmp_path):
    failing = {**run(8192, True, 30.0, 2000, 30, 24), "failed": 2, "error_counts": {"http_400": 2}}
    records = [*AGREEING, failing]
    summary = sweep_report.write_report(records, tmp_path / "rep", {"num_prompts": 8})
    names = {p.name for p in (tmp_path / "rep").iterdir()}
    assert {"summary.md", "runs", *sweep_report.PLOTS} <= names
    for png in sweep_report.PLOTS:
        assert (tmp_path / "rep" / png).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "rep" / "runs" / "64-chunked-off.json").read_text())["status"] == "refused"
    text = summary.read_text()
    assert "Setup: num_prompts=8" in text
    assert "**Chunked prefill off gives better TTFT and worse ITL than on**: agrees." in text
    assert "is smaller than max_model_len (512)" in text
    assert "| 64 | off | refused |" in text and "| 8192 | on | ok | 8 | 2 | 30.0 |" in text
    assert "2 failed {'http_400': 2}" in text


def test_small_real_sweep_records_the_refused_configuration(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = sweep.main(["--max-num-batched-tokens", "128,256", "--max-model-len", "256", "--num-prompts", "4",
                       "--max-output-len", "16", "--max-num-seqs", "8", "--output-dir", str(out), "--disable-tqdm",
                       "--num-gpu-blocks-override", "64", "--dtype", "bfloat16"])
    assert code == 0
    records = {(r["max_num_batched_tokens"], r["enable_chunked_prefill"]): r
               for r in (json.loads(p.read_text()) for p in (out / "runs").glob("*.json"))}
    assert set(records) == {(128, True), (256, True), (128, False), (256, False)}
    bad = records[(128, False)]
    assert bad["status"] == "refused" and bad["exit_code"] == 2
    assert "smaller than max_model_len (256) with chunked prefill off" in bad["message"]
    for key in [(128, True), (256, True), (256, False)]:
        r = records[key]
        assert (r["status"], r["completed"], r["failed"]) == ("ok", 4, 0), r
        assert 0 < r["total_output_tokens"] <= 4 * 16 and r["mean_ttft_ms"] > 0 and r["duration"] > 0
    summary = (out / "summary.md").read_text()
    assert "| 128 | off | refused |" in summary and "smaller than max_model_len (256)" in summary
    # one budget runs with both settings, so the off-vs-on conclusion is judged on measurements
    assert "Chunked prefill off gives better TTFT and worse ITL than on**: not tested" not in summary
    assert all((out / png).is_file() for png in sweep_report.PLOTS)
    assert "report written to" in capsys.readouterr().out
