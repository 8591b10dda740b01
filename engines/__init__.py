"""How each inference engine serves its OpenAI-compatible API: the image's default command and what the gate sends it.

One function, two users: the Dockerfile's ``CMD`` (builder/render.py), so that
``docker run -v MODEL:/model -p 8000:8000 IMAGE`` serves the model, and the gate's serve check
(gates/serving/serve.py), which boots exactly that command in its sandbox with the fixture mounted at the
same path. The gate therefore runs the image the way production does: there is no gate-only
mount path or command line for a start-up hook to key on (docs/GATE.md, threat model).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from builder.manifest import SkuManifest
from common.model import Frozen

MODEL_MOUNT = "/model"
# What each engine's probe adapter returns besides the teacher-forced top-k logprobs (imagetools/probe.py): a
# candidate that leaves out one of these loses a statistic, so the gate fails it instead of skipping it.
ENGINE_OUTPUTS: dict[str, frozenset[str]] = {
    "transformers": frozenset({"hidden", "logprobs_full"}),  # final hidden states, full-vocabulary logprobs
    "vllm": frozenset({"logprobs_full"}),
    "sglang": frozenset({"logprobs_full"}),
}
SERVE_PORT = 8000
SERVED_NAME = "skupin-model"
SERVE_ENGINES = ("transformers", "vllm", "sglang")


class ServerLaunch(Frozen):
    """How one engine's OpenAI-compatible server is started and addressed."""

    engine: Literal["transformers", "vllm", "sglang"]
    argv: tuple[str, ...] = Field(description="The production launch command, entrypoint first")
    port: int
    model_id: str = Field(description="The `model` field requests must name")
    health_path: str = "/health"
    returns_logprobs: bool = Field(description="Whether the engine honours `logprobs` on /v1/completions")
    request_extra: dict[str, Any] = Field(default_factory=dict, description="Engine-specific request fields")


def serve_launch(*, manifest: SkuManifest, port: int = SERVE_PORT, model_dir: str = MODEL_MOUNT,
                 host: str = "0.0.0.0") -> ServerLaunch | None:  # the container's own interfaces
    """The SKU's engine server command serving `model_dir` on host:port; None for an engine with no server."""
    engine = manifest.stack.engine.name
    dtype = manifest.gate.dtype
    if engine == "transformers":
        device = "cpu" if manifest.accelerator.vendor == "cpu" else "auto"
        return ServerLaunch(engine="transformers", port=port, model_id=model_dir, returns_logprobs=False,
                            argv=("transformers", "serve", model_dir, "--host", host, "--port", str(port),
                                  "--dtype", dtype, "--device", device, "--log-level", "info"))
    if engine == "vllm":
        return ServerLaunch(engine="vllm", port=port, model_id=SERVED_NAME, returns_logprobs=True,
                            request_extra={"ignore_eos": True, "return_tokens_as_token_ids": True},
                            argv=("vllm", "serve", model_dir, "--host", host, "--port", str(port), "--dtype", dtype,
                                  "--served-model-name", SERVED_NAME, "--seed", "0", "--max-logprobs", "20",
                                  "--disable-log-requests"))
    if engine == "sglang":
        return ServerLaunch(engine="sglang", port=port, model_id=SERVED_NAME, returns_logprobs=True,
                            request_extra={"ignore_eos": True},
                            argv=("python3", "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host,
                                  "--port", str(port), "--dtype", dtype, "--served-model-name", SERVED_NAME,
                                  "--random-seed", "0"))
    return None
