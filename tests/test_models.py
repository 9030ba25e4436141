"""Our Llama-family models (SDPA backend, float32, CPU) against HF transformers on the same tiny
random checkpoints: flat multi-prompt prefill, paged decode, chunked prefill, sliding windows."""

from __future__ import annotations

import pytest
import torch
from model_factory import ARCHS, Chunk, PagedCache, make_tiny_hf_model

from ember.attention_backends.sdpa import SdpaBackend
from ember.models.llama import LlamaForCausalLM, MistralForCausalLM
from ember.models.loader import load_model
from ember.models.qwen2 import Qwen2ForCausalLM
from ember.models.qwen3 import Qwen3ForCausalLM

CLASSES = {
    "llama": LlamaForCausalLM, "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
}  # fmt: skip
ATOL = 1e-4


def _pair(arch: str, tmp_path, **overrides):
    """(HF model, our model) with the same weights, loaded through the safetensors path."""
    hf = make_tiny_hf_model(arch, **overrides)
    path = tmp_path / arch
    hf.save_pretrained(path, safe_serialization=True)
    ours = load_model(path, CLASSES[arch], SdpaBackend, torch.float32)
    return hf, ours


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


class _Runner:
    """Feeds steps to our model and checks them against HF's logits of the full sequences."""

    def __init__(self, hf, ours, seqs: list[list[int]], block_size: int, num_blocks: int = 96):
        self.ours = ours
        self.seqs = seqs
        self.ref = [_hf_logits(hf, s) for s in seqs]
        self.cache = PagedCache(ours, num_blocks, block_size, seed=1)
        self.done = [0] * len(seqs)

    def step(self, plan: dict[int, int], pad_to: int | None = None) -> None:
        """plan: request -> number of its next tokens to feed (decodes first)."""
        chunks = []
        for r, n in plan.items():
            if n:
                chunks.append(Chunk(r, self.seqs[r][self.done[r] : self.done[r] + n]))
        hidden = self.cache.step(self.ours, chunks, pad_to)
        logits = self.ours.compute_logits(hidden)
        assert logits.dtype == torch.float32
        row = 0
        for c in chunks:
            r, n = c.req_id, len(c.tokens)
            ref = self.ref[r][self.done[r] : self.done[r] + n]
            torch.testing.assert_close(logits[row : row + n], ref, atol=ATOL, rtol=1e-4,
                                       msg=lambda m, r=r: f"request {r}: {m}")  # fmt: skip
            self.done[r] += n
            row += n


@pytest.mark.parametrize("arch", ARCHS)
def test_flat_prefill_matches_hf(arch, tmp_path):
    hf, ours = _pair(arch, tmp_path)
    seqs = _prompts([5, 11, 1, 8], hf.config.vocab_size)
    run = _Runner(hf, ours, seqs, block_size=4)
    run.step({0: 5, 1: 11, 2: 1, 3: 8})


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_matches_hf(arch, block_size, tmp_path):
    hf, ours = _pair(arch, tmp_path)
    seqs = _prompts([14, 12, 9, 20], hf.config.vocab_size, seed=1)
    run = _Runner(hf, ours, seqs, block_size)
    run.step({0: 7, 1: 3, 2: 9})
    for _ in range(4):  # decode-only steps across block boundaries
        run.step({0: 1, 1: 1})
    # Mixed step: decodes first, then a new request's whole prompt; padded like a graph batch.
    run.step({0: 1, 1: 1, 3: 12}, pad_to=20)
    for _ in range(2):
        run.step({0: 1, 1: 1, 3: 1})


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_hf(arch, tmp_path):
    hf, ours = _pair(arch, tmp_path)
    seqs = _prompts([17, 6], hf.config.vocab_size, seed=2)
    run = _Runner(hf, ours, seqs, block_size=4)
    run.step({0: 6, 1: 5})  # request 0's prompt split 6 + 9 (+ 1 decode), across two steps
    run.step({1: 1, 0: 9})  # the decode of request 1 first, then request 0's second chunk
    run.step({0: 1})
    run.step({0: 1})


