"""The host side of split-KV decode attention (ember.kernels.decode_attention): the tuned
config a launch takes, how many splits a batch gets, and the workspace the splits write. No
triton import: the attention backend sizes its buffers and graphs with these alone.
"""

from __future__ import annotations

from ember.kernels.launch import cdiv, head_pad
from ember.kernels.tuning import DecodeConfig, DeviceTuning, tuning_for


def default_config(head_size: int, split: bool = False, latency: bool = False,
                   tuning: DeviceTuning | None = None, cache_itemsize: int = 2) -> DecodeConfig:
    """Kernel config for the no-split path, the split path (``split=True``), or a split launch
    with at most one program per SM (``latency=True`` too), from ``tuning`` (default: the
    default device's tables). The tables are for 16-bit caches; without splits a cache of
    ``cache_itemsize`` bytes an element takes the entry of the head size with the same bytes a
    key, where there is one (an fp8 head of 128 ran 4-28% faster on the head of 64's twice
    longer tiles on an H200; split launches measured slower that way, so they keep theirs).

    The split policy (programs_per_sm, min_split_tokens, max_splits) is read from the no-split
    entry, so the choice of splits never depends on the config it then selects.
    """
    tuning = tuning or tuning_for(None)
    if not split:
        table = tuning.decode
    else:
        table = tuning.decode_latency if latency else tuning.decode_split
    pad = head_pad(head_size)
    same_bytes = None if split else table.get(pad * cache_itemsize // 2)
    return same_bytes or table.get(pad, DecodeConfig())


def _wave_efficiency(programs: int, wave: int) -> float:
    """Fraction of the launched waves' slots that hold a program."""
    return programs / (cdiv(programs, wave) * wave)


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int | None,
    config: DecodeConfig,
    sms: int = 132,
) -> int:
    """Splits per request that make batch * kv_heads * splits programs fill whole waves.

    1 (the no-split fast path) when the batch alone fills its waves about as well.
    ``max_seq_len=None`` (e.g. CUDA-graph capture, where lengths change at replay) allows up to
    ``graph_max_splits``; the kernels then shrink the splits a short request actually uses.
    """
    base = batch * num_kv_heads
    direct_wave = sms * config.direct_programs_per_sm
    if base >= 2 * direct_wave:
        return 1  # many waves: quantisation no longer matters
    if max_seq_len is None:
        max_splits = config.graph_max_splits
    else:
        max_splits = min(config.max_splits, cdiv(max_seq_len, config.min_split_tokens))
    split_wave = sms * config.programs_per_sm
    # At most four waves: more only adds reduce work and shorter, less efficient programs.
    max_splits = min(max_splits, 4 * split_wave // base)
    best, best_eff = 1, _wave_efficiency(base, direct_wave)
    for splits in range(2, max_splits + 1):
        eff = _wave_efficiency(base * splits, split_wave)
        # Near-ties go to fewer splits: longer programs amortise their pipeline start, and the
        # reduce has less to merge.
        if eff > best_eff + 0.05:
            best, best_eff = splits, eff
    return best


def decode_workspace_numel(batch: int, num_heads: int, head_size: int, num_splits: int) -> int:
    """fp32 elements of split workspace: partial outputs plus one log-sum-exp per split."""
    return batch * num_heads * num_splits * (head_pad(head_size) + 1)
