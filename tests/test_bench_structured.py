"""`python -m ember.bench.structured` and `python -m ember.bench.gc_pause` run end to end on the
default model and report what docs/benchmarks.md reads from them."""

import json
import subprocess
import sys


def _bench(args: list[str], out, **env: str) -> dict:
    result = subprocess.run([sys.executable, "-m", *args, "--out", str(out)], capture_output=True,
                            text=True, timeout=600,
                            env={"EMBER_DISABLE_PROGRESS": "1", "PATH": "/usr/bin:/bin", **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_structured_reports_each_rounds_collector_pauses_and_phases(tmp_path):
    data = _bench(["ember.bench.structured", "--num-prompts", "6", "--max-tokens", "24",
                   "--repeats", "2", "--compact", "--function-times"], tmp_path / "s.json",
                  EMBER_STEP_TIMING="1")
    assert data["outputs_valid_json"] >= 1 and len(data["rounds"]) == 2
    assert data["engine_core"] == "in process"
    for round_ in data["rounds"]:
        for run in ("constrained", "unconstrained"):
            totals = round_["totals_ms"][run]
            assert totals["steps"] > 0 and totals["gc_full"] >= 0 and totals["gc_ms"] >= 0
            # The steps' own phases fit in the round's wall time (the rest is outside them).
            phases = {k: v for k, v in totals.items() if k not in (
                "steps", "gc_full", "gc_ms", "outside the steps")
                and not k.startswith(("helper", "process"))}
            assert phases["schedule"] > 0 and phases["update"] > 0
            assert sum(phases.values()) <= 1000 * round_[f"{run}_s"] + 0.1 * len(phases)
            assert totals["outside the steps"] >= -0.1 * len(phases)
    assert "totals_ms" not in data["step_ms"]["constrained"]
    # Host time per call of the engine thread's functions, each kind of round apart: each
    # timed round steps once or more, and only the constrained ones fill bitmasks.
    times = data["function_times"]
    for run in ("constrained", "unconstrained"):
        step = times[run]["ember.core.engine_core:EngineCore.step"]
        assert step["calls"] >= 2 and step["us_per_call"] > 0
        assert step["total_ms"] <= 1000 * sum(r[f"{run}_s"] for r in data["rounds"])
    assert times["constrained"]["ember.structured_output.bitmask_fill:BitmaskFilling."
                                "sampling_rows"]["calls"] > 0
    assert "ember.structured_output.bitmask_fill:BitmaskFilling.fill_async" not in times[
        "unconstrained"]


def test_gc_pause_compares_frozen_and_not_in_both_processes(tmp_path):
    data = _bench(["ember.bench.gc_pause", "--runs", "1"], tmp_path / "g.json")
    for where in ("application process", "engine core process"):
        frozen, thawed = data[where]["frozen"], data[where]["not frozen"]
        assert frozen["frozen"] > 100_000 and thawed["frozen"] == 0
        assert frozen["walked"] < thawed["walked"]
        assert len(frozen["full_collect_ms"]) == 1 and thawed["median_ms"] >= 0


def test_structured_runs_with_the_engine_core_in_its_own_process(tmp_path):
    """The server's layout (EMBER_ENGINE_PROCESS=1): the ratio without step timing."""
    data = _bench(["ember.bench.structured", "--num-prompts", "4", "--max-tokens", "16",
                   "--repeats", "1", "--compact"], tmp_path / "p.json", EMBER_ENGINE_PROCESS="1")
    assert data["engine_core"] == "own process" and data["outputs_valid_json"] >= 1
    assert data["constrained_over_unconstrained"] > 0 and "step_ms" not in data
