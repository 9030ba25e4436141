"""The start-up heap kept out of the garbage collector's full walks (ember.gc_heap): in the
processes ember owns, never in the user's."""

import json
import os
import subprocess
import sys
import textwrap


def _run(code: str, **env_vars: str) -> dict:
    # A fresh interpreter each: freezing is process-wide, and this test process is shared.
    env = {k: v for k, v in os.environ.items() if k not in ("EMBER_GC_FREEZE",
                                                            "EMBER_ENGINE_PROCESS")}
    env.update(env_vars)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


IN_PROCESS = """
    import gc, json
    from ember import LLM
    llm = LLM(max_model_len=256)
    model = llm.llm_engine.executor.runner.model
    # gc.get_objects() lists the collector's generations, not the frozen objects.
    print(json.dumps({"frozen": gc.get_freeze_count(),
                      "model_frozen": not any(o is model for o in gc.get_objects())}))
"""


def test_user_process_is_never_frozen():
    # Its own objects would be frozen with it (see test_engine_release's application).
    assert _run(IN_PROCESS) == {"frozen": 0, "model_frozen": False}


ENGINE_PROCESS = """
    import gc, json
    from ember import LLM

    def frozen_in_core(model):
        import gc
        # gc.get_objects() lists the collector's generations, not the frozen objects.
        return gc.get_freeze_count(), not any(o is model for o in gc.get_objects())

    llm = LLM(max_model_len=256)
    frozen, model_frozen = llm.apply_model(frozen_in_core)[0]
    print(json.dumps({"core": frozen, "model_frozen": model_frozen}))
    llm.shutdown()
"""


def test_engine_core_process_freezes_its_whole_heap():
    # Everything the core's process built, its model included: the process lives as long as
    # its engine.
    got = _run(ENGINE_PROCESS, EMBER_ENGINE_PROCESS="1")
    assert got["core"] > 100_000 and got["model_frozen"]
    assert _run(ENGINE_PROCESS, EMBER_ENGINE_PROCESS="1", EMBER_GC_FREEZE="0") == {
        "core": 0, "model_frozen": False}
