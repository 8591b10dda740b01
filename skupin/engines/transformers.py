"""Hugging Face transformers: `transformers serve`, and the probe's reference adapter (hidden states, full logprobs)."""

from __future__ import annotations

import json
from typing import Final

from skupin.engines.base import NEVER_EOS, Distribution, Output, ServerLaunch, folder_model_file

NAME: Final = "transformers"
# torch is required only through the `serving` extra, which `skupin compat refresh` does not evaluate:
# its engine_torch row is written by hand.
DISTRIBUTIONS: Final = (Distribution(name="transformers", refresh_since=None),)
PROBE_ADAPTER: Final = "transformers"
OUTPUTS: Final[frozenset[Output]] = frozenset({"hidden", "logprobs_full"})
FLOAT32: Final = True
# the model's own modules (skupin_probe_transformers.py: op_battery)
OPS: Final = frozenset({"rmsnorm", "silu_mul", "rope.short", "rope.long", "attention.prefill", "attention.decode",
                        "matmul"})
MOE_OPS: Final = frozenset({"moe.route", "moe.block"})
# the module ops: the modules of the model as it loads it (skupin_probe_transformers.py: module_ops)
MODULES: Final = True
MODULE_INPUTS: Final = "seeded"


# the server loads the model folder itself (the fixture's safetensors, at the gate dtype)
model_file: Final = folder_model_file(NAME)


def server(*, dtype: str, vendor: str, port: int, model_dir: str, host: str, distribution: str,
           weights: str = "full") -> ServerLaunch:
    """`transformers serve` on the model folder, which it also takes as the model id; prompts go as text.

    Its /v1/completions has no `ignore_eos`; it takes a `generation_config` (JSON) whose unset fields generate() fills
    from the model's own generation config: `min_new_tokens` above any max_tokens keeps EOS from ending a completion
    (transformers 5.24 warns, once per prompt length, that the minimum exceeds the maximum; generation stops at max_tokens).
    Run against `transformers serve` 5.24.0 with the lock's fastapi/uvicorn/openai on the tiny-llama fixture: 32 streamed
    pieces for max_tokens 32, and the same greedy text as without the field."""
    device = "cpu" if vendor == "cpu" else "auto"
    return ServerLaunch(engine=NAME, port=port, model_id=model_dir, health_path="/health", returns_logprobs=False,
                        prompt="text", request_extra={"generation_config": json.dumps({"min_new_tokens": NEVER_EOS})},
                        argv=("transformers", "serve", model_dir, "--host", host, "--port", str(port),
                              "--dtype", dtype, "--device", device, "--log-level", "info"))
