"""The inference engines (transformers, vLLM, SGLang, llama.cpp), one module each, and ALL_ENGINES, the registry everyone reads.

Each engine module declares what the rest of skupin needs of it (skupin/engines/base.py: InferenceEngine):
the distributions it is installed as (and where `skupin compat refresh` reads its torch requirement),
the probe adapter that runs it, what that adapter reports (hidden states, full-vocabulary logprobs),
and its OpenAI-compatible server launch. The launch has two users: the Dockerfile's ``CMD``
(builder/render.py), so that ``docker run -v MODEL:/model -p 8000:8000 IMAGE`` serves the model, and
the gate's serve check (gates/serving/serve.py), which boots exactly that command in its sandbox
with the fixture mounted at the same path. The gate therefore runs the image the way production
does: there is no gate-only mount path or command line for a start-up hook to key on (docs/GATE.md,
threat model). Adding an engine: one module here and one line in ALL_ENGINES
(docs/guide-new-accelerator.md, "Adding an engine").
"""

from __future__ import annotations

from typing import Final

from skupin.common.errors import ManifestError
from skupin.engines import llamacpp, sglang, transformers, vllm
from skupin.engines.base import (
    MODEL_MOUNT,
    NEVER_EOS,
    SERVE_PORT,
    SERVED_NAME,
    Distribution,
    InferenceEngine,
    ModuleInputs,
    Output,
    ServedSku,
    ServerLaunch,
)

__all__ = [
    "ALL_ENGINES", "DEFAULT_ENGINE", "MODEL_MOUNT", "NEVER_EOS", "SERVED_NAME", "SERVE_PORT", "Distribution", "InferenceEngine",
    "ModuleInputs", "Output", "ServedSku", "ServerLaunch", "UnknownEngine", "engine_distributions", "engine_float32",
    "engine_module_inputs", "engine_modules", "engine_named", "engine_outputs",
    "model_file", "probe_adapter", "refresh_sources", "serve_launch",
]

ALL_ENGINES: Final[dict[str, InferenceEngine]] = {
    "transformers": transformers,
    "vllm": vllm,
    "sglang": sglang,
    "llamacpp": llamacpp,
}
# The engine whose probe adapter runs when a SKU names no registered engine (stack.engine.name: none),
# and the default of `skupin reference capture --engine`.
DEFAULT_ENGINE: Final = "transformers"


class UnknownEngine(ManifestError):
    """A manifest or a command names an inference engine that is not in ALL_ENGINES."""


def engine_named(name: str) -> InferenceEngine:
    """The registered engine called `name`, or UnknownEngine naming the known ones."""
    engine = ALL_ENGINES.get(name)
    if engine is None:
        raise UnknownEngine(f"unknown inference engine {name!r} (known: {', '.join(ALL_ENGINES)})")
    return engine


def probe_adapter(name: str) -> str:
    """The probe adapter that runs engine `name`; DEFAULT_ENGINE's for a SKU without a registered engine."""
    return ALL_ENGINES.get(name, ALL_ENGINES[DEFAULT_ENGINE]).PROBE_ADAPTER


def engine_outputs(name: str) -> frozenset[Output]:
    """What engine `name`'s probe adapter reports besides top-k logprobs; nothing for an engine not in ALL_ENGINES."""
    engine = ALL_ENGINES.get(name)
    return engine.OUTPUTS if engine is not None else frozenset()


def engine_ops(name: str, *, moe: bool) -> frozenset[str]:
    """The op battery's ops engine `name`'s adapter must return (MOE_OPS too for a mixture-of-experts model); nothing
    for an engine not in ALL_ENGINES."""
    engine = ALL_ENGINES.get(name)
    if engine is None:
        return frozenset()
    return engine.OPS | (engine.MOE_OPS if moe else frozenset())


def engine_modules(name: str) -> bool:
    """Whether engine `name`'s adapter reaches the modules of the model it loaded (the module ops); False for an engine
    not in ALL_ENGINES."""
    engine = ALL_ENGINES.get(name)
    return bool(engine is not None and engine.MODULES)


def engine_module_inputs(name: str) -> ModuleInputs:
    """How engine `name`'s module ops get their inputs (seeded, or captured from its own forward); seeded for an
    engine not in ALL_ENGINES."""
    engine = ALL_ENGINES.get(name)
    return engine.MODULE_INPUTS if engine is not None else "seeded"


def engine_float32(name: str) -> bool:
    """Whether the gate's float32 pass runs engine `name` (DEFAULT_ENGINE's answer for an unregistered engine, whose
    probe runs through DEFAULT_ENGINE's adapter)."""
    return ALL_ENGINES.get(name, ALL_ENGINES[DEFAULT_ENGINE]).FLOAT32


def engine_distributions() -> tuple[str, ...]:
    """Every distribution name any engine is installed as, in registry order."""
    return tuple(d.name for engine in ALL_ENGINES.values() for d in engine.DISTRIBUTIONS)


def refresh_sources() -> tuple[tuple[str, str], ...]:
    """(distribution, first release) of every engine distribution whose engine_torch rows refresh derives."""
    return tuple((d.name, d.refresh_since) for engine in ALL_ENGINES.values() for d in engine.DISTRIBUTIONS
                 if d.refresh_since is not None)


def serve_launch(*, manifest: ServedSku, port: int = SERVE_PORT, model_dir: str = MODEL_MOUNT,
                 host: str = "0.0.0.0") -> ServerLaunch | None:  # the container's own interfaces
    """The SKU's engine server command serving `model_dir` on host:port; None for an engine not in ALL_ENGINES."""
    engine = ALL_ENGINES.get(manifest.stack.engine.name)
    if engine is None:
        return None
    return engine.server(dtype=manifest.gate.dtype, vendor=manifest.accelerator.vendor, port=port,
                         model_dir=model_dir, host=host, distribution=manifest.stack.engine.distribution,
                         weights=manifest.gate.weights)


def model_file(manifest: ServedSku) -> str | None:
    """The file inside the model folder the SKU's engine loads (a GGUF, written by the gate from the fixture), None
    when it loads the fixture folder itself or names no registered engine; ValueError for weights it cannot serve."""
    engine = ALL_ENGINES.get(manifest.stack.engine.name)
    if engine is None:
        return None
    return engine.model_file(dtype=manifest.gate.dtype, weights=manifest.gate.weights)