@pytest.mark.parametrize("arch,overrides", [
    ("mistral", {"sliding_window": 5}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
])  # fmt: skip
def test_sliding_window_matches_hf(arch, overrides, tmp_path):
    hf, ours = _pair(arch, tmp_path, **overrides)
    windows = ours.sliding_windows
    assert any(w is not None for w in windows)
    seqs = _prompts([23, 20, 16], hf.config.vocab_size, seed=3)
    run = _Runner(hf, ours, seqs, block_size=4)
    run.step({0: 10, 1: 12})
    run.step({1: 1, 0: 7, 2: 9})  # a chunk whose earliest keys already left the window
    for _ in range(5):
        run.step({0: 1, 1: 1, 2: 1})


def test_greedy_decode_matches_hf_generate(tmp_path):
    hf, ours = _pair("qwen3", tmp_path)
    prompt = _prompts([7], hf.config.vocab_size, seed=4)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                          min_new_tokens=10)[0, len(prompt):].tolist()  # fmt: skip
    cache = PagedCache(ours, 32, 4)
    hidden = cache.step(ours, [Chunk(0, prompt)])
    got = [int(ours.compute_logits(hidden[-1:]).argmax())]
    while len(got) < 10:
        hidden = cache.step(ours, [Chunk(0, [got[-1]])])
        got.append(int(ours.compute_logits(hidden).argmax()))
    assert got == ref


def test_geometry_and_names(tmp_path):
    hf, ours = _pair("qwen3", tmp_path)
    assert (ours.num_layers, ours.num_kv_heads, ours.head_size) == (3, 2, 32)
    names = {n for n, _ in ours.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert "lm_head.weight" not in names  # tied
    assert ours.expected_weight_names() == set(hf.state_dict()) - {"lm_head.weight"}


def test_bf16_model_close_to_hf(tmp_path):
    hf = make_tiny_hf_model("llama")
    path = tmp_path / "llama"
    hf.save_pretrained(path, safe_serialization=True)
    ours = load_model(path, LlamaForCausalLM, SdpaBackend, torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    seq = _prompts([9], hf.config.vocab_size)[0]
    hidden = PagedCache(ours, 16, 4).step(ours, [Chunk(0, seq)])
    ref = _hf_logits(hf.to(torch.bfloat16), seq)
    torch.testing.assert_close(ours.compute_logits(hidden), ref, atol=0.1, rtol=0.05)


# ---------------------------------------------------------------------------------- loading


def test_weights_iterator_and_sharded_checkpoint(tmp_path):
    hf = make_tiny_hf_model("qwen2")
    # From an iterator of (HF name, tensor), as the GGUF loader yields; stray rope buffers ignored.
    pairs = [*hf.state_dict().items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", None)]
    a = load_model(hf.config, Qwen2ForCausalLM, SdpaBackend, torch.float32, weights=iter(pairs))
    # From a sharded directory (model.safetensors.index.json).
    path = tmp_path / "sharded"
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    b = load_model(path, Qwen2ForCausalLM, SdpaBackend, torch.float32)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_model(path, Qwen2ForCausalLM, SdpaBackend, torch.float32)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_is_a_value_error(damage, tmp_path):
    path = tmp_path / "m"
    make_tiny_hf_model("llama").save_pretrained(path, safe_serialization=True)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x07" * 300,
                   "empty": b""}[damage])  # fmt: skip
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt or truncated"):
        load_model(path, LlamaForCausalLM, SdpaBackend, torch.float32)


def test_missing_config_or_weights(tmp_path):
    path = tmp_path / "m"
    hf = make_tiny_hf_model("llama")
    hf.config.save_pretrained(path)
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        load_model(path, LlamaForCausalLM, SdpaBackend, torch.float32)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(path, LlamaForCausalLM, SdpaBackend, torch.float32, load_format="dummy")
    with pytest.raises(ValueError, match="load_format"):
        load_model(hf.config, LlamaForCausalLM, SdpaBackend, torch.float32, load_format="pt")


def test_load_weights_names_bad_weights():
    hf = make_tiny_hf_model("llama")
    sd = hf.state_dict()
    model = LlamaForCausalLM(hf.config, SdpaBackend, torch.float32)
    q_name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=f"missing.*{q_name}"):
        model.load_weights((n, t) for n, t in sd.items() if n != q_name)
    with pytest.raises(ValueError, match="unknown weights.*model.bogus.weight"):
        model.load_weights([*sd.items(), ("model.bogus.weight", torch.zeros(1))])
    bad = dict(sd, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight.*\(3, 3\)"):
        model.load_weights(bad.items())
    assert model.load_weights(sd.items()) == set(sd)


def test_dummy_weights_from_config_alone(tmp_path):
    config = make_tiny_hf_model("qwen3").config
    path = tmp_path / "cfg"
    config.save_pretrained(path)  # a directory with config.json and no weights
    a = load_model(path, Qwen3ForCausalLM, SdpaBackend, torch.float32, load_format="dummy")
    b = load_model(config, Qwen3ForCausalLM, SdpaBackend, torch.float32, load_format="dummy")
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb)  # deterministic
        assert pa.abs().max() <= 1e-3 and pa.abs().max() > 0
    hidden = PagedCache(a, 8, 4).step(a, [Chunk(0, [1, 2, 3, 4, 5])])
    assert torch.isfinite(a.compute_logits(hidden)).all()
