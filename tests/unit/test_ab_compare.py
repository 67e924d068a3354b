"""benchmarks/ab_compare.py's comparison of the two sides' rounds: a metric only one side measured (a newer
cpu_attention.py times a shape the base's copy does not) is listed apart, not compared; it once ended a
ten-minute run in a ValueError before anything was written."""
from __future__ import annotations

from benchmarks.ab_compare import compare


def run(side: str, metrics: dict) -> dict:
    return {"round": 0, "command": "attention", "side": side, "metrics": metrics}


def test_a_metric_measured_by_one_side_is_listed_apart_and_the_shared_ones_compared():
    runs = [run("base", {"attention float32 16x512 ms/call": 0.80, "throughput tok/s": 330.0}),
            run("new", {"attention float32 16x512 ms/call": 0.64, "attention float32 1x2000 ms/call": 0.20,
                        "throughput tok/s": 350.0}),
            run("base", {"attention float32 16x512 ms/call": 0.78, "throughput tok/s": 336.0}),
            run("new", {"attention float32 16x512 ms/call": 0.65, "attention float32 1x2000 ms/call": 0.15,
                        "throughput tok/s": 347.0})]
    rows, one_sided = compare(runs)
    assert [(r["metric"], r["base"], r["new"]) for r in rows] == [
        ("attention float32 16x512 ms/call", 0.78, 0.64), ("throughput tok/s", 336.0, 350.0)]
    assert rows[0]["new_over_base"] == 0.78 / 0.64 and rows[1]["new_over_base"] == 350.0 / 336.0
    assert one_sided == [{"metric": "attention float32 1x2000 ms/call", "side": "new", "best": 0.15,
                          "rounds": [0.20, 0.15]}]
