"""Replay a GitHub Actions workflow on this machine: its jobs in `needs` order, its `run:` steps with bash.

What GitHub does and what the replay does instead (docs/guide-ci-point-releases.md, "Replaying the
workflows here"):

- `${{ }}` expressions: a small evaluator of exactly the subset the workflows use (contexts github, env,
  vars, secrets, inputs, matrix, needs, steps, runner, job, strategy; `fromJSON`, `toJSON`, `success()`,
  `failure()`, `cancelled()`, `always()`; `!`, `==`, `!=`, `&&`, `||`, parentheses, string and number
  literals). Anything else raises ReplayError, so a workflow edit cannot silently pass.
- the matrix: `strategy.matrix` evaluated (a `fromJSON` of a job output, or lists), one leg per entry;
  `fail-fast` is honoured as written (a false one lets every leg run).
- each leg runs in its own fresh workspace; `runs-on` is recorded (the test reads it), not acted on.
- `run:` steps: bash (`bash --noprofile --norc -eo pipefail` for `shell: bash`, `bash -e` otherwise) with
  the env GitHub gives (workflow, job, step `env:`; GITHUB_OUTPUT, GITHUB_ENV, GITHUB_PATH,
  GITHUB_STEP_SUMMARY, RUNNER_TEMP, GITHUB_WORKSPACE, GITHUB_RUN_ID, GITHUB_REPOSITORY_OWNER, CI).
- `uses:` steps, mapped to local equivalents (ACTIONS below): checkout -> the commit's tree exported into the
  workspace; setup-python -> a virtual environment made once per replay, its bin/ first on PATH; cache and
  cache/restore -> a local folder keyed the same way (restore-keys by prefix, saved after a successful job);
  upload/download-artifact -> a local artifact folder; docker/login-action -> nothing (the loopback registry
  needs no login); create-github-app-token -> no token; attest (keyless Sigstore signing) -> the subject
  digest and predicate it would sign checked and kept under attestations/; create-pull-request -> a local
  branch and commit in the source repository. An action not in the table raises ReplayError.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ReplayError(Exception):
    """The workflow uses something the replay does not know: fail loudly."""


# ---------------------------------------------------------------- expressions

_TOKEN = re.compile(r"""\s*(?:
    (?P<str>'(?:[^']|'')*')
  | (?P<num>-?\d+(?:\.\d+)?)
  | (?P<op>==|!=|&&|\|\||<=|>=|[!()\[\],.<>])
  | (?P<name>[A-Za-z_][A-Za-z0-9_-]*)
)""", re.VERBOSE)

CONTEXTS = ("github", "env", "vars", "secrets", "inputs", "matrix", "needs", "steps", "runner", "job", "strategy")


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ReplayError(f"expression {text!r}: cannot read at {text[pos:]!r}")
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


def _to_number(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip()) if value.strip() else 0.0
        except ValueError:
            return math.nan
    return math.nan


def loose_equal(a: Any, b: Any) -> bool:
    """GitHub's `==`: strings case-insensitively, other mixed types as numbers."""
    if isinstance(a, str) and isinstance(b, str):
        return a.casefold() == b.casefold()
    if type(a) is type(b) and not isinstance(a, dict | list):
        return bool(a == b)
    if isinstance(a, dict | list) or isinstance(b, dict | list):
        return a is b
    return _to_number(a) == _to_number(b)


