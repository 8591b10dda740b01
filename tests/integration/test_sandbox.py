"""The gate's container I/O against hostile images: an output flood, a forged frame, `kill -9` of the gate and the
reaper (`reap_orphans`, `skupin docker up`), a bad server.

Derived images are thin layers FROM the honest CPU image, built here without network; each adds a
start-up hook (a .pth file and a module in site-packages) that runs in every Python process of the
image, or replaces the `transformers` CLI with a hostile server:
- `flood`: prints 300 MB to stdout, then sleeps;
- `forged`: prints a well-framed output whose probe.json is nested 100 000 levels deep, then exits 0;
- `hang`: sleeps for an hour;
- `badsse`: `transformers serve` is a stdlib server that is ready but streams `data: [1]`.
The probe and server paths are driven directly (probe_in_container, serve_check): the full gate
stops such images earlier, at its static integrity check. The flood and `kill -9` cases run the
probe in a child process, to measure its memory and to kill it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skupin.builder.catalog.manifest import load_manifest
from skupin.dockerd import DEADLINE_GRACE_S, KILL_AFTER_S, SESSION_LABEL, Docker
from skupin.gates.gate import RUN_LABEL, load_reference, probe_in_container, run_label
from skupin.gates.judge.tolerance import ToleranceKey, load_tolerances
from skupin.gates.refdata.probe_output import MAX_FRAME_BYTES
from skupin.gates.serving.serve import serve_check
from skupin.imagetools.probe import FRAME_MAGIC
from tests.integration.conftest import derived_images

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CPU_SKU = REPO / "skus" / "cpu-x86_64.yaml"

DOCKERFILE = """\
ARG BASE
FROM ${BASE}
ARG MODE
COPY hooks/ /opt/skupin-test/
RUN set -eu; site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \\
    case "${MODE}" in \\
      badsse) cp /opt/skupin-test/badsse.py "$(command -v transformers)" ;; \\
      *) cp "/opt/skupin-test/${MODE}.py" "${site}/skupin_test_hook.py"; \\
         echo "import skupin_test_hook" > "${site}/zz_skupin_test_hook.pth" ;; \\
    esac
LABEL io.skupin.test-sandbox="${MODE}"
"""
FORGED_REPORT = b'{"format": "skupin-probe/1", "env": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HOOKS = {
    "flood.py": "import os, time\nchunk = b'x' * (1 << 20)\nfor _ in range(300):\n    os.write(1, chunk)\n"
                "time.sleep(3600)\n",
    "forged.py": "import os\nreport = " + repr(FORGED_REPORT) + "\nframe = " + repr(FRAME_MAGIC)
                 + " + len(report).to_bytes(8, 'little') + report + (0).to_bytes(8, 'little')\n"
                 "view = memoryview(frame)\nwhile view:\n    view = view[os.write(1, view):]\nos._exit(0)\n",
    "hang.py": "import time\ntime.sleep(3600)\n",
    "badsse.py": """#!/usr/bin/env python3
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
model, port = argv[1], int(argv[argv.index("--port") + 1])
class Handler(BaseHTTPRequestHandler):
    def _send(self, body, kind="application/json"):
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send(json.dumps({"data": [{"id": model}]} if self.path == "/v1/models" else {"status": "ok"}).encode())
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._send(b"data: [1]\\n\\ndata: [DONE]\\n\\n", "text/event-stream")
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""",
}
RUNNER = r"""
import json, sys, time
from pathlib import Path
from skupin.dockerd import connect
from skupin.builder.catalog.manifest import load_manifest
from skupin.gates.gate import probe_in_container

def kib(key):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))

