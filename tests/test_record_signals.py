"""The recorder's signal handling leaves a program's end as it was: a forked process blocked in C
still dies of SIGTERM, and an uncaught KeyboardInterrupt still exits by SIGINT (130)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A forked child blocks for good in a C-level lock acquire while SIGTERM reaches another of its
# threads (as a process-directed SIGTERM may: a Pool worker waiting for the task queue's lock when
# ``Pool.terminate`` terms it). Without the recorder SIGTERM's default action ends it at once; a
# Python handler would only run when the main thread next runs bytecode, which it never does.
# The parent reports how the child ended: -15, or "alive" if it had to SIGKILL it.
_FORK_BLOCKED = textwrap.dedent("""
    import os, signal, sys, threading, time
    if sys.argv[1] == "direct":  # the handler alone, installed as ``replay.record.auto.start`` does
        from replay.record import auto

        class _Session:
            def shutdown(self):
                pass

        auto._close_on_sigterm(_Session())
    ours = signal.getsignal(signal.SIGTERM)
    if ours is signal.SIG_DFL:
        print("no recorder SIGTERM handler in the parent"); sys.exit(3)
    pid = os.fork()
    if pid == 0:
        lock = threading.Lock()
        lock.acquire()

        def term_me():
            time.sleep(0.3)
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # this thread, not the main one

        threading.Thread(target=term_me, daemon=True).start()
        lock.acquire()  # blocked in C: nothing but SIGTERM's default action ends this
        os._exit(0)
    deadline = time.monotonic() + 8
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child", os.waitstatus_to_exitcode(status)); break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
            print("child alive"); break
        time.sleep(0.02)
    # The recorded process itself keeps its handler (it seals the recording on SIGTERM).
    print("parent handler kept", signal.getsignal(signal.SIGTERM) is ours)
""")

# Steps recorded, then an uncaught KeyboardInterrupt: Python exits by SIGINT (130). The second
# form shows a KeyboardInterrupt the way a console does (``sys.last_value`` set) and ends normally.
_KBI = textwrap.dedent("""
    import sys, torch
    m = torch.nn.Linear(4, 4)
    for i in range(4):
        m(torch.ones(4))
    if sys.argv[1] == "uncaught":
        raise KeyboardInterrupt
    import code
    code.InteractiveInterpreter().runsource("raise KeyboardInterrupt")
    assert isinstance(sys.last_value, KeyboardInterrupt)
""")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _check_fork_output(out: str) -> None:
    assert "child -15" in out, f"the forked child did not die of SIGTERM: {out!r}"
    assert "parent handler kept True" in out, out


def test_forked_child_blocked_in_c_dies_of_sigterm(tmp_path):
    script = tmp_path / "fork_blocked.py"
    script.write_text(_FORK_BLOCKED)
    p = subprocess.run([sys.executable, str(script), "direct"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_fork_output(p.stdout)


@pytest.mark.e2e
def test_recorded_forked_child_blocked_in_c_dies_of_sigterm(tmp_path):
    script = tmp_path / "fork_blocked.py"
    script.write_text(_FORK_BLOCKED)
    p = subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", "--out", str(tmp_path / "rec"),
                        "--", sys.executable, str(script), "recorded"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_fork_output(p.stdout)


@pytest.mark.e2e
def test_uncaught_keyboard_interrupt_keeps_exit_130(tmp_path):
    script = tmp_path / "kbi.py"
    script.write_text(_KBI)
    env = _env()
    for form, code in (("uncaught", 128 + signal.SIGINT), ("shown", 0)):
        plain = subprocess.run([sys.executable, str(script), form], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=90)
        assert plain.returncode == (-signal.SIGINT if code else 0), plain.stderr  # died by SIGINT
        out = tmp_path / f"rec-{form}"
        p = subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", "--out", str(out),
                            "--", sys.executable, str(script), form],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
        # ``replay record`` exits 128+N when its command died by signal N.
        assert p.returncode == code, f"{form}: exit {p.returncode}, {code} without replay\n{p.stderr}"
        # The recording is sealed, with its steps.
        v = subprocess.run([sys.executable, "-m", "replay", "verify", str(out)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=90)
        assert v.returncode == 0, v.stdout + v.stderr
        assert "3 steps" in v.stdout, v.stdout


# A ``multiprocessing`` worker that got its sentinel closes its recording at its exit, and
# ``Pool.terminate`` (``with Pool(...)``'s exit) may term it in the middle of that close: the
# signal is made to land there, as it did one run in three with a Pool of two workers.
_TERM_IN_CLOSE = textwrap.dedent("""
    import os, signal, torch
    m = torch.nn.Linear(4, 4)
    for i in range(4):
        m(torch.ones(4))
    from replay.record import auto

    s = auto.session()
    rec = s.recorder
    close = rec.close

    def close_termed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the close
        return close(*args, **kwargs)

    rec.close = close_termed
    s.shutdown()  # as multiprocessing's exit finalizer does in a worker
    print("shutdown returned")
""")


@pytest.mark.e2e
def test_sigterm_inside_the_recorders_close_keeps_the_end_marker(tmp_path):
    script = tmp_path / "term_in_close.py"
    script.write_text(_TERM_IN_CLOSE)
    env = _env()
    out = tmp_path / "rec"
    p = subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", "--out", str(out), "--", sys.executable, str(script)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    # It still dies by SIGTERM (143), once its close is done, and not before.
    assert p.returncode == 128 + signal.SIGTERM, p.stdout + p.stderr
    assert "shutdown returned" not in p.stdout
    v = subprocess.run([sys.executable, "-m", "replay", "verify", str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=90)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "3 steps" in v.stdout and "INCOMPLETE" not in v.stdout, v.stdout
