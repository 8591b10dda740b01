"""vLLM: `vllm serve` with logprobs and token ids, and the probe's vLLM adapter (full logprobs, no hidden states)."""

from __future__ import annotations

from typing import Final

from engines.base import SERVED_NAME, Distribution, Output, ServerLaunch

NAME: Final = "vllm"
DISTRIBUTIONS: Final = (Distribution(name="vllm", refresh_since="0.8.5"),)
PROBE_ADAPTER: Final = "vllm"
OUTPUTS: Final[frozenset[Output]] = frozenset({"logprobs_full"})


def server(*, dtype: str, vendor: str, port: int, model_dir: str, host: str) -> ServerLaunch:
    """`vllm serve` under a fixed model name and seed, answering with token ids and up to 20 logprobs."""
    return ServerLaunch(engine=NAME, port=port, model_id=SERVED_NAME, health_path="/health", returns_logprobs=True,
                        prompt="ids", request_extra={"ignore_eos": True, "return_tokens_as_token_ids": True},
                        argv=("vllm", "serve", model_dir, "--host", host, "--port", str(port), "--dtype", dtype,
                              "--served-model-name", SERVED_NAME, "--seed", "0", "--max-logprobs", "20",
                              "--disable-log-requests"))
