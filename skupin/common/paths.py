"""Where things live: the catalog a command acts on, the data the package ships, and how a SKU argument becomes a file.

The catalog is the folder holding `skus/` (a platform team's repository, or this one). It is found
as git finds `.git`, in this order, and no other folder is ever acted on:

1. `skupin --root DIR` (`use_root`),
2. the `SKUPIN_ROOT` environment variable,
3. the current directory or the nearest parent holding a `skus/` folder.

Operator commands (verify, pull, inspect) take their trust from the catalog: its `keys/trusted/` and the lock,
bundle and tolerance they compare with. Inside `operator_trust()` a catalog found by walking up (rule 3) counts
only when it and the folders trust is read from are owned by this user or root and not writable by others
(`ownership_problem`); otherwise it is passed over (`passed_over()` says which and why) and the command runs as
if there were no catalog. A catalog named with `--root` or `SKUPIN_ROOT` always counts: someone chose it.

What the tool needs at run time ships inside the package (templates, compatibility data, the
probe and the in-image tools, the default fixtures and reference bundles). A catalog overrides by
holding the same relative path: `templates/` replaces the shipped templates as a whole, and a
manifest's `gate.reference` is read from the catalog when the catalog holds it, else from the
package (`data_path`). Operator commands (verify, pull, inspect) need no catalog; without one,
state lives in `$XDG_CACHE_HOME/skupin` (default `~/.cache/skupin`). `SKUPIN_STATE` overrides both.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from skupin.common.errors import ManifestError

# The `skupin` package folder: site-packages/skupin, or the checkout's skupin/ (whose builder/, gates/ and templates/ link to
# the checkout's top-level folders of those names). A catalog-relative data path ("gates/references/...") resolves under it.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TEMPLATES = PACKAGE_ROOT / "templates"
# Defaults that CLI argument parsers need: kept here (stdlib only) so building the CLI stays light.
PYPI_SIMPLE = "https://pypi.org/simple"
REGISTRY_ADDR = "127.0.0.1:5000"  # the local registry `skupin registry up` runs
ROOT_ENV = "SKUPIN_ROOT"
STATE_ENV = "SKUPIN_STATE"
WHEELHOUSE_ENV = "SKUPIN_WHEELHOUSE"  # every command's --wheelhouse defaults to it (env_wheelhouse)
NO_CATALOG_FIX = "run it inside a catalog (a folder holding skus/, or below one), pass --root DIR, or set SKUPIN_ROOT"

_root: Path | None = None  # set by `skupin --root`
_operator_depth = 0  # > 0 inside operator_trust()
_passed_over: dict[str, str] = {}  # discovered catalogs not trusted, and why
# The folders of a catalog that operator trust is read from (keys, manifests and locks, bundles and tolerances).
TRUST_FOLDERS = ("", "skus", "keys", "keys/trusted", "gates", "gates/data", "gates/references")


def _checked_root(path: Path, source: str) -> Path:
    if not (path / "skus").is_dir():
        raise ManifestError(f"{source} {path}: not a catalog (no skus/ folder in it); fix: {NO_CATALOG_FIX}")
    return path.resolve()


def use_root(path: Path | str | None) -> None:
    """Pin the catalog for this process (`--root`); None goes back to discovery."""
    global _root
    _root = None if path is None else _checked_root(Path(path), "--root")


def find_catalog(start: Path | None = None) -> Path | None:
    """The catalog root by the rule above, or None when there is none (operator commands work without one)."""
    if _root is not None:
        return _root
    env = os.environ.get(ROOT_ENV)
    if env:
        return _checked_root(Path(env), ROOT_ENV)
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "skus").is_dir():
            if _operator_depth and (why := ownership_problem(folder)) is not None:
                _passed_over[str(folder)] = why
                return None  # never go on hunting further up for another one
            return folder
    return None


def _unsafe(path: Path) -> str | None:
    """Why `path` (not followed if a link) cannot carry trust: a link, another user's, or writable by others."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: cannot be examined: {exc.strerror or exc}"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a link"
    if info.st_uid not in (os.getuid(), 0):
        return f"{path} is owned by uid {info.st_uid}, neither you (uid {os.getuid()}) nor root"
    if info.st_mode & stat.S_IWOTH:  # group-writable is a umask-002 checkout's normal state: the owner's group is kin
        return f"{path} can be written by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def ownership_problem(folder: Path) -> str | None:
    """Why the catalog at `folder` cannot be trusted by an operator command it was not named to (None: it can)."""
    for rel in TRUST_FOLDERS:
        if (why := _unsafe(folder / rel if rel else folder)) is not None:
            return why
    return None


