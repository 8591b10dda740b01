"""The house rules of docs/ARCHITECTURE.md, checked against the code: one package, layers, no circles, room sizes.

The repository's top-level `builder/` and `gates/` are `skupin.builder` and `skupin.gates` (skupin/builder and
skupin/gates link to them); every other room lives under `skupin/`. The layer table in docs/ARCHITECTURE.md
("| `skupin.room` | its job | may import |") is the source of truth: every import between rooms (module level
or inside a function, read with ast) must be one the table allows; no set of modules imports one another in a
circle, and no set of siblings does either (the files and folders of one folder, at every level); nothing but
the application layer imports the command line; no room (a subpackage of `skupin` with its subfolders) holds
more than a quarter of the project's non-test Python lines, and the share table in the doc is the code's.
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
MAPPED = ("builder", "gates")  # top-level folders that are skupin.<name>
ROOT = "skupin"  # the application layer's own modules (skupin/pipeline.py, skupin/__main__.py) form the room "skupin"


def layer_table() -> dict[str, set[str]]:
    """room -> the rooms it may import, from the table in docs/ARCHITECTURE.md."""
    rows = re.findall(r"^\| `(skupin(?:\.[a-z_]+)?)` \| [^|]+ \| ([^|]+) \|$", DOC.read_text(encoding="utf-8"), flags=re.M)
    assert rows, "docs/ARCHITECTURE.md has no layer table"
    return {room: set(re.findall(r"`(skupin(?:\.[a-z_]+)?)`", allowed)) for room, allowed in rows}


def git_python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "*.py"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in sorted({*listed, *untracked}) if (REPO / f).is_file() and not (REPO / f).is_symlink()]


def module_name(path: Path) -> str | None:
    """The module's import name (builder/x.py is skupin.builder.x), or None outside the package."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] in MAPPED:
        parts = ["skupin", *parts]
    elif parts[0] != "skupin":
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {name: path for path in git_python_files() if (name := module_name(path)) is not None}


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


def module_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports; importing a package that holds the module (a parent) is no edge."""
    modules = package_modules()
    return {m: {n for n in imports(p) if n in modules and n != m and not m.startswith(n + ".")} for m, p in modules.items()}


def room_of(module: str) -> str:
    parts = module.split(".")
    return ROOT if len(parts) == 1 or (REPO / "skupin" / f"{parts[1]}.py").is_file() else f"skupin.{parts[1]}"


def test_the_package_is_one_import_name_and_the_top_level_is_the_design_cards() -> None:
    for name in ("builder", "gates", "templates"):
        link = REPO / "skupin" / name
        assert link.is_symlink() and link.resolve() == (REPO / name).resolve(), f"skupin/{name} must link to ../{name}"
    tops = {p.relative_to(REPO).parts[0] for p in git_python_files() if module_name(p) is None}
    assert tops <= {"tests", "bench", "scripts"}, tops  # no other import package beside skupin
    config = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert 'include = ["skupin", "skupin.*"]' in config


def test_every_import_between_rooms_is_one_the_layer_table_allows() -> None:
    table = layer_table()
    problems = []
    for module, targets in sorted(module_graph().items()):
        room = room_of(module)
        assert room in table, f"{module}: room {room} has no row in docs/ARCHITECTURE.md's layer table"
        problems += [f"{module} imports {t}: `{room}` may not import `{room_of(t)}`" for t in sorted(targets)
                     if room_of(t) != room and room_of(t) not in table[room]]
    assert not problems, "\n".join(problems)


def test_nothing_below_the_application_layer_imports_the_command_line() -> None:
    table = layer_table()
    assert all("skupin.cli" not in allowed for room, allowed in table.items() if room not in (ROOT, "skupin.cli"))
    assert table["skupin.imagetools"] == set(), "the in-image tools import nothing of skupin"


def test_only_clients_import_httpx_and_only_dockerd_imports_docker() -> None:
    """HTTP code lives in skupin.clients, Docker code in skupin.dockerd (tests aside)."""
    rooms = {"httpx": "skupin.clients", "docker": "skupin.dockerd"}
    problems = [f"{m} imports {name}" for m, p in package_modules().items() for name in sorted(imports(p))
                if name.split(".")[0] in rooms and room_of(m) != rooms[name.split(".")[0]]]
    assert not problems, problems


def test_no_import_circle_among_the_packages_modules() -> None:
    assert not circles(module_graph()), circles(module_graph())


def sibling_graphs() -> dict[str, dict[str, set[str]]]:
    """For every package: its children (modules and subpackages) -> the siblings they import (through any descendant)."""
    graph = module_graph()
    packages = {m for m, p in package_modules().items() if p.name == "__init__.py"}
    out: dict[str, dict[str, set[str]]] = {}
    for package in packages:
        def child(module: str, package: str = package) -> str | None:
            rest = module[len(package) + 1:] if module.startswith(package + ".") else None
            return f"{package}.{rest.split('.')[0]}" if rest else None
        edges: dict[str, set[str]] = defaultdict(set)
        for module, targets in graph.items():
            if (a := child(module)) is None:
                continue
            edges[a] |= {b for t in targets if (b := child(t)) is not None and b != a}
            edges.setdefault(a, set())
        out[package] = dict(edges)
    return out


def test_no_circle_between_siblings_at_any_level() -> None:
    found = {package: c for package, edges in sibling_graphs().items() if (c := circles(edges))}
    assert not found, found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    graph = {**{n: set() for targets in graph.values() for n in targets}, **graph}
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


def test_the_circle_finders_find_circles() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert circles({"a": {"b"}}) == []  # a target with no row of its own is a node too


def nonblank(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def room_shares() -> dict[str, float]:
    """Each room's share (its subfolders counted with it) of the project's non-blank, non-test Python lines (the package,
    bench/ and scripts/; bench/ and scripts/ are rows of their own)."""
    lines: dict[str, int] = defaultdict(int)
    for path in git_python_files():
        module = module_name(path)
        rel = path.relative_to(REPO)
        if module is None and rel.parts[0] == "tests":
            continue
        lines[room_of(module) if module else f"{rel.parts[0]}/"] += nonblank(path)
    total = sum(lines.values())
    return {room: count / total for room, count in lines.items()}


def test_no_room_holds_more_than_a_quarter_of_the_code() -> None:
    shares = room_shares()
    assert max(shares.values()) <= MAX_SHARE, {r: round(s, 3) for r, s in shares.items() if s > MAX_SHARE}


def test_the_share_table_in_the_docs_is_the_codes() -> None:
    """docs/ARCHITECTURE.md's share per room is within one point of the code's (regenerate: see the doc)."""
    documented = {room: float(pct) / 100 for room, pct in
                  re.findall(r"^\| `(skupin(?:\.[a-z_]+)?|[a-z_]+/)` \| ([0-9.]+)% \|", DOC.read_text(encoding="utf-8"),
                             flags=re.M)}
    actual = room_shares()
    assert documented, "docs/ARCHITECTURE.md has no share table"
    assert set(documented) == set(actual), f"rooms missing or extra: {sorted(set(documented) ^ set(actual))}"
    off = {r: (round(documented[r], 3), round(actual[r], 3)) for r in documented if abs(documented[r] - actual[r]) > 0.01}
    assert not off, off


if __name__ == "__main__":  # print the share table of docs/ARCHITECTURE.md
    for room, share in sorted(room_shares().items(), key=lambda item: -item[1]):
        print(f"| `{room}` | {100 * share:.1f}% |")
