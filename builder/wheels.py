"""The host's wheel store: each locked wheel is fetched once, checked against the lock, and linked into build contexts.

A locked build never downloads inside BuildKit. Before the build, `fetch_wheels` makes sure every
wheel of the lock is in the store (`.skupin/wheels/<sha256[:2]>/<sha256>/<filename>`, content-
addressed, so a file there was checked when it was written and is trusted by its path alone):

- a wheel already in the store costs one `stat`;
- a wheel found in the wheelhouse (`--wheelhouse DIR` or $SKUPIN_WHEELHOUSE, by file name) is hashed once and
  hard-linked in (copied across filesystems). A wheel there may be a symbolic link (a wheelhouse of links into a
  pip cache or a shared folder): the wheelhouse is the operator's own folder, so the link is followed and the file it
  names is hashed and stored, never the link itself; a link to anything but a regular file (a FIFO, a device, a
  folder, nothing) is refused. This is how air-gapped builders work: a wheelhouse holding
  every locked file means no network at all. A wheel the lock took from a wheelhouse
  (`source: wheelhouse`) must be there, unless the lock also records its home URL (then it is
  downloaded like any other, and kept only if it hashes to the lock's sha256);
- any other wheel is downloaded from the URL the lock recorded, a few at a time, streamed to a
  temporary file while hashed, and kept only if its sha256 is the lock's.

The extra CA bundle (`--ca-bundle`) is trusted by these downloads; it never enters a build.
The store is shared by every SKU and kept between builds: after a point release only the new
engine wheel is fetched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from skupin.builder.catalog.lockfile import LockedPackage
from skupin.clients.transport import Transport
from skupin.common.errors import BuildError, NetworkError
from skupin.common.paths import state_dir


def wheel_store() -> Path:
    """The host's store of fetched wheels: STATE/wheels."""
    return state_dir() / "wheels"
DEFAULT_JOBS = 4
CHUNK = 1 << 20
OnEvent = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


def store_path(store: Path, pkg: LockedPackage) -> Path:
    """Where the store keeps the exact file a locked package names."""
    return store / pkg.sha256[:2] / pkg.sha256 / pkg.filename


