#!/usr/bin/env python3
"""Fill a wheelhouse with a lock's wheelhouse-sourced wheels, from the URLs the lock records, hash-checked by pip.

    wheelhouse_from_lock.py skus/SKU.lock.json DIR

For watch.yml on a GitHub-hosted runner: `skupin watch --apply` relocks a SKU whose torch comes from a
wheelhouse, and resolving needs the file. pip downloads each file (`pip download --no-deps --require-hashes`)
and refuses one that does not hash to the lock's sha256; a wheel the lock records no URL for exits 1,
naming it. The standard library and pip only (skupin's own HTTP lives in skupin/clients/).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main(lock_file: str, folder: str) -> int:
    lock = json.loads(Path(lock_file).read_text(encoding="utf-8"))
    lines, missing = [], []
    for pkgs in lock.get("layers", {}).values():
        for pkg in pkgs:
            if pkg.get("source") != "wheelhouse":
                continue
            if not pkg.get("url"):
                missing.append(pkg["filename"])
                continue
            lines.append(f"{pkg['name']} @ {pkg['url']} --hash=sha256:{pkg['sha256']}")
    if missing:
        print(f"{lock_file}: no recorded URL for {', '.join(missing)}; give the wheelhouse source a url and relock",
              file=sys.stderr)
        return 1
    Path(folder).mkdir(parents=True, exist_ok=True)
    if not lines:
        return 0
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-r", req.name,
                           "-d", folder], check=False).returncode


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
