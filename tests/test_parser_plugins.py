"""Tool-call and reasoning parsers from plugins: a third-party distribution registers one of each
through its entry point (hooks ember_register_tool_parsers / ember_register_reasoning_parsers),
`ember plugins` lists them without importing them, and they resolve by name and work in the
process that loaded them. Also: `import ember` imports no parser module."""

from __future__ import annotations

from plugin_utils import last_json, run_py, write_plugin

REGISTRATION = """
    from ember.plugins import hookimpl

    @hookimpl
    def ember_register_tool_parsers(registry, api_version):
        registry.register_tool_parser("pythonic_call", "acme_parsers_impl:CallTagParser")

    @hookimpl
    def ember_register_reasoning_parsers(registry):
        registry.register_reasoning_parser("reflect", "acme_parsers_impl:ReflectParser")
"""
IMPLEMENTATION = """
    from ember.reasoning import ThinkTagReasoningParser
    from ember.tool_parsers import ToolParser
    from ember.tool_parsers.scanner import CallFormat

    class CallTagParser(ToolParser):
        call_format = CallFormat(marker="<call>", close="</call>")

    class ReflectParser(ThinkTagReasoningParser):
        start_token, end_token = "<reflect>", "</reflect>"
"""


def _site(tmp_path):
    write_plugin(tmp_path, "acme-parsers", {"acme": "acme_parsers"},
                 {"acme_parsers": REGISTRATION, "acme_parsers_impl": IMPLEMENTATION})
    return tmp_path


def test_a_plugin_registers_a_tool_parser_and_a_reasoning_parser(tmp_path):
    out = last_json(run_py("""
        import json, sys
        from ember.plugins import load_plugins
        from ember.registry import ReasoningParserRegistry, ToolParserRegistry
        from ember.tool_parsers import make_tool_parser
        from ember.reasoning import make_reasoning_parser
        report = load_plugins().to_dict()
        entry = ToolParserRegistry.entry("pythonic_call")
        listed = "acme_parsers_impl" in sys.modules
        result = make_tool_parser("pythonic_call").extract_tool_calls(
            'Hi <call>{"name": "f", "arguments": {"a": 1}}</call>')
        parser = make_reasoning_parser("reflect")
        print(json.dumps({
            "plugin": [p for p in report["plugins"] if p["name"] == "acme"][0],
            "owner": [entry.owner, entry.target], "imported_before_use": listed,
            "names": [ToolParserRegistry.names(), ReasoningParserRegistry.names()],
            "calls": result.tool_calls, "content": result.content,
            "reasoning": parser.extract_reasoning("<reflect>hmm</reflect>ok"),
        }))
    """, path=[_site(tmp_path)], EMBER_PLUGINS="acme"))
    assert out["plugin"]["status"] == "loaded" and not out["plugin"]["warnings"]
    assert out["plugin"]["registered"] == ["tool_parsers:pythonic_call",
                                           "reasoning_parsers:reflect"]
    assert out["owner"] == ["acme-parsers", "acme_parsers_impl:CallTagParser"]
    assert not out["imported_before_use"]
    assert {"hermes", "llama3_json", "mistral", "pythonic_call"} <= set(out["names"][0])
    assert {"qwen3", "deepseek_r1", "reflect"} <= set(out["names"][1])
    assert [c["function"] for c in out["calls"]] == [{"name": "f", "arguments": '{"a": 1}'}]
    assert out["content"] == "Hi " and out["reasoning"] == ["hmm", "ok"]


def test_ember_plugins_lists_the_parser_sections(tmp_path):
    out = run_py("from ember.entrypoints.cli_plugins import main; main([])",
                 path=[_site(tmp_path)], EMBER_PLUGINS="acme").stdout
    tools = out[out.index("Tool-call parsers ("):out.index("Reasoning parsers (")]
    reasoning = out[out.index("Reasoning parsers ("):]
    assert "hermes" in tools and "ember.tool_parsers.builtin:HermesToolParser" in tools
    assert "pythonic_call" in tools and "acme-parsers" in tools
    assert "qwen3" in reasoning and "deepseek_r1" in reasoning and "reflect" in reasoning


def test_import_ember_and_listing_import_no_parser_module():
    out = last_json(run_py("""
        import json, sys
        import ember
        from ember.registry import ToolParserRegistry
        names = ToolParserRegistry.names()
        before = sorted(m for m in sys.modules if m.startswith(("ember.tool_parsers",
                                                                "ember.reasoning")))
        import ember.tool_parsers, ember.reasoning
        print(json.dumps({"before": before, "torch": "torch" in sys.modules}))
    """, EMBER_PLUGINS=""))
    assert out == {"before": [], "torch": False}


def test_the_examples_in_plugins_md_work():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text("utf-8")
    namespace: dict = {}
    for header in ("# my_plugin/parsers.py", "# my_plugin/reasoning.py"):
        block = re.search(r"```python\n(" + re.escape(header) + r".*?)```", text, re.S).group(1)
        exec(compile(block, f"plugins.md:{header}", "exec"), namespace)  # noqa: S102
    result = namespace["MyCallParser"]().extract_tool_calls(
        'x<call>{"name": "f", "arguments": {}}</call>')
    assert result.tools_called and result.content == "x"
    assert namespace["ReflectParser"]().extract_reasoning("<reflect>r</reflect>a") == ("r", "a")
