"""The rows of ``tiersync bench serve`` built from engine answers (no engine started here):
the prefill->decode row and its monolithic baseline both time one POST to the prefill engine,
and both say what the prefill engine itself took."""

from tiersync.bench.serve import SMALL, _Case, _Row


def _case() -> _Case:
    return _Case(model="m", shape=SMALL, prompt_len=100, chunk=0, timed=3)


def _mono(engine_s: float, client_s: float) -> dict:
    return {"step": "ttft", "seconds": engine_s, "ttft_seconds": client_s, "tokens": [7], "cached_tokens": 0}


def _routed(engine_s: float, router_s: float, decode_s: float) -> dict:
    prefill = {"seconds": engine_s, "tokens": [7]}
    return {
        "step": "ttft",
        "seconds": router_s + decode_s,
        "ttft_seconds": router_s,
        "prefill": prefill,
        "decode_seconds": decode_s,
        "decode_tokens": 1,
        "tokens": [7, 8],
        "cached_tokens": 100,
    }


def test_pd_rows_compare_the_posts_to_the_prefill_engine_and_give_its_own_time() -> None:
    gen_mono = {"step": "gen", "seconds": 2.5, "tokens": [7, 8, 9], "cached_tokens": 0}
    mono = _Row("monolithic", [_mono(2.0, 2.01), _mono(2.2, 2.21), _mono(1.9, 1.91), gen_mono], None)
    gen_pd = {**_routed(2.0, 2.01, 0.2), "step": "gen", "decode_tokens": 2, "tokens": [7, 8, 9]}
    pd = _Row("pd", [_routed(2.1, 2.12, 0.1), _routed(1.8, 1.83, 0.4), _routed(2.0, 2.02, 0.1), gen_pd], mono)

    ref, row = mono.as_dict(_case()), pd.as_dict(_case())
    assert ref["ttft_s"] == 2.01 and ref["engine_ttft_s"] == 2.0
    assert ref["ttft_samples_s"] == [2.01, 2.21, 1.91] and "decode_samples_s" not in ref
    assert row["ttft_s"] == 2.02 and row["baseline_ttft_s"] == 2.01
    assert row["ttft_ratio"] == round(2.02 / 2.01, 4)
    assert row["engine_ttft_s"] == 2.0 and row["engine_samples_s"] == [2.1, 1.8, 2.0]
    assert row["decode_samples_s"] == [0.1, 0.4, 0.1]
    assert row["tokens_match"] is True


def test_a_row_timed_inside_the_engine_reports_that_time_alone() -> None:
    steps = [{"step": "ttft", "seconds": s, "tokens": [1], "cached_tokens": 0} for s in (0.3, 0.1, 0.2)]
    row = _Row("recompute", [*steps, {"step": "gen", "seconds": 0.5, "tokens": [1, 2], "cached_tokens": 0}], None)
    out = row.as_dict(_case())
    assert out["ttft_s"] == 0.2 and "engine_ttft_s" not in out and "ttft_samples_s" not in out
