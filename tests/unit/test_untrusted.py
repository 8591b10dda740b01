"""skupin/common/untrusted.py: JSON depth measured in one pass (right on tricky inputs, never quadratic), limits enforced."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from skupin.common.untrusted import MAX_JSON_DEPTH, UntrustedInputError, json_depth, load_json

REPO = Path(__file__).resolve().parents[2]


def _depth_in_a_subprocess(data: bytes, within: float = 60.0) -> int:
    """json_depth(data) in a fresh interpreter, killed after a generous `within` seconds (bench/hostile_bench.py holds
    the speed target): only a quadratic scan misses it on a megabyte, and re's C loop would not let a thread time out."""
    code = "import sys; from skupin.common.untrusted import json_depth; print(json_depth(sys.stdin.buffer.read()))"
    try:
        done = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=within, check=True,
                              cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"json_depth did not finish a {len(data)}-byte input within {within} s")
    return int(done.stdout)


@pytest.mark.parametrize("text, depth", [
    (b"", 0),
    (b"1", 0),
    (b"[]", 1),
    (b'{"a": [1, {"b": []}]}', 4),
    (b'["a\\"]", [1]]', 2),  # an escaped quote does not end the string, so its bracket is text
    (b'"\\\\"[[1]]', 2),  # an escaped backslash does: the brackets after it count
    (b'{"k": "[[[[{{{{", "v": {"w": []}}', 3),
    (b'["\\\\\\"[", [[]]]', 3),
    (b'["]]]]", [["}}"]]]', 3),
    (b'"' + b'\\"' * 1000, 0),  # an unterminated string: everything after its quote is text
    (b"[" * 1000, 1000),
    (b'["a\\', 1),  # a string cut after a backslash
    (b'[["\\"]]', 2),  # "\"]] never closes: its brackets are text
    (b'[1, "x"] [[2]]', 2),
    (b"]]][[", 0),  # not JSON: closers first never count as depth
])
def test_json_depth_on_tricky_inputs(text: bytes, depth: int) -> None:
    assert json_depth(text) == depth


def _doc(rng: random.Random, depth: int):
    pick = rng.random()
    if depth == 0 or pick < 0.3:
        return "".join(rng.choice('ab"\\[]{}\u00e9\n') for _ in range(rng.randint(0, 6)))
    if pick < 0.65:
        return [_doc(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {_doc(rng, 0): _doc(rng, depth - 1) for _ in range(rng.randint(0, 3))}


def _real_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((_real_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_real_depth(v) for v in value.values()), default=0)
    return 0


@pytest.mark.parametrize("seed", range(200))
def test_json_depth_is_the_parsed_documents_depth(seed: int) -> None:
    doc = _doc(random.Random(seed), 8)
    for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False, indent=1)):
        assert json_depth(text.encode()) == _real_depth(doc)


@pytest.mark.parametrize("hostile", [
    b'"' + b'\\"' * 500_000,  # every escaped quote used to start a fresh scan to the end (quadratic)
    b'["' + b'\\"[' * 333_333,
    b'"\\' * 500_000,
    b'[' + b'"\\"",' * 200_000 + b'"\\"',
    b'["' + b'\\' * 1_000_001,
])
def test_a_megabyte_of_adversarial_escapes_is_measured_at_once(hostile: bytes) -> None:
    assert len(hostile) >= 1_000_000
    assert _depth_in_a_subprocess(hostile) == (1 if hostile.startswith(b"[") else 0)
    with pytest.raises(UntrustedInputError, match="not valid JSON"):
        load_json(hostile, source="x")


def test_load_json_refuses_a_document_too_deep_before_parsing_it() -> None:
    with pytest.raises(UntrustedInputError, match="nested"):
        load_json(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), source="x")
    assert load_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, source="x") is not None