manifest_path, image, out, deadline = sys.argv[1:5]
m = load_manifest(Path(manifest_path))
m = m.model_copy(update={"gate": m.gate.model_copy(update={"deadline_s": int(deadline)})})
docker = connect()
before = kib("VmRSS:")
print("STARTED", flush=True)
start = time.monotonic()
run = probe_in_container(manifest=m, image=image, docker=docker, out=Path(out))
print(json.dumps({"error": run.error, "exit_code": run.exit_code, "seconds": run.seconds,
                  "wall_s": time.monotonic() - start, "rss_before_kib": before, "peak_rss_kib": kib("VmHWM:")}))
"""


@pytest.fixture(scope="module")
def derive(docker: Docker, honest_image: str, tmp_path_factory) -> Iterator:
    context = tmp_path_factory.mktemp("sandbox-derived")
    (context / "Dockerfile").write_text(DOCKERFILE)
    (context / "hooks").mkdir()
    for name, text in HOOKS.items():
        (context / "hooks" / name).write_text(text)
        (context / "hooks" / name).chmod(0o755)
    with derived_images(docker, honest_image=honest_image, context=context,
                        base_tag="skupin-test/sandbox-honest-base:latest") as build:
        yield build


def _manifest(deadline_s: int | None = None):
    m = load_manifest(CPU_SKU)
    return m if deadline_s is None else m.model_copy(update={"gate": m.gate.model_copy(update={"deadline_s": deadline_s})})


def _spawn(image: str, out: Path, deadline_s: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUNNER, str(CPU_SKU), image, str(out), str(deadline_s)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _container_of(docker: Docker, label: str, *, within_s: float = 60) -> str:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        found = docker.containers(label=label, all=False)
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no running container with {label} within {within_s} s")


def _inspect(docker: Docker, cid: str) -> dict:
    out = subprocess.run([docker.cli(), "inspect", cid], capture_output=True, text=True, check=True,
                         env={"DOCKER_HOST": f"unix://{docker.socket}", "PATH": "/usr/bin:/bin"}).stdout
    return json.loads(out)[0]


def _gone_within(docker: Docker, label: str, seconds: float) -> float:
    start = time.monotonic()
    while docker.containers(label=label):
        assert time.monotonic() - start < seconds, f"a container with {label} outlived {seconds:.0f} s"
        time.sleep(0.5)
    return time.monotonic() - start


def test_an_output_flood_is_cut_at_the_cap_and_memory_stays_bounded(derive, docker: Docker, tmp_path: Path) -> None:
    image = derive("flood")
    proc = _spawn(image, tmp_path / "probe", deadline_s=120)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.splitlines()[-1])
    growth_mib = (result["peak_rss_kib"] - result["rss_before_kib"]) / 1024
    print(f"flood: {result['error'][:160]}; {result['wall_s']:.1f} s; skupin RSS before {result['rss_before_kib'] / 1024:.0f} "
          f"MiB, peak {result['peak_rss_kib'] / 1024:.0f} MiB (+{growth_mib:.0f} MiB; cap {MAX_FRAME_BYTES >> 20} MiB)")
    assert "printed too much" in result["error"] and "stdout passed its cap" in result["error"]
    assert result["wall_s"] < 120
    assert growth_mib < 1.3 * (MAX_FRAME_BYTES >> 20) + 64
    assert "overflow: stdout passed its cap" in (tmp_path / "probe" / "container.log").read_text()
    assert not docker.containers(label=f"{RUN_LABEL}={run_label(tmp_path / 'probe')}")


def test_a_forged_frame_with_deeply_nested_json_is_an_error_not_a_crash(derive, docker: Docker, tmp_path: Path) -> None:
    run = probe_in_container(manifest=_manifest(), image=derive("forged"), docker=docker, out=tmp_path / "probe")
    assert "without usable outputs" in run.error and "nested" in run.error, run.error
    assert run.exit_code == 0 and run.report == {} and run.tensors == {}
    assert sorted(p.name for p in (tmp_path / "probe").iterdir()) == ["container.log"]


def test_kill_9_of_the_gate_leaves_the_container_only_until_its_own_deadline(derive, docker: Docker,
                                                                            tmp_path: Path) -> None:
    deadline = 10
    out = tmp_path / "probe"
    label = f"{RUN_LABEL}={run_label(out)}"
    proc = _spawn(derive("hang"), out, deadline_s=deadline)
    try:
        cid = _container_of(docker, label)
        seen = time.monotonic()
        attrs = _inspect(docker, cid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()  # waits and closes its pipes
    host = attrs["HostConfig"]
    assert all(not m["RW"] for m in attrs["Mounts"]), attrs["Mounts"]  # nothing the container can write
    assert host["IpcMode"] == "private" and host["AutoRemove"] and host["LogConfig"]["Type"] == "none"
    assert host["NanoCpus"] > 0 and host["NetworkMode"] == "none" and host["ReadonlyRootfs"]
    assert attrs["Path"] == "/usr/bin/timeout" and attrs["Args"][:2] == [f"--kill-after={KILL_AFTER_S}",
                                                                        f"{deadline + DEADLINE_GRACE_S}s"]
    assert docker.containers(label=label) == (cid,)  # skupin is dead: only the in-container deadline is left
    gone = _gone_within(docker, label, deadline + DEADLINE_GRACE_S + KILL_AFTER_S + 15)
    print(f"kill -9: the container was gone {time.monotonic() - seen:.1f} s after it started running "
          f"(in-container deadline {deadline} + {DEADLINE_GRACE_S} s grace; {gone:.1f} s after the kill)")


def test_reap_orphans_removes_the_leftover_of_a_killed_gate_at_once(derive, docker: Docker, tmp_path: Path) -> None:
    out = tmp_path / "probe"
    label = f"{RUN_LABEL}={run_label(out)}"
    proc = _spawn(derive("hang"), out, deadline_s=600)
    try:
        cid = _container_of(docker, label)
        assert cid not in [r.id for r in docker.reap_orphans()]  # its owner lives: left alone
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()  # waits and closes its pipes
    start = time.monotonic()
    reaped = {r.id: r for r in docker.reap_orphans()}
    assert cid in reaped and "has exited" in reaped[cid].reason, reaped
    assert not docker.containers(label=label)
    print(f"reaped {reaped[cid].describe()} in {time.monotonic() - start:.2f} s")


SLEEPER = """
import sys, time
from skupin.dockerd import ContainerSpec, connect
with connect().container(ContainerSpec(image=sys.argv[1], entrypoint=("sleep", "600"), labels={"io.skupin.test": sys.argv[2]})):
    print("UP", flush=True)
    time.sleep(600)