def truthy(value: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value != 0 and not math.isnan(value)
    return value != ""


def to_string(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


class Evaluator:
    """Evaluate one `${{ }}` expression against `context` (a dict per context name) and a job status."""

    def __init__(self, context: dict[str, Any], *, status: str = "success") -> None:
        self.context = context
        self.status = status  # success | failure | cancelled

    def evaluate(self, text: str) -> Any:
        self._toks = _tokens(text)
        self._pos = 0
        value = self._or()
        if self._pos != len(self._toks):
            raise ReplayError(f"expression {text!r}: unexpected {self._toks[self._pos][1]!r}")
        return value

    def _peek(self) -> str | None:
        return self._toks[self._pos][1] if self._pos < len(self._toks) else None

    def _take(self, want: str | None = None) -> tuple[str, str]:
        if self._pos >= len(self._toks):
            raise ReplayError("expression ends early")
        tok = self._toks[self._pos]
        if want is not None and tok[1] != want:
            raise ReplayError(f"expected {want!r}, got {tok[1]!r}")
        self._pos += 1
        return tok

    def _or(self) -> Any:
        left = self._and()
        while self._peek() == "||":
            self._take()
            right = self._and()
            left = left if truthy(left) else right
        return left

    def _and(self) -> Any:
        left = self._cmp()
        while self._peek() == "&&":
            self._take()
            right = self._cmp()
            left = right if truthy(left) else left
        return left

    def _cmp(self) -> Any:
        left = self._unary()
        while self._peek() in ("==", "!="):
            op = self._take()[1]
            right = self._unary()
            left = loose_equal(left, right) if op == "==" else not loose_equal(left, right)
        if self._peek() in ("<", ">", "<=", ">="):
            raise ReplayError(f"operator {self._peek()!r} is not used by the workflows: teach the replay first")
        return left

    def _unary(self) -> Any:
        if self._peek() == "!":
            self._take()
            return not truthy(self._unary())
        return self._primary()

    def _primary(self) -> Any:
        kind, text = self._take()
        if kind == "str":
            value: Any = text[1:-1].replace("''", "'")
        elif kind == "num":
            value = float(text)
        elif text == "(":
            value = self._or()
            self._take(")")
        elif kind == "name" and text in ("true", "false", "null"):
            value = {"true": True, "false": False, "null": None}[text]
        elif kind == "name" and self._peek() == "(":
            value = self._call(text)
        elif kind == "name" and text in CONTEXTS:
            if text not in self.context:
                raise ReplayError(f"context {text!r} is not available here")
            value = self.context[text]
        else:
            raise ReplayError(f"unknown name {text!r} in an expression")
        while self._peek() in (".", "["):
            if self._take()[1] == ".":
                prop = self._take()
                if prop[0] != "name":
                    raise ReplayError(f"bad property {prop[1]!r}")
                key: Any = prop[1]
            else:
                key = self._or()
                self._take("]")
            if isinstance(value, dict):
                value = value.get(key)
            elif isinstance(value, list) and isinstance(key, float) and key.is_integer() and 0 <= key < len(value):
                value = value[int(key)]
            else:
                value = None
        return value

    def _call(self, name: str) -> Any:
        self._take("(")
        args = []
        while self._peek() != ")":
            args.append(self._or())
            if self._peek() == ",":
                self._take()
        self._take(")")
        if name == "fromJSON" and len(args) == 1:
            try:
                return json.loads(to_string(args[0]))
            except ValueError as exc:
                raise ReplayError(f"fromJSON({args[0]!r}): {exc}") from exc
        if name == "toJSON" and len(args) == 1:
            return json.dumps(args[0], indent=2)
        statuses = {"success": self.status == "success", "failure": self.status == "failure",
                    "cancelled": self.status == "cancelled", "always": True}
        if name in statuses and not args:
            return statuses[name]
        raise ReplayError(f"function {name}({len(args)} argument(s)) is not known to the replay")


_EXPR = re.compile(r"\$\{\{((?:(?!\}\}).)*)\}\}", re.DOTALL)  # one expression: no `}}` inside


def interpolate(value: Any, ev: Evaluator) -> Any:
    """A YAML value with its `${{ }}`s evaluated: a lone expression keeps its type, text gets strings."""
    if isinstance(value, dict):
        return {k: interpolate(v, ev) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, ev) for v in value]
    if not isinstance(value, str):
        return value
    whole = _EXPR.fullmatch(value.strip())
    if whole:
        return ev.evaluate(whole.group(1))
    return _EXPR.sub(lambda m: to_string(ev.evaluate(m.group(1))), value)


def condition(text: Any, ev: Evaluator) -> bool:
    """A job's or step's `if:` (bare or wrapped); without a status function it also needs success()."""
    if text is None:
        return ev.status == "success"
    if isinstance(text, bool):
        return text and ev.status == "success"
    raw = str(text).strip()
    whole = _EXPR.fullmatch(raw)
    inner = whole.group(1) if whole else raw
    value = truthy(ev.evaluate(inner))
    if not re.search(r"\b(success|failure|cancelled|always)\s*\(", inner):
        value = value and ev.status == "success"
    return value


# ---------------------------------------------------------------- files GitHub gives a step


def read_kv_file(path: Path) -> dict[str, str]:
    """GITHUB_OUTPUT / GITHUB_ENV: `k=v` lines and `k<<DELIM` ... `DELIM` blocks."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            key, delim = line.split("<<", 1)
            body = []
            i += 1
            while i < len(lines) and lines[i] != delim:
                body.append(lines[i])
                i += 1
            out[key] = "\n".join(body)
        elif "=" in line:
            key, val = line.split("=", 1)
            out[key] = val
        elif line.strip():
            raise ReplayError(f"{path.name}: cannot read line {line!r}")
        i += 1
    return out


# ---------------------------------------------------------------- the replay


@dataclass
class Leg:
    """One run of one job (one matrix entry)."""

    job: str
    matrix: dict
    runs_on: Any
    status: str = "success"
    steps: list[tuple[str, str]] = field(default_factory=list)  # (name, outcome)
    step_seconds: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    summary: str = ""
    workspace: Path | None = None
    seconds: float = 0.0


@dataclass
class Replay:
    """Everything a workflow replay needs from the test: where the code is and what GitHub would provide."""

    source: Path  # a git repository: checkout exports `commit` from it; create-pull-request commits to it
    commit: str
    root: Path  # the replay's own folder: workspaces, artifacts, cache, temp
    python_bin: Path  # bin/ of the virtual environment setup-python stands for
    event: str = "workflow_dispatch"
    inputs: dict[str, str] = field(default_factory=dict)
    vars: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # the runner's own environment additions
    owner: str = "Skupin-Org"
    run_id: str = "4242"
    cache_dir: Path | None = None  # actions/cache's store (default: root/cache)
    legs: list[Leg] = field(default_factory=list)
    log: Callable[[str], None] = print

    def run(self, workflow: Path) -> list[Leg]:
        data = yaml.safe_load(workflow.read_text(encoding="utf-8"))
        on = data.get(True, data.get("on"))
        if self.event not in (on or {}):
            raise ReplayError(f"{workflow.name} is not triggered by {self.event}")
        jobs: dict[str, dict] = data["jobs"]
        self._defaults_shell = (data.get("defaults") or {}).get("run", {}).get("shell")
        results: dict[str, dict] = {}
        for name in _order(jobs):
            spec = jobs[name]
            needs = _needs(spec)
            needs_ctx = {n: results[n] for n in needs}
            upstream_ok = all(results[n]["result"] == "success" for n in needs)
            base_ctx = self._context(workflow_env=data.get("env") or {}, needs=needs_ctx)
            ev = Evaluator(base_ctx, status="success" if upstream_ok else "failure")
            if not condition(spec.get("if"), ev):
                results[name] = {"result": "skipped", "outputs": {}}
                self.log(f"[{workflow.name}] {name}: skipped")
                continue
            legs = self._matrix(spec, ev)
            finished = [self._run_leg(workflow, name, spec, entry, base_ctx) for entry in legs]
            outputs: dict[str, str] = {}
            for leg in finished:
                outputs.update({k: v for k, v in leg.outputs.items() if v != ""})
            ok = all(leg.status == "success" for leg in finished)
            results[name] = {"result": "success" if ok else "failure", "outputs": outputs}
        return self.legs

    # ------------------------------------------------------------ one job

    def _context(self, *, workflow_env: dict, needs: dict) -> dict[str, Any]:
        github = {"event_name": self.event, "repository_owner": self.owner, "repository": f"{self.owner}/skupin",
                  "run_id": self.run_id, "ref": "refs/heads/main", "sha": self.commit, "actor": "replay",
                  "server_url": "https://github.com", "workspace": ""}
        ctx: dict[str, Any] = {"github": github, "vars": dict(self.vars), "secrets": dict(self.secrets),
                               "inputs": dict(self.inputs), "needs": needs, "env": {}, "runner": {"temp": "", "os": "Linux"},
                               "matrix": {}, "steps": {}, "job": {}, "strategy": {}}
        env = {k: to_string(interpolate(v, Evaluator(ctx))) for k, v in workflow_env.items()}
        ctx["env"] = env
        return ctx

    def _matrix(self, spec: dict, ev: Evaluator) -> list[dict]:
        strategy = spec.get("strategy") or {}
        if "matrix" not in strategy:
            return [{}]
        matrix = interpolate(strategy["matrix"], ev)
        if not isinstance(matrix, dict):
            raise ReplayError(f"strategy.matrix is {matrix!r}, not a mapping")
        include = matrix.pop("include", []) or []
        if matrix.pop("exclude", None):
            raise ReplayError("strategy.matrix.exclude is not used by the workflows: teach the replay first")
        dims = {k: v for k, v in matrix.items()}
        for key, values in dims.items():
            if not isinstance(values, list):
                raise ReplayError(f"strategy.matrix.{key} is not a list")
        legs = [dict(zip(dims, combo, strict=True)) for combo in itertools.product(*dims.values())] if dims else []
        legs += [dict(e) for e in include]
        if not legs:
            raise ReplayError("the matrix has no legs (GitHub fails such a job)")
        if strategy.get("fail-fast", True) is not False and len(legs) > 1:
            raise ReplayError("a matrix without `fail-fast: false`: one SKU's failure would cancel the others")
        return legs

    def _run_leg(self, workflow: Path, name: str, spec: dict, entry: dict, base_ctx: dict) -> Leg:
        started = time.monotonic()
        label = f"{name}({entry.get('sku', ','.join(map(str, entry.values())))})" if entry else name
        slot = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
        workspace = self.root / "work" / slot
        temp = self.root / "temp" / slot
        for folder in (workspace, temp):
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
        files = {k: temp / f"_{k}" for k in ("output", "env", "path", "summary")}
        ctx = {**base_ctx, "matrix": entry, "steps": {}, "env": dict(base_ctx["env"]),
               "runner": {"temp": str(temp), "os": "Linux"}}
        ctx["github"] = {**ctx["github"], "workspace": str(workspace)}
        ev = Evaluator(ctx)
        runs_on = interpolate(spec.get("runs-on"), ev)
        leg = Leg(job=name, matrix=entry, runs_on=runs_on, workspace=workspace)
        ctx["env"].update({k: to_string(v) for k, v in interpolate(spec.get("env") or {}, ev).items()})
        extra_path: list[str] = []
        caches: list[tuple[str, Path]] = []  # (key, path) to save after a successful job
        timeout = 60 * float(spec.get("timeout-minutes", 360))
        self.log(f"[{workflow.name}] {label} on {runs_on}")
        for i, step in enumerate(spec.get("steps") or []):
            step_name = step.get("name") or step.get("uses") or f"step {i}"
            ev = Evaluator(ctx, status=leg.status)
            if not condition(step.get("if"), ev):
                leg.steps.append((step_name, "skipped"))
                continue
            step_started = time.monotonic()
            for f in files.values():
                f.write_text("")
            step_env = {k: to_string(v) for k, v in interpolate(step.get("env") or {}, ev).items()}
            env = {**os.environ, **self.env, **ctx["env"], **step_env,
                   "CI": "true", "GITHUB_ACTIONS": "true", "GITHUB_WORKSPACE": str(workspace),
                   "GITHUB_OUTPUT": str(files["output"]), "GITHUB_ENV": str(files["env"]),
                   "GITHUB_PATH": str(files["path"]), "GITHUB_STEP_SUMMARY": str(files["summary"]),
                   "RUNNER_TEMP": str(temp), "GITHUB_RUN_ID": self.run_id, "GITHUB_REPOSITORY_OWNER": self.owner,
                   "GITHUB_REPOSITORY": f"{self.owner}/skupin", "GITHUB_EVENT_NAME": self.event}
            env["PATH"] = os.pathsep.join([*reversed(extra_path), env.get("PATH", "")])
            try:
                if "run" in step:
                    script = interpolate(step["run"], ev)
                    outcome = self._bash(script, env=env, cwd=workspace / step.get("working-directory", ""),
                                         shell=step.get("shell") or self._defaults_shell,
                                         timeout=max(1.0, timeout - (time.monotonic() - started)), what=f"{label}: {step_name}")
                elif "uses" in step:
                    outcome = self._uses(step, interpolate(step.get("with") or {}, ev), workspace=workspace,
                                         extra_path=extra_path, caches=caches, files=files, env=env)
                else:
                    raise ReplayError(f"{label}: step {step_name!r} has neither run nor uses")
            except subprocess.TimeoutExpired:
                outcome = "failure"
            outputs = read_kv_file(files["output"])
            ctx["env"].update(read_kv_file(files["env"]))
            extra_path += [p for p in files["path"].read_text().splitlines() if p.strip()]
            leg.summary += files["summary"].read_text()
            if step.get("id"):
                ctx["steps"][step["id"]] = {"outputs": outputs, "outcome": outcome, "conclusion": outcome}
            leg.steps.append((step_name, outcome))
            leg.step_seconds[step_name] = time.monotonic() - step_started
            if outcome != "success" and not step.get("continue-on-error"):
                leg.status = "failure"
        if leg.status == "success":
            for key, path in caches:
                dest = (self.cache_dir or self.root / "cache") / key
                if not dest.exists() and path.exists():
                    shutil.copytree(path, dest, symlinks=True)
        ev = Evaluator(ctx, status=leg.status)
        leg.outputs = {k: to_string(interpolate(v, ev)) for k, v in (spec.get("outputs") or {}).items()}
        leg.seconds = time.monotonic() - started
        self.log(f"[{workflow.name}] {label}: {leg.status} in {leg.seconds:.0f} s")
        self.legs.append(leg)
        return leg

    def _bash(self, script: str, *, env: dict, cwd: Path, shell: str | None, timeout: float, what: str) -> str:
        if shell not in (None, "bash"):
            raise ReplayError(f"{what}: shell {shell!r} is not known to the replay")
        flags = ["--noprofile", "--norc", "-eo", "pipefail"] if shell == "bash" else ["-e"]
        result = subprocess.run(["bash", *flags, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                                timeout=timeout, check=False)
        self.log(f"  $ {what}: exit {result.returncode}")
        if result.returncode != 0:
            self.log(("  stdout: " + result.stdout[-3000:] + "\n  stderr: " + result.stderr[-6000:]).rstrip())
        return "success" if result.returncode == 0 else "failure"

    # ------------------------------------------------------------ actions, mapped

    def _uses(self, step: dict, with_: dict, *, workspace: Path, extra_path: list[str], caches: list[tuple[str, Path]],
              files: dict[str, Path], env: dict) -> str:
        action = str(step["uses"]).split("@", 1)[0]
        handler = ACTIONS.get(action)
        if handler is None:
            raise ReplayError(f"action {action} has no local equivalent in the replay (tests/workflow_replay.py)")
        return handler(self, with_, workspace=workspace, extra_path=extra_path, caches=caches, files=files, env=env)

    def checkout(self, with_: dict, *, workspace: Path, **_: Any) -> str:
        archive = subprocess.run(["git", "-C", str(self.source), "archive", self.commit], capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", str(workspace)], input=archive.stdout, check=True)
        return "success"

    def setup_python(self, with_: dict, *, extra_path: list[str], **_: Any) -> str:
        extra_path.append(str(self.python_bin))
        return "success"

    def cache(self, with_: dict, *, workspace: Path, caches: list[tuple[str, Path]], files: dict[str, Path],
              save: bool = True, **_: Any) -> str:
        path = Path(os.path.expanduser(str(with_["path"]).strip()))
        path = path if path.is_absolute() else workspace / path
        key = str(with_["key"])
        store = self.cache_dir or self.root / "cache"
        store.mkdir(parents=True, exist_ok=True)
        hit = store / key if (store / key).is_dir() else None
        if hit is None:
            for prefix in str(with_.get("restore-keys") or "").split():
                found = sorted((p for p in store.glob("*") if p.name.startswith(prefix)), key=lambda p: p.stat().st_mtime)
                if found:
                    hit = found[-1]
                    break
        if hit is not None:
            if path.exists():
                shutil.rmtree(path)
            shutil.copytree(hit, path, symlinks=True)
        with open(files["output"], "a", encoding="utf-8") as out:
            out.write(f"cache-hit={'true' if hit is not None and hit.name == key else 'false'}\n")
        if save:
            caches.append((key, path))
        return "success"

    def cache_restore(self, with_: dict, **kw: Any) -> str:
        return self.cache(with_, save=False, **kw)

    def upload_artifact(self, with_: dict, *, workspace: Path, **_: Any) -> str:
        dest = self.root / "artifacts" / str(with_["name"])
        if dest.exists():
            raise ReplayError(f"artifact {with_['name']} uploaded twice")
        dest.mkdir(parents=True)
        for line in str(with_["path"]).split("\n"):
            rel = line.strip().rstrip("/")
            if not rel:
                continue
            src = workspace / rel
            if src.is_dir():
                shutil.copytree(src, dest / rel, symlinks=True)
            elif src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
        if not any(dest.iterdir()):
            return "failure"  # if-no-files-found: warn in GitHub; here an empty artifact is a failed upload
        return "success"

    def download_artifact(self, with_: dict, *, workspace: Path, **_: Any) -> str:
        src = self.root / "artifacts" / str(with_["name"])
        if not src.is_dir():
            self.log(f"  download-artifact: no artifact {with_['name']}")
            return "failure"
        shutil.copytree(src, workspace, dirs_exist_ok=True, symlinks=True)
        return "success"

    def no_op(self, with_: dict, **_: Any) -> str:
        return "success"

    def attest(self, with_: dict, *, workspace: Path, **_: Any) -> str:
        """Keyless signing needs GitHub's OIDC token and the public Sigstore: instead, check what the step would
        sign (a digest subject, a JSON predicate of the stated type's shape) and keep it under attestations/."""
        digest = str(with_.get("subject-digest") or "")
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise ReplayError(f"actions/attest: subject-digest {digest!r} is not a sha256 digest")
        if not with_.get("subject-name") or not with_.get("predicate-type") or not with_.get("predicate-path"):
            raise ReplayError("actions/attest: subject-name, predicate-type and predicate-path are all needed")
        try:
            predicate = json.loads((workspace / str(with_["predicate-path"])).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ReplayError(f"actions/attest: cannot read {with_['predicate-path']}: {exc}") from exc
        if not isinstance(predicate, dict) or not predicate.get("sku"):
            raise ReplayError(f"actions/attest: {with_['predicate-path']} is not a verification predicate")
        out = self.root / "attestations"
        out.mkdir(exist_ok=True)
        record = {"subject": f"{with_.get('subject-name')}@{digest}", "predicate_type": with_.get("predicate-type"),
                  "predicate": predicate, "push_to_registry": with_.get("push-to-registry")}
        (out / f"{digest.split(':', 1)[1]}.json").write_text(json.dumps(record, sort_keys=True), encoding="utf-8")
        return "success"

    def create_pull_request(self, with_: dict, *, workspace: Path, **_: Any) -> str:
        branch = str(with_["branch"])
        git = ["git", "-C", str(self.source)]
        changed = []
        for line in str(with_.get("add-paths") or "").split("\n"):
            rel = line.strip()
            if rel and (workspace / rel).is_file():
                if not (self.source / rel).is_file() or (self.source / rel).read_bytes() != (workspace / rel).read_bytes():
                    changed.append(rel)
        if not changed:
            return "success"  # create-pull-request makes no pull request when nothing changed
        subprocess.run([*git, "checkout", "-q", "-B", branch, self.commit], check=True)
        for rel in changed:
            shutil.copy2(workspace / rel, self.source / rel)
        subprocess.run([*git, "add", *changed], check=True)
        subprocess.run([*git, "-c", "user.name=replay", "-c", "user.email=replay@localhost", "commit", "-q", "-m",
                        str(with_.get("commit-message") or "replay")], check=True)
        (self.root / "pulls").mkdir(exist_ok=True)
        (self.root / "pulls" / re.sub(r"[^A-Za-z0-9_.-]+", "_", branch)).write_text(
            json.dumps({"branch": branch, "title": with_.get("title"), "files": changed, "token": bool(with_.get("token"))}))
        subprocess.run([*git, "checkout", "-q", "--detach", self.commit], check=True)
        return "success"


ACTIONS: dict[str, Callable[..., str]] = {
    "actions/checkout": Replay.checkout,
    "actions/setup-python": Replay.setup_python,
    "actions/cache": Replay.cache,
    "actions/cache/restore": Replay.cache_restore,
    "actions/upload-artifact": Replay.upload_artifact,
    "actions/download-artifact": Replay.download_artifact,
    "docker/login-action": Replay.no_op,
    "actions/create-github-app-token": Replay.no_op,
    "actions/attest": Replay.attest,
    "peter-evans/create-pull-request": Replay.create_pull_request,
}


def _needs(spec: dict) -> list[str]:
    needs = spec.get("needs") or []
    return [needs] if isinstance(needs, str) else list(needs)


def _order(jobs: dict[str, dict]) -> list[str]:
    """Jobs in `needs` order (a job after everything it needs; ties in file order)."""
    done: list[str] = []
    pending = list(jobs)
    while pending:
        ready = [j for j in pending if all(n in done for n in _needs(jobs[j]))]
        if not ready:
            raise ReplayError(f"jobs {pending} need each other or a job that does not exist")
        done.append(ready[0])
        pending.remove(ready[0])
    return done
