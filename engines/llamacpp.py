"""llama.cpp through llama-cpp-python's OpenAI-compatible server (GGUF weights).

PLACEHOLDER of the llama-image branch: registers the engine name so that the SKU
cpu-x86_64-llamacpp passes `skupin check` and renders. The engine module of the llama-host branch
(probe adapter, GGUF conversion, server arguments) replaces this file when the branches merge;
the SKU's lock must then be made again (its render's CMD changes).
"""

from __future__ import annotations

from typing import Final

from engines.base import SERVED_NAME, Distribution, Output, ServerLaunch

NAME: Final = "llamacpp"
# tests/unit/test_engines.py: no probe adapter of its own yet, and its distribution is not named after the engine
PLACEHOLDER: Final = True
# No Linux wheel on PyPI: SKUs build it from its sdist (stack.engine.source kind sdist); its rows in
# builder/data/compat.yaml are kept by hand.
DISTRIBUTIONS: Final = (Distribution(name="llama-cpp-python", refresh_since=None),)
PROBE_ADAPTER: Final = "transformers"  # placeholder: the llama.cpp adapter comes with the llama-host branch
OUTPUTS: Final[frozenset[Output]] = frozenset()
GGUF_FILE: Final = "model-f32.gguf"


def server(*, dtype: str, vendor: str, port: int, model_dir: str, host: str, distribution: str) -> ServerLaunch:
    """`python -m llama_cpp.server` serving the fixture's F32 GGUF under the fixed model name."""
    return ServerLaunch(engine=NAME, port=port, model_id=SERVED_NAME, health_path="/v1/models", returns_logprobs=True,
                        prompt="ids", argv=("python", "-m", "llama_cpp.server", "--model", f"{model_dir}/{GGUF_FILE}",
                                            "--host", host, "--port", str(port), "--model_alias", SERVED_NAME,
                                            "--seed", "0"))
