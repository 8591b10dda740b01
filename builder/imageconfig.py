"""The image config a rendered Dockerfile gives, computed from its text and its base's config, without a daemon.

The gate's `pins` check (gates/integrity/static.py) compares an image's config with this: the
environment as a whole (every variable, PATH included), the working folder, the user, the shell,
the entrypoint and command, the exposed ports, volumes, ONBUILD triggers, stop signal and health
check. The text is skupin's own render (builder/render.py), so this reads only the instructions the
templates write, as BuildKit applies them; anything else it refuses (`DockerfileConfigError`)
rather than guess.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from skupin.common.errors import BuildError
from skupin.common.model import Frozen

# What BuildKit puts in an image's config when its base sets no PATH (dockerfile2llb: "make sure PATH is always set").
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Instructions that change nothing of the config (LABEL is judged apart: the lock label).
_NO_CONFIG = {"RUN", "COPY", "ADD", "LABEL", "MAINTAINER"}


class DockerfileConfigError(BuildError):
    """The rendered Dockerfile holds something whose effect on the image config is not computed here."""


class ImageConfig(Frozen):
    """The parts of an image's config that decide what a container of it runs, and how."""

    env: tuple[tuple[str, str], ...] = ()
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    shell: tuple[str, ...] = ()
    exposed_ports: tuple[str, ...] = ()
    volumes: tuple[str, ...] = ()
    on_build: tuple[str, ...] = ()
    stop_signal: str = ""
    healthcheck: str = ""  # canonical JSON of the engine's Healthcheck, "" for none

    @classmethod
    def from_engine(cls, config: Mapping[str, Any]) -> ImageConfig:
        """The config as the Docker engine reports it (`docker inspect`'s Config; null, "" and [] all mean unset)."""
        env = []
        for item in config.get("Env") or ():  # an entry without "=" sets nothing (the gate names it apart)
            key, sep, value = str(item).partition("=")
            if sep:
                env.append((key, value))
        health = config.get("Healthcheck")
        return cls(
            env=tuple(env), entrypoint=_strings(config.get("Entrypoint")), cmd=_strings(config.get("Cmd")),
            working_dir=str(config.get("WorkingDir") or ""), user=str(config.get("User") or ""),
            shell=_strings(config.get("Shell")), exposed_ports=tuple(sorted(str(p) for p in config.get("ExposedPorts") or {})),
            volumes=tuple(sorted(str(v) for v in config.get("Volumes") or {})), on_build=_strings(config.get("OnBuild")),
            stop_signal=str(config.get("StopSignal") or ""),
            healthcheck=json.dumps(health, sort_keys=True) if health else "",
        )

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def path_dirs(self) -> tuple[str, ...]:
        """The folders of PATH, in order (relative to /, as the file view names them)."""
        value = self.env_dict().get("PATH", "")
        return tuple(d.strip("/") for d in value.split(":") if d.startswith("/"))


def _strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


# ---------------------------------------------------------------- the Dockerfile's text


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) of a Dockerfile: continuation lines joined, comment lines dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and current):
            continue  # comment lines, and blank lines inside a continuation, are dropped as BuildKit does
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1]
            continue
        current += line
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    if current.strip():
        raise DockerfileConfigError("the Dockerfile ends inside a continued line")
    return out


def _split_words(raw: str) -> list[str]:
    """Split on whitespace outside quotes and escapes; the words keep their quotes (expanded later)."""
    words: list[str] = []
    word, quote, i = "", "", 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\\" and quote != "'" and i + 1 < len(raw):
            word += raw[i:i + 2]
            i += 2
            continue
        if quote:
            quote = "" if ch == quote else quote
            word += ch
        elif ch in "'\"":
            quote = ch
            word += ch
        elif ch.isspace():
            if word:
                words.append(word)
            word = ""
        else:
            word += ch
        i += 1
    if quote:
        raise DockerfileConfigError(f"unbalanced quote in {raw[:80]!r}")
    if word:
        words.append(word)
    return words


