"""Models by hub name against a local hub cache laid out by huggingface_hub's own cache helpers
(blobs, snapshots/<commit> symlinks, refs/<branch or tag>; scan_cache_dir must accept it), with
HF_HUB_OFFLINE=1 (no network exists here): LLM("org/name") with revision (branch, tag, commit),
download_dir, a hub tokenizer with tokenizer_revision; only safetensors weights are read; names
that do not resolve get one clear error; revision on a local model is refused."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from model_factory import make_tiny_model

from ember import LLM, SamplingParams

REPO = "ember-test/tiny-llama"
TOK_REPO = "ember-test/tokenizer"
MAIN, V1 = "a" * 40, "b" * 40


def add_to_cache(cache: Path, repo_id: str, src: Path, commit: str, refs: list[str]) -> None:
    """Put every file of ``src`` in the hub cache as huggingface_hub does after a download."""
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    for file in sorted(p for p in src.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        dst = storage / "snapshots" / commit / file.relative_to(src)
        dst.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(dst), new_blob=False)
    for ref in refs:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """Two commits of one repo (different random weights): main, and a tag v1."""
    root = tmp_path_factory.mktemp("hub")
    main = make_tiny_model("llama", root / "main", seed=0)
    v1 = make_tiny_model("llama", root / "v1", seed=7)
    (main / "pytorch_model.bin").write_bytes(b"not read: safetensors are preferred")
    cache = root / "cache"
    add_to_cache(cache, REPO, main, MAIN, ["main"])
    add_to_cache(cache, REPO, v1, V1, ["v1"])
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {MAIN, V1}
    return cache, main, v1


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One intra-op thread (as in test_engine_gemma_phi.py: a shared small CPU thrashes)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # engine processes read the environment
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


PROMPTS = [{"prompt_token_ids": [5, 9, 13, 40, 7]}, {"prompt_token_ids": [3, 3, 100]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6)


def _tokens(model: str, **kw) -> list[list[int]]:
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=32, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_hub_name_revisions_offline(hub_cache, offline):
    cache, main, v1 = hub_cache
    expected_main, expected_v1 = _tokens(str(main)), _tokens(str(v1))
    assert expected_main != expected_v1  # the two commits are told apart
    assert _tokens(REPO, download_dir=str(cache)) == expected_main
    assert _tokens(REPO, download_dir=str(cache), revision="v1") == expected_v1  # a tag
    assert _tokens(REPO, download_dir=str(cache), revision=V1) == expected_v1  # a commit


def test_resolution_uses_the_snapshot_and_reads_safetensors_only(hub_cache, offline):
    from ember.model_resolution import resolve_model_source
    from ember.models.loader.hub import fetch_weights

    cache, _, _ = hub_cache
    path, hub = resolve_model_source(REPO, "v1", str(cache))
    assert Path(path) == cache / "models--ember-test--tiny-llama" / "snapshots" / V1
    assert (hub.repo_id, hub.commit) == (REPO, V1)
    assert fetch_weights(hub, progress=False) == path
    assert {p.name for p in Path(path).glob("*.safetensors")} == {"model.safetensors"}


def test_default_cache_is_hf_hub_cache(hub_cache, offline, monkeypatch):
    from huggingface_hub import constants

    from ember.model_resolution import resolve_model_path

    cache, _, _ = hub_cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert Path(resolve_model_path(REPO)) == cache / "models--ember-test--tiny-llama" / \
        "snapshots" / MAIN


def test_hub_tokenizer_and_revision(hub_cache, offline, tmp_path):
    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    cache, main, _ = hub_cache
    tok = load_tokenizer(default_model_path())
    tok.save_pretrained(tmp_path / "tok")
    add_to_cache(cache, TOK_REPO, tmp_path / "tok", "c" * 40, ["main", "t1"])
    llm = LLM(REPO, download_dir=str(cache), tokenizer=TOK_REPO, tokenizer_revision="t1",
              max_model_len=64, num_gpu_blocks_override=16)
    try:
        assert llm.get_tokenizer()("Hello").input_ids == tok("Hello").input_ids
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="no-such-rev"):
        LLM(REPO, download_dir=str(cache), tokenizer=TOK_REPO, tokenizer_revision="no-such-rev")


@pytest.mark.parametrize("name,revision,match", [
    ("ember-test/not-there", None, "not a local path.*not in the hub cache.*HF_HUB_OFFLINE"),
    (REPO, "v2", "not a local path.*not in the hub cache.*HF_HUB_OFFLINE"),
    ("./no/such/dir", None, "not found: expected a local HF-format directory"),
    ("a//b", None, "not found: expected a local"),
])
def test_unresolvable_names_are_clear(hub_cache, offline, name, revision, match):
    cache, _, _ = hub_cache
    with pytest.raises(ValueError, match=match):
        LLM(name, download_dir=str(cache), revision=revision, skip_tokenizer_init=True)


def test_hub_only_arguments_refused_for_local_models(hub_cache):
    _, main, _ = hub_cache
    for kw, name in [({"revision": "v1"}, "revision"), ({"download_dir": "/tmp"}, "download_dir"),
                     ({"tokenizer_revision": "v1"}, "tokenizer_revision")]:
        with pytest.raises(ValueError, match=name):
            LLM(str(main), skip_tokenizer_init=True, **kw)


def test_repo_without_safetensors_is_refused(hub_cache, offline, tmp_path):
    from ember.model_resolution import resolve_model_source
    from ember.models.loader.hub import fetch_weights

    cache, main, _ = hub_cache
    src = tmp_path / "binonly"
    src.mkdir()
    (src / "config.json").write_bytes((main / "config.json").read_bytes())
    (src / "pytorch_model.bin").write_bytes(b"x")
    add_to_cache(cache, "ember-test/bin-only", src, "d" * 40, ["main"])
    _, hub = resolve_model_source("ember-test/bin-only", None, str(cache))
    with pytest.raises(ValueError, match="no safetensors weights"):
        fetch_weights(hub, progress=False)
    assert os.path.isfile(os.path.join(hub.snapshot, "config.json"))


@pytest.mark.slow
def test_ember_serve_by_hub_name(hub_cache, tmp_path):
    """`ember serve org/name --revision v1` offline: served under the hub name, v1's weights."""
    import subprocess
    import sys
    import time

    import httpx
    from server_utils import free_port

    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    cache, _, v1 = hub_cache
    # The default model's tokenizer detokenizes the tiny model's ids (all below 320).
    load_tokenizer(default_model_path()).save_pretrained(tmp_path / "tok")
    add_to_cache(cache, "ember-test/serve-tok", tmp_path / "tok", "e" * 40, ["main"])
    expected = _tokens(str(v1))[0]
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "EMBER_DISABLE_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ember.entrypoints.cli", "serve", REPO, "--revision", "v1",
           "--tokenizer", "ember-test/serve-tok", "--port", str(port), "--max-model-len", "64",
           "--num-gpu-blocks-override", "32", "--uvicorn-log-level", "warning"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [REPO]
        body = {"model": REPO, "prompt": PROMPTS[0]["prompt_token_ids"], "max_tokens": 6,
                "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True}
        out = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        tokens = out["choices"][0]["logprobs"]["tokens"]
        assert tokens == [f"token_id:{t}" for t in expected]
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def test_plugins_explain_takes_a_hub_name(hub_cache, offline, monkeypatch, capsys):
    from huggingface_hub import constants

    from ember.entrypoints.cli_plugins import main

    cache, _, _ = hub_cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    main(["--explain", "--model", REPO, "--device", "cpu"])
    out = capsys.readouterr().out
    assert "model needs: dtype float32, head size 16" in out, out


_ONLINE_SCRIPT = """
import json, sys
from ember import LLM, SamplingParams
from ember.model_resolution import resolve_model_source
from ember.models.loader.hub import fetch_weights

out = {}
llm = LLM("org/sharded", revision="v1", skip_tokenizer_init=True, max_model_len=64,
          num_gpu_blocks_override=32, show_progress=True)
params = SamplingParams(temperature=0.0, max_tokens=6)
prompts = [{"prompt_token_ids": [5, 9, 13, 40, 7]}, {"prompt_token_ids": [3, 3, 100]}]
out["tokens"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
llm.shutdown()
for name, rev in [("org/missing", None), ("org/sharded", "no-such-rev"), ("org/bin-only", None)]:
    try:
        _, hub = resolve_model_source(name, rev, None, False)
        fetch_weights(hub, False)
        out[name + str(rev)] = "no error"
    except ValueError as e:
        out[name + str(rev)] = str(e)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_download_from_a_hub_server(tmp_path):
    """Online: huggingface_hub downloads from a local server speaking the hub API. Only the
    config/tokenizer-side files and the index's shards are fetched (no .bin, no consolidated
    copy), with huggingface_hub's progress bar; the revision's weights are the ones run; a
    missing repo, a missing revision and a .bin-only repo get clear errors."""
    import json
    import subprocess
    import sys

    from hub_server import FakeHub

    src = make_tiny_model("llama", tmp_path / "src", seed=3)
    sharded = tmp_path / "sharded"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src).save_pretrained(sharded, max_shard_size="60KB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    (sharded / "pytorch_model.bin").write_bytes(b"never fetched")
    (sharded / "consolidated.safetensors").write_bytes(b"never fetched either")
    (sharded / "README.md").write_text("not needed")
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    (bin_only / "config.json").write_bytes((src / "config.json").read_bytes())
    (bin_only / "pytorch_model.bin").write_bytes(b"x")
    expected = _tokens(str(src))
    with FakeHub() as hub:
        hub.add("org/sharded", "f" * 40, sharded, ["v1"])
        hub.add("org/bin-only", "0" * 40, bin_only, ["main"])
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"),
               "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0", "OMP_NUM_THREADS": "1"}
        env.pop("EMBER_DISABLE_PROGRESS", None)
        proc = subprocess.run([sys.executable, "-c", _ONLINE_SCRIPT], env=env,
                              capture_output=True, text=True, timeout=300)
        downloads = {d.split("/", 2)[2] for d in hub.downloads if d.startswith("org/sharded/")}
    result = json.loads(proc.stdout.split("RESULT ", 1)[1]) if "RESULT " in proc.stdout else None
    assert result is not None, proc.stderr[-3000:]
    assert result["tokens"] == expected
    assert downloads == {"config.json", "generation_config.json",
                         "model.safetensors.index.json", *shards}
    assert "Fetching" in proc.stderr  # huggingface_hub's tqdm bar
    assert "not a local path and not a model on the hub" in result["org/missingNone"]
    assert "has no revision 'no-such-rev'" in result["org/shardedno-such-rev"]
    assert "no safetensors weights" in result["org/bin-onlyNone"]
