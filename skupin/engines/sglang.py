"""SGLang: `python -m sglang.launch_server` with logprobs and token ids, and the probe's SGLang adapter (full logprobs,
hidden states)."""

from __future__ import annotations

from typing import Final

from skupin.engines.base import SERVED_NAME, Distribution, Output, ServerLaunch, folder_model_file

NAME: Final = "sglang"
DISTRIBUTIONS: Final = (Distribution(name="sglang", refresh_since="0.5.19"),)
PROBE_ADAPTER: Final = "sglang"
# hidden: final hidden states of the teacher-forced pass (Engine.generate(return_hidden_states=True) on an engine
# started with return_hidden_states_mode="full"), see skupin/imagetools/probe/skupin_probe_sglang.py
OUTPUTS: Final[frozenset[Output]] = frozenset({"hidden", "logprobs_full"})
# Its default CUDA attention backends (FlashInfer, FA3) take bf16/fp16 only; a float32 run was never verified here.
FLOAT32: Final = False
# its adapter's ops are offered only where they run outside an engine (not yet run on a GPU with SGLang): none required
OPS: Final[frozenset[str]] = frozenset()
MOE_OPS: Final[frozenset[str]] = frozenset()
# the module ops: its adapter does not reach the modules of the model it loaded (they live in its engine)
MODULES: Final = False
MODULE_INPUTS: Final = "seeded"

# Checked against the sglang 0.5.23 wheel (the version skus/nvidia-h200-sglang.yaml pins), no SGLang installed:
# - `python -m sglang.launch_server` is still a supported entrypoint (sglang/launch_server.py; it warns that
#   `sglang serve` is recommended, which first probes whether the model is a diffusion model).
# - Every flag below exists: ServerArgs' CLI is generated from the fields of sglang/srt/arg_groups/fields/*.py
#   (arg_utils.add_cli_args_from_dataclass, `--` + the field name with dashes): model.py model_path
#   (--model-path, alias --model), dtype (choices auto, half, float16, bfloat16, float, float32); serving.py
#   host, port, served_model_name; device.py random_seed.
# - GET /health answers 503 while the server is starting and 200 once it is up (srt/entrypoints/http_server.py);
#   GET /v1/models lists --served-model-name.
# - POST /v1/completions (srt/entrypoints/openai/protocol.py CompletionRequest, serving_completions.py) takes a
#   prompt of token ids, honours `logprobs` (top_logprobs_num = logprobs; logprobs.tokens are token *texts*, no
#   return_tokens_as_token_ids) and `ignore_eos`, and with `return_token_ids` every streamed choice carries the
#   ids of its new tokens as `token_ids` (skupin/clients/openai.py reads them). Unknown request fields are ignored.


# the server loads the model folder itself (the fixture's safetensors, at the gate dtype)
model_file: Final = folder_model_file(NAME)


def server(*, dtype: str, vendor: str, port: int, model_dir: str, host: str, distribution: str,
           weights: str = "full") -> ServerLaunch:
    """SGLang's launch_server under a fixed model name and seed, answering with logprobs and token ids."""
    return ServerLaunch(engine=NAME, port=port, model_id=SERVED_NAME, health_path="/health", returns_logprobs=True,
                        prompt="ids", request_extra={"ignore_eos": True, "return_token_ids": True},
                        argv=("python3", "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host,
                              "--port", str(port), "--dtype", dtype, "--served-model-name", SERVED_NAME,
                              "--random-seed", "0"))
