"""A grammar backend from a third party: an installed distribution whose `ember.plugins` entry
point registers it (ember_register_grammar_backends) is listed with its owner, chosen with
structured_outputs_config={"backend": name}, refuses what it cannot compile by name, and
constrains generation (here a token trie over the tokenized choices: choice only)."""

from __future__ import annotations

from plugin_utils import last_json, run_py, write_plugin

PLUGIN = '''
from ember.plugins import hookimpl

@hookimpl
def ember_register_grammar_backends(registry):
    registry.register_grammar_backend("token_trie", "token_trie.impl:TokenTrieBackend")
'''

IMPL = '''
from ember.structured_output.interface import Grammar, StructuredOutputBackend

COMPILED = []  # specs this backend compiled (the test reads it)


def _set_bit(bitmask, row, token):
    word = int(bitmask[row, token // 32]) & 0xFFFFFFFF | (1 << (token % 32))
    bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word


class TrieGrammar(Grammar):
    """The output is one of the choices' token sequences, then a stop token."""

    def __init__(self, sequences, stop_ids):
        self.sequences, self.stop_ids, self.prefix, self.done = sequences, stop_ids, [], False

    def _live(self):
        n = len(self.prefix)
        return [s for s in self.sequences if s[:n] == self.prefix]

    def accept_token(self, token):
        if token in self.stop_ids and any(len(s) == len(self.prefix) for s in self._live()):
            self.done = True
            return True
        self.prefix.append(token)
        return bool(self._live())

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        n = len(self.prefix)
        for s in self._live():
            for token in ([s[n]] if len(s) > n else self.stop_ids):
                _set_bit(bitmask, row, token)

    def is_terminated(self):
        return self.done


class TokenTrieBackend(StructuredOutputBackend):
    @classmethod
    def validate(cls, spec):
        if spec.kind != "choice":
            raise ValueError(f"token_trie compiles choice only, not {spec.kind}")

    def __init__(self, tokenizer, vocab_size, config):
        self.tokenizer = tokenizer

    def compile(self, spec):
        COMPILED.append(spec.value)
        return [self.tokenizer.encode(c, add_special_tokens=False) for c in spec.choices()]

    def new_grammar(self, compiled, stop_token_ids):
        return TrieGrammar(compiled, list(stop_token_ids))
'''


def test_grammar_backend_from_an_entry_point(tmp_path):
    write_plugin(tmp_path, "ember-token-trie", {"token_trie": "token_trie.plugin"},
                 {"token_trie.__init__": "", "token_trie.plugin": PLUGIN,
                  "token_trie.impl": IMPL})
    proc = run_py('''
        import json
        from ember import LLM, SamplingParams, StructuredOutputsParams
        from ember.registry import GrammarBackendRegistry

        entry = GrammarBackendRegistry.entry("token_trie")
        llm = LLM(max_model_len=128, structured_outputs_config={"backend": "token_trie"})
        choices = ["Paris", "London", "New York City"]
        params = [SamplingParams(temperature=t, seed=i, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(choice=choices))
                  for i, t in enumerate([0.0, 1.0, 1.0, 1.0])]
        outs = llm.generate(["The best city is"] * 4, params, use_tqdm=False)
        try:
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(
                regex="a+")), use_tqdm=False)
            refused = None
        except ValueError as exc:
            refused = str(exc)
        from token_trie.impl import COMPILED
        print(json.dumps({"owner": entry.owner, "refused": refused, "compiled": len(COMPILED),
                          "texts": [o.outputs[0].text for o in outs],
                          "finish": [o.outputs[0].finish_reason for o in outs]}))
    ''', path=[tmp_path])
    result = last_json(proc)
    assert result["owner"] == "ember-token-trie"
    assert all(text in ["Paris", "London", "New York City"] for text in result["texts"])
    assert result["finish"] == ["stop"] * 4
    assert result["compiled"] == 1  # one spec, compiled once, shared by the four requests
    assert "token_trie compiles choice only, not regex" in result["refused"]