def _stored(path: Path) -> bool:
    """Whether the store holds `path` as a regular file (a link there, such as older versions stored for a linked
    wheelhouse file, is replaced)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def wheelhouse_file(candidate: Path) -> Path:
    """The regular file a wheelhouse entry is, or names through symbolic links (resolved: the path of the file
    itself); BuildError when it is, or leads to, anything else."""
    try:
        real = candidate.resolve(strict=True)
        mode = os.stat(real).st_mode
    except (OSError, RuntimeError) as exc:  # a dangling link, a loop (RuntimeError before Python 3.13)
        raise BuildError(f"{candidate}: a link in the wheelhouse that leads to no file ({exc}); fix: point it at the "
                         "wheel, or remove it") from exc
    if not stat.S_ISREG(mode):
        via = f" (a link to {real})" if real != candidate.absolute() else ""
        raise BuildError(f"{candidate}{via} is not a regular file; fix: put the wheel itself, or a link to it, "
                         "in the wheelhouse")
    return real


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheels(
    packages: Iterable[LockedPackage],
    *,
    store: Path | None = None,
    wheelhouse: Path | None = None,
    ca_bundle: Path | None = None,
    on_event: OnEvent = _quiet,
    jobs: int = DEFAULT_JOBS,
    timeout: float = 60.0,
    retries: int = 3,
    backoff: float = 0.5,
) -> dict[str, Path]:
    """Make sure every package's wheel is in the store; sha256 -> stored file.

    Everything that cannot work (a wheelhouse file missing, a package with no URL) is reported
    together before anything is fetched; a download that fails or does not hash to the lock's
    sha256 raises NetworkError / BuildError and leaves nothing behind in the store.
    """
    store = store or wheel_store()
    unique = list({p.sha256: p for p in packages}.values())
    missing = [p for p in unique if not _stored(store_path(store, p))]
    local: list[tuple[LockedPackage, Path, Path]] = []  # (package, the wheelhouse entry, the file it is or names)
    remote: list[LockedPackage] = []
    problems: list[str] = []
    for pkg in missing:
        candidate = wheelhouse / pkg.filename if wheelhouse is not None else None
        if candidate is not None and os.path.lexists(candidate):
            try:
                local.append((pkg, candidate, wheelhouse_file(candidate)))
            except BuildError as exc:
                problems.append(str(exc))
        elif pkg.source == "wheelhouse" and not pkg.url:
            where = wheelhouse or "(no --wheelhouse given)"
            problems.append(f"{pkg.filename}: locked from a wheelhouse but not in {where}; fix: pass --wheelhouse DIR holding it")
        elif not pkg.url or not pkg.url.startswith(("https://", "http://")):
            problems.append(f"{pkg.filename}: the lock records no download URL ({pkg.url or 'none'}); "
                            "fix: relock, or put the file in a --wheelhouse")
        else:
            remote.append(pkg)
    if problems:
        raise BuildError("cannot gather the locked wheels:\n  " + "\n  ".join(problems))
    on_event(f"wheels: {len(unique)} locked, {len(unique) - len(missing)} in the store {store}"
             + (f", {len(local)} from the wheelhouse" if local else "")
             + (f", {len(remote)} to download" if remote else ""))
    for pkg, entry, path in local:
        _store_local(pkg, path, store, entry=entry)
    if remote:
        _download_all(remote, store=store, ca_bundle=ca_bundle, on_event=on_event, jobs=jobs, timeout=timeout, retries=retries,
                      backoff=backoff)
    return {p.sha256: store_path(store, p) for p in unique}


def _store_local(pkg: LockedPackage, path: Path, store: Path, *, entry: Path) -> None:
    """Link (or copy) the regular file `path` (wheelhouse `entry`, or the file it links to) into the store; what is
    stored is hashed, and kept only with the lock's sha256."""
    shown = str(entry) if path == entry.absolute() else f"{entry} (a link to {path})"
    dest = store_path(store, pkg)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(path, tmp, follow_symlinks=False)  # `path` is the file itself (wheelhouse_file), never a link
        except OSError:
            shutil.copyfile(path, tmp, follow_symlinks=False)
        if not stat.S_ISREG(os.lstat(tmp).st_mode):
            raise BuildError(f"{shown} changed while it was stored: it is no longer a regular file")
        got = file_sha256(tmp)
        if got != pkg.sha256:
            raise BuildError(f"{shown}: sha256 {got}, but the lock says {pkg.sha256} for {pkg.name} {pkg.version}; "
                             "fix: put the locked file in the wheelhouse, or relock against it")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _download_all(pkgs: list[LockedPackage], *, store: Path, ca_bundle: Path | None, on_event: OnEvent, jobs: int,
                  timeout: float, retries: int, backoff: float) -> None:

    http = Transport(timeout=timeout, retries=retries, ca_bundle=ca_bundle, backoff=backoff, sleep=None, what="wheel download")
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(pkgs)))) as pool:
            futures = [pool.submit(_download, http, pkg, store) for pkg in pkgs]
            errors = []
            for pkg, future in zip(pkgs, futures, strict=True):
                try:
                    size, seconds = future.result()
                    on_event(f"fetched {pkg.filename} ({size / 1e6:.1f} MB, {seconds:.1f} s)")
                except (NetworkError, BuildError, OSError) as exc:
                    errors.append(str(exc))
    finally:
        http.close()
    if errors:
        raise NetworkError("could not fetch every locked wheel (nothing was built):\n  " + "\n  ".join(errors))


def _download(http: Transport, pkg: LockedPackage, store: Path) -> tuple[int, float]:
    """Stream one wheel into the store (retried like every request); kept only with the lock's sha256."""
    assert pkg.url is not None
    url = pkg.url.split("#")[0]
    dest = store_path(store, pkg)
    dest.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        tmp, sha, size = http.download(url, dest.parent, prefix=f".{dest.name}.")
    except NetworkError as exc:
        raise NetworkError(f"{pkg.filename}: {exc}") from exc
    try:
        if sha != pkg.sha256:
            from skupin.clients.transport import safe_url as _safe

            raise BuildError(f"{pkg.filename}: downloaded from {_safe(url)} with sha256 {sha}, but the lock says "
                             f"{pkg.sha256}; the index now serves another file: check the mirror, or relock")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return size, time.monotonic() - start


def prune_store(store: Path, *, keep: set[str], dry_run: bool = False) -> tuple[list[Path], int]:
    """Remove every stored wheel whose sha256 is not in `keep` (and stray partial downloads);
    the files removed (or that would be, with `dry_run`) and their bytes."""
    removed: list[Path] = []
    size = 0
    if not store.is_dir():
        return removed, size
    for folder in sorted(p for p in store.glob("??/*") if p.is_dir()):
        entries = list(folder.iterdir())
        stale = entries if folder.name not in keep else [e for e in entries if e.name.endswith(".part")]
        for entry in stale:
            removed.append(entry)
            size += entry.stat().st_size
            if not dry_run:
                entry.unlink()
        if not dry_run:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
                folder.parent.rmdir()
    return removed, size
