"""The `ember` command: generate and chat on the embedded default model, and a clear error."""

import subprocess
import sys

import pytest

EMBER = [sys.executable, "-m", "ember.entrypoints.cli"]


def run(args, stdin=None):
    return subprocess.run(EMBER + args, input=stdin, capture_output=True, text=True, timeout=300,
                          env={"EMBER_DISABLE_PROGRESS": "1", "PATH": "/usr/bin:/bin",
                               "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_generate_default_model():
    result = run(["generate", "What is the capital of France?", "--max-tokens", "16"])
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.slow
def test_chat_reads_stdin_and_keeps_history():
    result = run(["chat", "--max-tokens", "24"],
                 stdin="What is the capital of France?\nAnd of Germany?\n")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) >= 2 and "Paris" in lines[0]
    assert "Berlin" in result.stdout


def test_unknown_model_is_a_clear_error():
    result = run(["generate", "hi", "--model", "/no/such/model"])
    assert result.returncode == 2
    assert "not found" in result.stderr
