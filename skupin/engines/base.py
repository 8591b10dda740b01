"""What every inference engine declares: the InferenceEngine protocol, its distributions and its server launch.

An engine is one module of this package (skupin/engines/vllm.py, ...) that satisfies ``InferenceEngine``
(PEP 544: a module implements a protocol with its constants and functions, as cibuildwheel's
platform modules do) and one line in ``skupin/engines/__init__.py: ALL_ENGINES``. Nothing here imports
the build or the gate side: they read the registry, not the other way round. Plain frozen
dataclasses, no pydantic: the command line reads the registry (`--engine` choices) at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

MODEL_MOUNT: Final = "/model"
SERVE_PORT: Final = 8000
SERVED_NAME: Final = "skupin-model"
# A minimum output length above any max_tokens a request asks for: an engine without `ignore_eos` is told to never end a
# completion on EOS, so an honest server always streams the max_tokens asked for (the runtime A/B counts what was
# streamed and names a side that streams less as under-generating: skupin/ab/decision.py).
NEVER_EOS: Final = 1 << 20

# What a probe adapter (skupin/imagetools/probe/skupin_probe_<engine>.py) can return besides the teacher-forced top-k logprobs:
# final hidden states, full-vocabulary logprobs.
Output = Literal["hidden", "logprobs_full"]
# How an adapter's module ops get their inputs: the spec's seeded ones fed to each module, or captured from the engine's
# own forward of seeded token ids, each module's input beside its outputs (skupin_probe_ops.py CAPTURE_POSITIONS).
ModuleInputs = Literal["seeded", "captured"]


@dataclass(frozen=True, kw_only=True)
class Distribution:
    """A Python distribution an engine is installed as, and where its engine -> torch rows come from."""

    name: str  # its name on the index (stack.engine.package when it is not the engine's name)
    # First release whose engine_torch row `skupin compat refresh` derives from the wheel's Requires-Dist;
    # None: the engine's rows in builder/data/compat.yaml are kept by hand.
    refresh_since: str | None


@dataclass(frozen=True, kw_only=True)
class ServerLaunch:
    """How one engine's OpenAI-compatible server is started, addressed and asked."""

    engine: str  # its name in engines.ALL_ENGINES
    argv: tuple[str, ...]  # the production launch command, entrypoint first
    port: int
    model_id: str  # the `model` field requests must name
    health_path: str  # answers 200 once the server is ready (then /v1/models is asked)
    returns_logprobs: bool  # whether the engine honours `logprobs` on /v1/completions
    prompt: Literal["ids", "text"]  # what a reference prompt is sent as: its token ids, or its text
    request_extra: dict[str, Any] = field(default_factory=dict)  # engine-specific request fields


class InferenceEngine(Protocol):
    """What one engine module declares (read-only module constants and one function)."""

    @property
    def NAME(self) -> str:
        """The name manifests give as stack.engine.name (and the key in ALL_ENGINES)."""
        ...

    @property
    def DISTRIBUTIONS(self) -> tuple[Distribution, ...]:
        """The distributions it is installed as; the first is its usual one (its own name but for llama.cpp), others
        need stack.engine.package."""
        ...

    @property
    def PROBE_ADAPTER(self) -> str:
        """The name of its adapter in skupin/imagetools/probe/skupin_probe.py (ADAPTERS), which imports nothing of skupin."""
        ...

    @property
    def OUTPUTS(self) -> frozenset[Output]:
        """What its probe adapter returns besides top-k logprobs: a candidate missing one fails the model check."""
        ...

    @property
    def OPS(self) -> frozenset[str]:
        """The op battery's ops (skupin/imagetools/probe/skupin_probe_ops.py OPS) its probe adapter reaches on a dense
        decoder, at the serving dtype and at float32: the gate fails a candidate that does not return one (an image
        cannot evade the battery by calling an op unreachable). MOE_OPS are added for a mixture-of-experts model."""
        ...

    @property
    def MOE_OPS(self) -> frozenset[str]:
        """The op battery's ops its adapter also reaches on a mixture-of-experts model."""
        ...

    @property
    def MODULES(self) -> bool:
        """Whether its probe adapter reaches the modules of the model it loaded (the module ops: each layer's norms,
        attention, router, experts and the whole block with the model's own weights, gates/judge/modules.py): the gate
        then fails a candidate that does not return every one of them."""
        ...

    @property
    def MODULE_INPUTS(self) -> ModuleInputs:
        """How its module ops get their inputs: "seeded" (fed the spec's inputs at the serving dtype and at float32) or
        "captured" (its own forward's, at the serving dtype only: the host recomputes each module from the input the
        engine gave it). The host reads this declaration, never the probe's report, to decide which it judges."""
        ...

    @property
    def FLOAT32(self) -> bool:
        """Whether the gate's float32 pass runs it at float32 on a SKU that serves another dtype (the same image, the
        fixture at float32, judged against the float32 bundle): a kernel wrong by 1% hides under bf16 rounding."""
        ...

    def model_file(self, *, dtype: str, weights: str) -> str | None:
        """The file inside the model folder its server and probe adapter load for gate dtype `dtype` and gate.weights
        `weights` (a GGUF: model-f32.gguf, ...), None for the folder itself; ValueError for weights it cannot serve."""
        ...

    def server(self, *, dtype: str, vendor: str, port: int, model_dir: str, host: str,
               distribution: str, weights: str = "full") -> ServerLaunch:
        """Its OpenAI-compatible server serving `model_dir` on host:port, as installed from `distribution` (one of
        DISTRIBUTIONS), with gate.weights `weights`: the image's CMD and the gate's serve check."""
        ...


def folder_model_file(engine: str) -> Callable[..., str | None]:
    """`model_file` of an engine that loads the model folder itself (the fixture's safetensors, at the gate dtype):
    None for full-precision weights, ValueError for any quantized file type."""

    def model_file(*, dtype: str, weights: str) -> str | None:
        if weights != "full":
            raise ValueError(f"{engine} serves the model folder at full precision only (gate.weights full, "
                             f"not {weights!r})")
        return None

    return model_file


# ---------------------------------------------------------------- what the registry reads of a SKU
# Named by shape, so that skupin/engines/ imports nothing of builder/ (builder.catalog.manifest.SkuManifest satisfies it).


class _Named(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def distribution(self) -> str: ...


class _Stack(Protocol):
    @property
    def engine(self) -> _Named: ...


class _Accelerator(Protocol):
    @property
    def vendor(self) -> str: ...


class _GateSettings(Protocol):
    @property
    def dtype(self) -> str: ...

    @property
    def weights(self) -> str: ...


class ServedSku(Protocol):
    """The parts of a SKU manifest a server launch depends on: engine name, accelerator vendor, gate dtype and weights."""

    @property
    def stack(self) -> _Stack: ...

    @property
    def accelerator(self) -> _Accelerator: ...

    @property
    def gate(self) -> _GateSettings: ...