class _Expander:
    """BuildKit's word processing: quotes, backslash escapes and $VAR / ${VAR} / ${VAR:-x} / ${VAR:+x}."""

    def __init__(self, env: Mapping[str, str], args: set[str]) -> None:
        self.env, self.args = env, args

    def word(self, raw: str) -> str:
        out, i = [], 0
        while i < len(raw):
            ch = raw[i]
            if ch == "\\":
                if i + 1 < len(raw):
                    out.append(raw[i + 1])
                i += 2
            elif ch == "'":
                end = raw.index("'", i + 1)
                out.append(raw[i + 1:end])
                i = end + 1
            elif ch == '"':
                i = self._double(raw, i + 1, out)
            elif ch == "$":
                i = self._dollar(raw, i, out)
            else:
                out.append(ch)
                i += 1
        return "".join(out)

    def _double(self, raw: str, i: int, out: list[str]) -> int:
        while i < len(raw) and raw[i] != '"':
            ch = raw[i]
            if ch == "\\" and i + 1 < len(raw) and raw[i + 1] in '"$\\':
                out.append(raw[i + 1])
                i += 2
            elif ch == "$":
                i = self._dollar(raw, i, out)
            else:
                out.append(ch)
                i += 1
        if i >= len(raw):
            raise DockerfileConfigError(f"unbalanced double quote in {raw[:80]!r}")
        return i + 1

    def _dollar(self, raw: str, i: int, out: list[str]) -> int:
        if raw.startswith("${", i):
            end = raw.find("}", i)
            if end < 0:
                raise DockerfileConfigError(f"unclosed ${{ in {raw[:80]!r}")
            body = raw[i + 2:end]
            name = _NAME.match(body)
            if name is None:
                raise DockerfileConfigError(f"cannot expand ${{{body}}}")
            key, op = name.group(0), body[name.end():]
            value = self._value(key)
            if op == "":
                out.append(value or "")
            elif op.startswith(":-"):
                out.append(value if value else self.word(op[2:]))
            elif op.startswith(":+"):
                out.append(self.word(op[2:]) if value else "")
            else:
                raise DockerfileConfigError(f"cannot expand ${{{body}}}: only ${{X}}, ${{X:-word}} and ${{X:+word}} are read")
            return end + 1
        name = _NAME.match(raw, i + 1)
        if name is None:
            out.append("$")
            return i + 1
        out.append(self._value(name.group(0)) or "")
        return name.end()

    def _value(self, key: str) -> str | None:
        if key in self.env:
            return self.env[key]
        if key in self.args:
            raise DockerfileConfigError(f"${key} is a build argument: its value is not known from the text")
        return None


def _exec_form(rest: str) -> list[str] | None:
    if not rest.startswith("["):
        return None
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


class _State:
    def __init__(self, base: ImageConfig) -> None:
        env = list(base.env)
        if "PATH" not in dict(env):
            env.append(("PATH", DEFAULT_PATH))
        self.env: dict[str, str] = dict(env)
        self.config = base
        self.args: set[str] = set()
        self.cmd_set = False

    def expander(self) -> _Expander:
        return _Expander(self.env, self.args)

    def set(self, **changes: Any) -> None:
        self.config = self.config.model_copy(update=changes)

    def command(self, rest: str) -> tuple[str, ...]:
        argv = _exec_form(rest)
        if argv is not None:
            return tuple(argv)
        return (*(self.config.shell or ("/bin/sh", "-c")), rest)


def final_stage(dockerfile: str) -> list[tuple[str, str]]:
    """The instructions of the stage that makes the image: the global ARGs, then the last FROM and what follows.

    Earlier stages (a source-built engine's build stage) must be named (`FROM ... AS name`), and the
    last FROM may not start from one of them: the image's config then comes from the base alone.
    """
    found = instructions(dockerfile)
    froms = [i for i, (word, _) in enumerate(found) if word == "FROM"]
    if not froms:
        return found
    names: set[str] = set()
    for i in froms[:-1]:
        words = found[i][1].split()
        if len(words) != 3 or words[1].upper() != "AS":
            raise DockerfileConfigError(f"an earlier stage is not named (FROM {found[i][1][:80]}): only the last "
                                        "stage may be unnamed")
        names.add(words[2].lower())
    last = found[froms[-1]][1].split()
    if last and last[0].lower() in names:
        raise DockerfileConfigError(f"the last stage starts from the earlier stage {last[0]}, not from the base")
    head = [(w, r) for w, r in found[:froms[0]]]
    return head + found[froms[-1]:]


def config_of(dockerfile: str, base: ImageConfig) -> ImageConfig:
    """The config BuildKit gives the image of `dockerfile` (its last stage) built FROM a base whose config is `base`."""
    state: _State | None = None
    for word, rest in final_stage(dockerfile):
        if word == "FROM":
            if state is not None:
                raise DockerfileConfigError("more than one FROM in the last stage")
            state = _State(base)
            continue
        if state is None:
            if word != "ARG":
                raise DockerfileConfigError(f"{word} before FROM")
            continue
        _apply(state, word, rest)
    if state is None:
        raise DockerfileConfigError("no FROM")
    env = list(state.env.items())
    return state.config.model_copy(update={"env": tuple(env)})


