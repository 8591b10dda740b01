"""The house rules of docs/ARCHITECTURE.md, checked against the code: layers, no import circles, package sizes.

The layer table in docs/ARCHITECTURE.md ("| package | its job | may import |") is the source of truth:
every import between the project's packages (module level or inside a function, read with ast) must be
one the table allows, no set of modules may import one another in a circle, nothing but the command
line imports `skupin`, and no folder's own files hold more than a quarter of the project's non-test lines.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ARCHITECTURE.md"
MAX_SHARE = 0.25


def layer_table() -> dict[str, set[str]]:
    """package -> the project packages it may import, from the table in docs/ARCHITECTURE.md."""
    rows = re.findall(r"^\| `([a-z_]+)/` \| [^|]+ \| ([^|]+) \|$", DOC.read_text(encoding="utf-8"), flags=re.M)
    assert rows, "docs/ARCHITECTURE.md has no layer table"
    return {pkg: set(re.findall(r"`([a-z_]+)/`", allowed)) for pkg, allowed in rows}


def project_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "*.py"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in sorted({*listed, *untracked}) if (REPO / f).is_file()]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every absolute module name `path` imports, anywhere in the file (also `from a import b` as a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_every_import_between_packages_is_one_the_layer_table_allows() -> None:
    table = layer_table()
    problems = []
    for path in project_files():
        package = path.relative_to(REPO).parts[0]
        if package not in table:
            continue
        for name in sorted(imports(path)):
            target = name.split(".")[0]
            if target in table and target != package and target not in table[package]:
                problems.append(f"{path.relative_to(REPO)} imports {name}: `{package}/` may not import `{target}/`")
    assert not problems, "\n".join(problems)


def test_nothing_but_the_command_line_imports_skupin() -> None:
    table = layer_table()
    assert all("skupin" not in allowed for pkg, allowed in table.items() if pkg != "skupin")
    users = [p.relative_to(REPO) for p in project_files()
             if p.relative_to(REPO).parts[0] not in ("skupin", "tests", "bench")
             and any(n == "skupin" or n.startswith("skupin.") for n in imports(p))]
    assert not users, users


def test_only_clients_import_httpx_and_only_dockerd_imports_docker() -> None:
    """The rooms of docs/ARCHITECTURE.md: HTTP code lives in clients/, Docker code in dockerd/ (tests aside)."""
    rooms = {"httpx": "clients", "docker": "dockerd"}
    table = layer_table()
    problems = [f"{p.relative_to(REPO)} imports {name}" for p in project_files()
                if p.relative_to(REPO).parts[0] in table for name in sorted(imports(p))
                if name.split(".")[0] in rooms and p.relative_to(REPO).parts[0] != rooms[name.split(".")[0]]]
    assert not problems, problems


def test_no_import_circle_among_the_projects_modules() -> None:
    table = layer_table()
    modules = {module_name(p): p for p in project_files() if p.relative_to(REPO).parts[0] in table}
    graph = {m: {n for n in imports(p) if n in modules and n != m} for m, p in modules.items()}
    assert not _circles(graph), _circles(graph)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def folder_shares() -> dict[str, float]:
    """Each folder's own (not its sub-folders') share of the project's non-blank, non-test Python lines."""
    lines: dict[str, int] = defaultdict(int)
    for path in project_files():
        rel = path.relative_to(REPO)
        if rel.parts[0] == "tests":
            continue
        lines[rel.parent.as_posix()] += sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    total = sum(lines.values())
    return {folder: count / total for folder, count in lines.items()}


def test_no_folder_holds_more_than_a_quarter_of_the_code() -> None:
    shares = folder_shares()
    assert max(shares.values()) <= MAX_SHARE, {f: round(s, 3) for f, s in shares.items() if s > MAX_SHARE}


def test_the_share_table_in_the_docs_is_roughly_current() -> None:
    """docs/ARCHITECTURE.md's share per folder is within 3 points of the code's (regenerate: see the doc)."""
    documented = {folder: float(pct) / 100 for folder, pct in
                  re.findall(r"^\| `([a-z_/]+)/` \| ([0-9.]+)% \|", DOC.read_text(encoding="utf-8"), flags=re.M)}
    actual = folder_shares()
    assert documented, "docs/ARCHITECTURE.md has no share table"
    missing = {f for f, s in actual.items() if s >= 0.01 and f not in documented}
    assert not missing, f"folders missing from the share table: {sorted(missing)}"
    off = {f: (round(documented[f], 3), round(actual.get(f, 0), 3)) for f in documented
           if abs(documented[f] - actual.get(f, 0)) > 0.03}
    assert not off, off


if __name__ == "__main__":  # print the share table of docs/ARCHITECTURE.md
    for folder, share in sorted(folder_shares().items(), key=lambda item: -item[1]):
        print(f"| `{folder}/` | {100 * share:.1f}% |")
