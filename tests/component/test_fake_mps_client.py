"""The compiled fake MPS client (tests/fakes/mps_client.c) against the Python
fake it fronts: the same requests through both, against one fake daemon,
give the same exit status, stdout and stderr (argv and v2 stdin forms, -q,
failures, the daemon absent, a broken reply, and the invocations it hands to
the Python fake). The benchmarks run the daemon with the compiled client
(docs/benchmarks.md); these tests keep it honest."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from fracplugin.mps.api import MpsError
from fracplugin.mps.control import MpsControl, render_config_toml
from tests.fakes.mps_client import PY_FAKE, build_mps_client
from tests.helpers import scaled, unix_socket_listening, wait_until

FAST_PATH = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture(scope="module")
def cbin() -> str:
    return str(build_mps_client())


def _env(d: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PATH=FAST_PATH, CUDA_MPS_PIPE_DIRECTORY=os.path.join(d, "p"),
               CUDA_MPS_LOG_DIRECTORY=os.path.join(d, "l"))
    env.pop("CUDA_MPS_PROTOCOL_VERSION", None)
    env.update(extra)
    return env


def _daemon(d: str, procs: list, binary: str, protocol: str = "3") -> subprocess.Popen:
    """A foreground fake daemon (``-f``: the Python fake's own code) on <d>/p."""
    cfg = os.path.join(d, "c.toml")
    Path(cfg).write_text(render_config_toml(sm_sharing=True))
    p = subprocess.Popen([binary, "-p", protocol, "-a", cfg, "-f"], stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, env=_env(d))
    procs.append(p)
    control = os.path.join(d, "p", "control")
    wait_until(lambda: unix_socket_listening(control) or p.poll() is not None, 10, f"the fake daemon listening on {control}")
    assert p.poll() is None, f"the fake daemon exited {p.returncode}"
    return p


def _run(binary: str, args: list[str], env: dict[str, str], stdin: bytes | None) -> tuple[int, bytes, bytes]:
    r = subprocess.run([binary, *args], input=stdin if stdin is not None else b"", capture_output=True,
                       env=env, timeout=30)
    return r.returncode, r.stdout, r.stderr


def _both(cbin: str, args: list[str], env: dict[str, str], stdin: bytes | None = None,
          undo: list[list[str]] = ()) -> tuple[int, bytes, bytes]:
    """Run one request through the Python fake, then (after ``undo``, Python
    fake commands that put the daemon back as it was) through the compiled
    client, assert the two answers are equal, and return it."""
    want = _run(str(PY_FAKE), args, env, stdin)
    for u in undo:
        assert _run(str(PY_FAKE), u, env, None)[0] == 0, u
    got = _run(cbin, args, env, stdin)
    assert got == want, f"{args} stdin={stdin!r}: C client {got!r} != Python fake {want!r}"
    return want


def test_v3_argv_requests_answer_as_the_python_fake(cbin, pipe):
    d, procs = pipe
    _daemon(d, procs, str(PY_FAKE))
    env = _env(d)
    assert _both(cbin, ["server", "list", "--format=csv,noheader"], env)[0] == 0
    rc, out, err = _both(cbin, ["namespace", "create", "t1", "--server=shared"], env,
                         undo=[["namespace", "delete", "t1", "--server=shared"]])
    assert (rc, out, err) == (0, b"", b"")
    assert _run(str(PY_FAKE), ["namespace", "create", "keep", "--server=shared"], env, None)[0] == 0
    rc, out, _ = _both(cbin, ["namespace", "list", "--format=csv"], env)
    assert rc == 0 and out.startswith(b"name,server,") and b"keep,shared" in out
    assert _both(cbin, ["namespace", "set", "keep", "--server=shared", "--active-thread-percentage=50",
                        "--pinned-memory-limit=512M"], env)[0] == 0
    # failures: the daemon's error on stderr, exit 1
    rc, out, err = _both(cbin, ["namespace", "set", "keep", "--server=shared", "--active-thread-percentage=500"], env)
    assert (rc, out) == (1, b"") and b"active thread percentage" in err
    assert _both(cbin, ["namespace", "create", "BAD", "--server=shared"], env)[0] == 1
    assert _both(cbin, ["namespace", "create", "ns_\u00e9", "--server=shared"], env)[2] == \
        "Error: invalid namespace name ns_\u00e9\n".encode()
    assert _both(cbin, ["bogus", "x"], env)[0] == 1
    assert _both(cbin, ["namespace", "delete", "nope", "--server=shared"], env)[0] == 1
    # options before the command are the client's; an unknown option starts the command
    assert _both(cbin, ["-m", "-p", "3", "-a", "x.toml", "--protocol=3", "--apply=y", "server", "list"], env)[0] == 0
    assert _both(cbin, ["-x", "server", "-d"], env)[0] == 1
    assert _both(cbin, ["fake-state"], env)[0] == 0
    # fault injection answers through the daemon, so both see it
    Path(d, "p", "fake-control.json").write_text('{"refuse": ["namespace set"]}')
    rc, _, err = _both(cbin, ["namespace", "set", "keep", "--server=shared", "--client-priority=1"], env)
    assert rc == 1 and err.startswith(b"Error: command refused by fake")


def test_v2_stdin_requests_answer_as_the_python_fake(cbin, pipe):
    d, procs = pipe
    _daemon(d, procs, str(PY_FAKE), protocol="2")
    env = _env(d)
    assert _both(cbin, [], env, b"get_default_active_thread_percentage\n")[1] == b"100.0\n"
    # blank lines, "\r\n" line ends, a lone "\r" (whitespace, not a line end, in Python's
    # sys.stdin), Python's (Unicode) whitespace, a failing line in the middle (its error on
    # stdout, the first failure's rc), a last line without "\n"
    script = ("\n  \nset_default_active_thread_percentage\t 50\r\n\rbad\u3000x\u2003y\n"
              "set_default_device_pinned_mem_limit 0 2G\n"
              "get_default_active_thread_percentage\x1cextra\rset_default_device_pinned_mem_limit 0 4G\n"
              "\u00a0get_default_device_pinned_mem_limit 0").encode()
    rc, out, err = _both(cbin, [], env, script)
    assert rc == 1 and err == b""
    assert out == b"50.0\nError: unknown command bad\n50.0\n2G\n"
    assert _both(cbin, [], env, b"") == (0, b"", b"")
    assert _both(cbin, [], env, b" \n\t\n") == (0, b"", b"")
    assert _both(cbin, ["get_server_list"], env)[0] == 0
    assert _both(cbin, ["ps"], env)[1].startswith(b"PID ID SERVER")
    assert _both(cbin, ["set_default_device_pinned_mem_limit", "0", "2X"], env)[0] == 1
    assert _both(cbin, ["server", "list"], env)[0] == 1  # a v2 daemon does not know v3 modules


def test_quit_and_a_daemon_that_is_gone(cbin, pipe):
    d, procs = pipe
    env = _env(d)
    results = []
    for binary in (str(PY_FAKE), cbin):
        p = _daemon(d, procs, str(PY_FAKE))
        results.append(_run(binary, ["-q"], env, None))
        assert p.wait(scaled(10)) == 0
    assert results[0] == results[1] == (0, b"", b"")
    gone = b"Cannot find MPS control daemon process\n"
    assert _both(cbin, ["-q"], env) == (1, b"", gone)
    assert _both(cbin, ["server", "list"], env) == (1, b"", gone)
    assert _both(cbin, [], env, b"get_server_list\nps\n") == (1, b"", gone * 2)
    # a pipe directory too long for a unix socket address: "cannot find" as well
    long_env = _env(d, CUDA_MPS_PIPE_DIRECTORY="/tmp/" + "x" * 120)
    assert _both(cbin, ["server", "list"], long_env) == (1, b"", gone)


def test_a_reply_without_a_status_line_is_a_broken_connection(cbin, pipe):
    d, _ = pipe
    pipe = Path(d, "p")
    pipe.mkdir()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(pipe / "control"))
    srv.listen(8)
    replies = [b"", b"garbage", b"x\n1", b"-\n"] * 2

    def serve() -> None:
        for reply in replies:
            conn, _ = srv.accept()
            with conn:
                got = b""
                while not got.endswith(b"\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                conn.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for _ in range(len(replies) // 2):
            assert _both(cbin, ["server", "list"], _env(d)) == \
                (1, b"", b"Connection to the MPS control daemon broke\n")
    finally:
        t.join(10)
        srv.close()
    assert not t.is_alive()


def test_everything_but_a_client_is_the_python_fake(cbin, pipe):
    d, procs = pipe
    p = _daemon(d, procs, cbin)  # -f through the compiled front: the Python daemon, same PID
    assert psutil.Process(p.pid).cmdline()[1] == str(PY_FAKE)
    env = _env(d)
    assert _both(cbin, ["-v"], env) == (0, b"nvidia-cuda-mps-control (fake) 615.00\n", b"")
    assert _both(cbin, ["--help"], env)[1].startswith(b"A fake ``nvidia-cuda-mps-control``")
    rc, _, err = _both(cbin, ["-d"], env)  # the control socket exists: the Python daemon refuses
    assert rc == 1 and b"already exists" in err
    assert _both(cbin, ["-p"], env) == (1, b"", b"option -p needs a value\n")
    assert _both(cbin, ["--protocol=x", "server", "list"], env)[0] == 1  # Python's int() traceback
    assert _both(cbin, ["server", "list"], _env(d, CUDA_MPS_PROTOCOL_VERSION="three"))[0] == 1
    assert _both(cbin, ["server", "list"], _env(d, CUDA_MPS_PROTOCOL_VERSION="3"))[0] == 0
    # a client never starts Python: with no python3 on PATH it still answers
    no_python = _env(d, PATH="/nonexistent")
    assert _run(cbin, ["server", "list", "--format=csv,noheader"], no_python, None)[0] == 0
    assert _run(cbin, [], no_python, b"get_default_active_thread_percentage\n") == (0, b"100.0\n", b"")
    assert _run(cbin, ["-v"], no_python, None)[0] != 0  # handed to the Python fake, which needs python3


def test_the_product_drives_mps_through_the_compiled_client(cbin, pipe):
    d, procs = pipe
    cfg = os.path.join(d, "c.toml")
    Path(cfg).write_text(render_config_toml(sm_sharing=True))
    c = MpsControl(cbin, os.path.join(d, "p"), 3, os.path.join(d, "l"), env={"PATH": FAST_PATH})
    p = subprocess.Popen([cbin, "-p", "3", "-m", "-a", cfg, "-f"], stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, env=_env(d))
    procs.append(p)
    wait_until(lambda: unix_socket_listening(os.path.join(d, "p", "control")) or p.poll() is not None, 10)
    assert c.probe(5) >= 0
    c.namespace_create("fp_x", "shared", 5)
    c.namespace_set_caps("fp_x", "shared", 25, 1024, 5)
    rows = c.namespace_list("shared", 5)
    assert [(r.name, r.active_thread_percentage, r.pinned_memory_limit) for r in rows] == [("fp_x", 25, "1024M")]
    with pytest.raises(MpsError, match="already exists"):
        c.namespace_create("fp_x", "shared", 5)
    c.namespace_delete("fp_x", "shared", 5)
    c.quit(5)
    assert p.wait(scaled(10)) == 0
    with pytest.raises(MpsError, match="Cannot find MPS control daemon"):
        c.probe(5)
