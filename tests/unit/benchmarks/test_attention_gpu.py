"""benchmarks/attention_gpu.py's arithmetic (no GPU here): the decode byte floor, the causal
work of a prefill chunk, the layers rotated, the shape arguments."""

from __future__ import annotations

import pytest

from benchmarks import attention_gpu as ag


def test_decode_floor_is_kv_once_plus_q_and_out():
    # 2 sequences x 100 tokens x 8 KV heads x 128 x (K, V) x 2 bytes, and q + out
    assert ag.kv_bytes(2, 100) == 2 * 100 * 8 * 128 * 2 * 2
    assert ag.decode_floor_bytes(2, 100) == ag.kv_bytes(2, 100) + 2 * 2 * 32 * 128 * 2


def test_causal_flops_count_each_visible_pair():
    """A chunk of 3 queries after 2 cached keys sees 3, 4 and 5 keys: 12 pairs."""
    per_pair = 2 * 2 * 32 * 128
    assert ag.causal_flops(3, 2) == 12 * per_pair
    assert ag.causal_flops(1, 0) == per_pair


def test_layers_rotated_keep_three_l2s_in_flight():
    assert ag.layers_for(1 << 30) == 1
    assert ag.layers_for(int(ag.ROTATE_BYTES) // 4) == 4
    assert ag.layers_for(10) == 32  # capped


def test_shape_arguments():
    assert ag.parse_pairs("1x512,128x2048", []) == [(1, 512), (128, 2048)]
    assert ag.parse_pairs("", ag.DECODE) == ag.DECODE
    with pytest.raises(SystemExit, match="expected AxB"):
        ag.parse_pairs("12", [])