"""


def test_docker_up_removes_and_names_the_leftovers_of_dead_runs(honest_image: str, docker: Docker, capsys) -> None:
    from skupin.cli import main

    tag = f"docker-up-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, honest_image, tag], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "UP"
        (cid,) = docker.containers(label=f"io.skupin.test={tag}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()  # waits and closes its pipes
    assert main(["docker", "up"]) == 0
    out = capsys.readouterr().out
    assert "already running" in out and "removed a leftover container" in out and cid[:12] in out, out
    assert not docker.containers(label=f"io.skupin.test={tag}")


def test_a_server_streaming_hostile_events_fails_the_serve_check_cleanly(derive, stack, docker: Docker) -> None:
    entry = load_tolerances().find(ToleranceKey(hardware_class="cpu-x86_64", dtype="float32", model="tiny-llama"))
    _, ref, _ = load_reference(manifest=stack.manifest)
    start = time.monotonic()
    check = serve_check(manifest=stack.manifest, image=derive("badsse"), docker=docker, ref=ref, entry=entry,
                        ready_deadline_s=60)
    assert check.status == "fail" and "not a JSON object" in check.reason, check.reason
    assert not docker.containers(label=f"{SESSION_LABEL}={docker.session}"), "the server container was left behind"
    print(f"bad SSE: {check.reason[:200]} ({time.monotonic() - start:.1f} s)")
