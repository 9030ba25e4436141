"""docs/plugin-walkthrough.md runs: its Python code blocks, in order, as one script in a fresh
process, so the walkthrough cannot fall behind the code it teaches."""

from __future__ import annotations

import re

import pytest
from plugin_utils import REPO, run_py

WALKTHROUGH = REPO / "docs" / "plugin-walkthrough.md"
CODE_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def walkthrough_code() -> str:
    blocks = CODE_BLOCK.findall(WALKTHROUGH.read_text(encoding="utf-8"))
    assert len(blocks) >= 5, f"expected the walkthrough's code blocks, found {len(blocks)}"
    return "\n\n".join(blocks)


def test_walkthrough_code_runs_and_its_checks_pass(tmp_path):
    script = tmp_path / "walkthrough.py"
    script.write_text(walkthrough_code())
    # Run as a script file: classes at its module level are importable by name, as in a user's
    # own script; EMBER_PLUGINS="" keeps installed plugins out of the result.
    proc = run_py(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
                  EMBER_PLUGINS="", EMBER_DISABLE_PROGRESS="1")
    lines = proc.stdout.splitlines()
    backend = [line for line in lines if line.startswith("ok  ")]
    model = [line for line in lines if line.startswith(("tied=False ok", "tied=True ok"))]
    assert len(backend) >= 5, proc.stdout  # one line per scenario and grid case
    assert len(model) == 6, proc.stdout  # three prompts, untied and tied
    assert any("window=5" in line for line in backend)
    assert any("soft_cap=20.0" in line for line in backend)


def test_quantization_example_in_plugins_md_passes_the_kit():
    """The guide's MyInt8Method, as printed, passes the kit (all-zero rows included); the same
    code without the clamp is caught."""
    from ember.testing import check_quantization_method

    text = (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")
    source = next(b for b in CODE_BLOCK.findall(text) if "class MyInt8Method" in b)
    namespace: dict = {}
    exec(compile(source, "plugins.md:MyInt8Method", "exec"), namespace)  # noqa: S102
    assert check_quantization_method(namespace["MyInt8Method"], max_weight_error=0.05)

    unguarded = source.replace(".clamp(min=1e-12)", "")
    assert unguarded != source
    exec(compile(unguarded, "plugins.md:unguarded", "exec"), namespace)  # noqa: S102
    with pytest.raises(AssertionError, match="NaN or inf"):
        check_quantization_method(namespace["MyInt8Method"])