def trust_problem(path: Path) -> str | None:
    """Why a trust input found rather than named (a key folder, a key file, the record of what was verified) cannot be
    trusted: a link, another user's, or writable by others. Applies to every command, publish's keys too."""
    return _unsafe(path)


@contextlib.contextmanager
def operator_trust() -> Iterator[None]:
    """While active, a discovered catalog counts only when ownership_problem finds nothing (see the module doc)."""
    global _operator_depth
    _operator_depth += 1
    try:
        yield
    finally:
        _operator_depth -= 1


def passed_over() -> dict[str, str]:
    """Discovered catalogs an operator command did not trust in this process, and why."""
    return dict(_passed_over)


def catalog() -> Path:
    """The catalog root; an error naming the way to give one when there is none."""
    found = find_catalog()
    if found is None:
        raise ManifestError(f"no catalog: no skus/ folder in {Path.cwd()} or any parent; fix: {NO_CATALOG_FIX}")
    return found


def skus_dir() -> Path:
    return catalog() / "skus"


def templates_dir() -> Path:
    """The catalog's templates/ when it has one, else the templates shipped with the package."""
    found = find_catalog()
    if found is not None and (found / "templates").is_dir():
        return found / "templates"
    return SHIPPED_TEMPLATES


def env_wheelhouse() -> Path | None:
    """$SKUPIN_WHEELHOUSE when set and not empty: the default of --wheelhouse in every command that takes it (build,
    gate, lock, render, run, ab, watch; not `matrix`, whose --wheelhouse is a folder the CI runners have)."""
    value = os.environ.get(WHEELHOUSE_ENV)
    return Path(value) if value else None


def state_dir() -> Path:
    """Where builds, locks' wheels, the local registry and keys are kept (git-ignored)."""
    env = os.environ.get(STATE_ENV)
    if env:
        return Path(env)
    found = find_catalog()
    if found is not None:
        return found / ".skupin"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "skupin"


def ensure_state() -> Path:
    """The state folder, made when missing; in a catalog it ignores itself for git (`.gitignore` holding `*`), so a
    private key or a build record under it is never committed from a catalog whose own .gitignore forgot it."""
    state = state_dir()
    state.mkdir(parents=True, exist_ok=True)
    ignore = state / ".gitignore"
    if not ignore.exists() and not ignore.is_symlink():
        ignore.write_text("# made by skupin: nothing in its state folder belongs in git\n*\n", encoding="utf-8")
    return state


def data_path(rel: str | Path) -> Path:
    """A catalog-relative data path (a manifest's gate.reference): the catalog's copy when it holds one, else the package's."""
    found = find_catalog()
    if found is not None and (found / rel).exists():
        return found / rel
    return PACKAGE_ROOT / rel


def manifest_files(paths: list[Path]) -> list[Path]:
    """Expand SKU names, files and folders into manifest files (*.yaml, sorted); none given: the catalog's skus/."""
    found: list[Path] = []
    for path in paths or [skus_dir()]:
        if path.is_dir():
            found += sorted(p for p in path.glob("*.yaml") if p.is_file())
        elif not path.exists() and path.suffix not in (".yaml", ".yml") and os.sep not in str(path):
            found.append(sku_path(str(path)))  # a SKU name
        else:
            found.append(path)
    return found


def sku_path(sku: str) -> Path:
    """A SKU name (the catalog's skus/<name>.yaml) or a path to a manifest."""
    candidate = Path(sku)
    if candidate.suffix in (".yaml", ".yml") or os.sep in sku:
        if not candidate.is_file():
            raise ManifestError(f"{sku}: no such manifest file")
        return candidate
    skus = skus_dir()
    path = skus / f"{sku}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in skus.glob("*.yaml"))
        import difflib

        close = difflib.get_close_matches(sku, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known SKUs: {', '.join(known) or '(none)'}"
        raise ManifestError(f"{sku}: unknown SKU (no {path}); fix: {hint}")
    return path
