"""SGLang: `python -m sglang.launch_server` with logprobs, and the probe's SGLang adapter (full logprobs)."""

from __future__ import annotations

from typing import Final

from engines.base import SERVED_NAME, Distribution, Output, ServerLaunch

NAME: Final = "sglang"
DISTRIBUTIONS: Final = (Distribution(name="sglang", refresh_since="0.5.19"),)
PROBE_ADAPTER: Final = "sglang"
OUTPUTS: Final[frozenset[Output]] = frozenset({"logprobs_full"})


def server(*, dtype: str, vendor: str, port: int, model_dir: str, host: str, distribution: str) -> ServerLaunch:
    """SGLang's launch_server under a fixed model name and seed."""
    return ServerLaunch(engine=NAME, port=port, model_id=SERVED_NAME, health_path="/health", returns_logprobs=True,
                        prompt="ids", request_extra={"ignore_eos": True},
                        argv=("python3", "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host,
                              "--port", str(port), "--dtype", dtype, "--served-model-name", SERVED_NAME,
                              "--random-seed", "0"))