def labels_of(dockerfile: str, args: Mapping[str, str]) -> dict[str, str]:
    """The labels BuildKit gives the image of `dockerfile` (its last stage, FROM a base with no labels: a bootstrapped
    base) built with the build arguments `args`. An ARG not given takes its default; a global ARG (before the first
    FROM) is seen in the stage only where the stage declares it again; ENV wins over an ARG of the same name."""
    state: _State | None = None
    global_args: dict[str, str] = {}
    values: dict[str, str] = {}
    labels: dict[str, str] = {}
    for word, rest in final_stage(dockerfile):
        if word == "FROM":
            state, values = _State(ImageConfig()), {}
        elif word == "ARG":
            for raw in _split_words(rest):
                name, sep, default = raw.partition("=")
                if state is None:
                    given = _Expander(global_args, set()).word(default) if sep else ""
                    global_args[name] = args.get(name, given)
                else:
                    given = _Expander({**values, **state.env}, set()).word(default) if sep else global_args.get(name, "")
                    values[name] = args.get(name, given)
        elif word == "ENV" and state is not None:
            _env(state, rest)
        elif word == "LABEL" and state is not None:
            expand = _Expander({**values, **state.env}, set())
            for raw in _split_words(rest):
                key, sep, value = raw.partition("=")
                if not sep:
                    raise DockerfileConfigError(f"LABEL {raw[:80]!r}: not key=value")
                labels[expand.word(key)] = expand.word(value)
    return labels


def _apply(state: _State, word: str, rest: str) -> None:  # noqa: C901 - one branch per instruction
    if word in _NO_CONFIG:
        return
    if word == "ARG":
        state.args.update(w.partition("=")[0] for w in _split_words(rest))
    elif word == "ENV":
        _env(state, rest)
    elif word == "WORKDIR":
        folder = state.expander().word(rest)
        state.set(working_dir=posixpath.normpath(posixpath.join("/", state.config.working_dir or "/", folder)))
    elif word == "USER":
        state.set(user=state.expander().word(rest))
    elif word == "SHELL":
        argv = _exec_form(rest)
        if not argv:
            raise DockerfileConfigError(f"SHELL needs the JSON form: {rest[:80]!r}")
        state.set(shell=tuple(argv))
    elif word == "CMD":
        state.set(cmd=state.command(rest))
        state.cmd_set = True
    elif word == "ENTRYPOINT":
        state.set(entrypoint=state.command(rest), **({} if state.cmd_set else {"cmd": ()}))
    elif word == "EXPOSE":
        ports = {p if "/" in p else f"{p}/tcp" for p in (state.expander().word(w) for w in _split_words(rest))}
        state.set(exposed_ports=tuple(sorted({*state.config.exposed_ports, *ports})))
    elif word == "VOLUME":
        found = _exec_form(rest) or [state.expander().word(w) for w in _split_words(rest)]
        state.set(volumes=tuple(sorted({*state.config.volumes, *found})))
    elif word == "STOPSIGNAL":
        state.set(stop_signal=state.expander().word(rest))
    elif word == "ONBUILD":
        state.set(on_build=(*state.config.on_build, rest))
    else:
        raise DockerfileConfigError(f"{word}: its effect on the image config is not computed here")


def _env(state: _State, rest: str) -> None:
    """ENV a=b c="d e" (each value expanded with the environment from before this instruction), or ENV a b c."""
    expand = state.expander()
    words = _split_words(rest)
    if not words:
        raise DockerfileConfigError("ENV without a value")
    if "=" not in words[0]:
        key, _, value = rest.partition(" ")
        pairs = [(key, expand.word(value.strip()))]
    else:
        pairs = []
        for raw in words:
            key, sep, value = raw.partition("=")
            if not sep or not _NAME.fullmatch(key):
                raise DockerfileConfigError(f"ENV {raw[:80]!r}: not NAME=value")
            pairs.append((key, expand.word(value)))
    for key, value in pairs:
        state.env[key] = value


# ---------------------------------------------------------------- what its RUN lines install with apt


_APT_INSTALL = re.compile(r"apt-get\s+install\s+([^&|;]*)")


def apt_installs(dockerfile: str) -> tuple[str, ...]:
    """The Debian packages the RUN lines of the Dockerfile's last stage (the image's) name to `apt-get install`
    (names, without =version); a build stage's packages are not the image's."""
    names: list[str] = []
    for word, rest in final_stage(dockerfile):
        if word != "RUN":
            continue
        for match in _APT_INSTALL.finditer(rest):
            for item in match.group(1).split():
                if not item.startswith("-"):
                    names.append(item.split("=", 1)[0].split(":", 1)[0])
    return tuple(dict.fromkeys(names))
