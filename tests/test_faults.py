"""Faults while recording, through ``replay record`` on small gloo programs (tests/scripts).

Each scenario runs the same program twice, as it is and under ``replay record``, and checks:

- the exit code is the one the program has without the recorder;
- every step a rank completed (the program logs each one, with its input and output bytes,
  right after the step returns) is in the recording, bit for bit;
- ``replay verify`` says what was lost: non-zero, naming the rank and the last step kept.

The fast suite runs each fault once; ``-m slow`` runs many SIGKILL trials at random moments
(``REPLAY_FAULT_TRIALS``, default 40). ``REPLAY_FAULT_STATS=path`` writes the kill figures as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from replay import open_recording
from replay.digest import digest
from replay.errors import RecordingDamaged
from replay.record.settings import RecordSettings
from replay.record.wrapper import child_environment

SCRIPTS = Path(__file__).parent / "scripts"
LAUNCH = str(SCRIPTS / "gloo_ranks.py")
STEP = "gloo_engine:Engine.step"
WIDTH = 16
TIMEOUT = 180.0  # per program run: a hang fails the test instead of the suite

pytestmark = pytest.mark.timeout(600)


# -- running the program, plain and recorded ---------------------------------------------------


@dataclass
class Run:
    """One run of the program: where it wrote, and how it ended."""

    root: Path
    recorded: bool
    proc: subprocess.Popen | None = None
    code: int | None = None

    @property
    def prog(self) -> Path:
        return self.root / "prog"

    @property
    def rec(self) -> Path:
        return self.root / "rec"

    def pid(self, rank: int) -> int:
        return int((self.prog / f"pid-{rank}").read_text())

    def completed(self, rank: int) -> list[tuple[int, bytes, bytes]]:
        """(step, input bytes, output bytes) of every step ``rank`` completed."""
        path = self.prog / f"progress-{rank}.txt"
        if not path.exists():
            return []
        out = []
        # A SIGKILL can cut the last line's write short: only whole lines (as n_completed counts).
        for line in path.read_text().split("\n")[:-1]:
            s, x, y = line.split()
            out.append((int(s), bytes.fromhex(x), bytes.fromhex(y)))
        return out

    def n_completed(self, rank: int) -> int:
        path = self.prog / f"progress-{rank}.txt"
        return path.read_bytes().count(b"\n") if path.exists() else 0

    def stderr(self) -> str:
        return (self.root / "stderr.txt").read_text(errors="replace")


def program(prog: Path, **opts: Any) -> list[str]:
    argv = [sys.executable, LAUNCH, "--dir", str(prog)]
    for k, v in opts.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def start(root: Path, *, recorded: bool, record_args: tuple[str, ...] = (), env: dict[str, str] | None = None, **opts: Any) -> Run:
    """Start the program (under ``replay record`` if ``recorded``) in a session of its own."""
    run = Run(root=root, recorded=recorded)
    root.mkdir(parents=True, exist_ok=True)
    cmd = program(run.prog, **opts)
    if recorded:
        cmd = [sys.executable, "-m", "replay", "record", "--out", str(run.rec), "--quiet", "--grace", "20",
               "--step", STEP, "--state", "state", *record_args, "--", *cmd]
    with open(root / "stdout.txt", "wb") as out, open(root / "stderr.txt", "wb") as err:
        # A session of its own: the signals a test sends never reach pytest, and the plain
        # program's group can be signalled as a terminal would.
        run.proc = subprocess.Popen(
            cmd, cwd=root, stdout=out, stderr=err, start_new_session=True, env=env, preexec_fn=_default_signals
        )
    return run


def _default_signals() -> None:
    # As from an interactive shell: a test harness that runs in the background ignores SIGINT,
    # and the program would inherit that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(run: Run, timeout: float = TIMEOUT) -> int:
    assert run.proc is not None
    try:
        run.code = run.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        pytest.fail(f"{'recorded' if run.recorded else 'plain'} run did not end in {timeout:.0f} s:\n{run.stderr()[-3000:]}")
    if run.code < 0:
        run.code = 128 - run.code
    return run.code


def wait_for(cond: Any, timeout: float = 60.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def wait_steps(run: Run, rank: int, n: int) -> None:
    """Until ``rank`` has completed ``n`` steps (its pid file exists from the start)."""
    wait_for(lambda: run.n_completed(rank) >= n or (run.proc is not None and run.proc.poll() is not None), what=f"rank {rank} step {n}")


# -- what the recording must hold ---------------------------------------------------------------


def check_kept(run: Run, world: int, *, stopped: bool = False) -> dict[int, int | None]:
    """Every completed step of every rank is in the recording, bit for bit; rank -> last kept step.

    ``stopped``: recording was switched off on purpose (a size limit); the steps it kept must
    still match the program's, but the later ones are not there.
    """
    last: dict[int, int | None] = {}
    with open_recording(run.rec) as rec:
        assert len(rec) == 1, f"expected one part, got {list(rec)}"
        part = next(iter(rec.values()))
        for rank in range(world):
            done = run.completed(rank)
            if rank not in part:
                assert not done, f"rank {rank} completed {len(done)} steps but has no rank file"
                last[rank] = None
                continue
            rf = part[rank]
            steps = rf.tables.steps["step"]
            assert list(steps) == list(range(steps.size)), f"rank {rank}: steps not contiguous"
            if stopped:
                done = done[: steps.size]
            assert steps.size >= len(done), f"rank {rank} lost completed steps: kept {steps.size}, completed {len(done)}"
            for s, x, y in done:
                view = rf.step(s)
                assert view.ok, f"rank {rank} step {s} completed but is recorded as raised"
                assert view.inputs["x"].numpy().tobytes() == x, f"rank {rank} step {s}: input bits differ"
                out = torch.frombuffer(bytearray(y), dtype=torch.float32).reshape(2, WIDTH)
                assert dict(view.fields())["output.logits"] == digest(out), f"rank {rank} step {s}: output digest differs"
            last[rank] = int(steps[-1]) if steps.size else None
    return last


def verify_json(run_cli: Any, run: Run) -> tuple[int, dict[int, dict[str, Any]], str]:
    """(exit code, rank -> check, text output) of ``replay verify``."""
    r = run_cli("verify", "--json", str(run.rec))
    assert r.err == "", r.err
    text = run_cli("verify", str(run.rec))
    assert text.code == r.code and text.err == ""
    return r.code, {c["rank"]: c for c in r.json()["ranks"]}, text.out


def assert_reports_loss(run_cli: Any, run: Run, lost_ranks: set[int], last: dict[int, int | None]) -> None:
    """``replay verify`` fails, and names each rank that lost its end with the last step it kept."""
    code, checks, text = verify_json(run_cli, run)
    assert code == 4, text
    for rank in lost_ranks:
        c = checks[rank]
        assert c["state"] == "incomplete", c
        assert c["last_step"] == last[rank], (c, last)
        where = f"after step {last[rank]}" if last[rank] is not None else "before its first step"
        line = next(ln for ln in text.splitlines() if ln.startswith(f"run-000 rank {rank}:"))
        assert "INCOMPLETE" in line
        assert any(where in p or "nothing was recorded" in p for p in c["problems"]), c["problems"]
        assert where in text or "nothing was recorded" in text


# -- scenarios ----------------------------------------------------------------------------------
#
# Every fast scenario runs at once, plain and recorded, from one fixture: the runs are
# independent, and most of their time is spent starting interpreters or waiting, so running them
# side by side keeps the suite short. The tests below then check what each run left.


@dataclass
class Scenario:
    name: str
    opts: dict[str, Any]
    expect: int | tuple[int, ...]  # the exit code, plain and recorded
    act: Callable[[Run], None] | None = None  # what happens to the running program
    record_args: tuple[str, ...] = ()
    plain: bool = True  # also run it without the recorder
    env: dict[str, str] | None = None  # run "plain" with this environment (the recorder injected by hand)


def kill_rank_after(rank: int, steps: int) -> Callable[[Run], None]:
    def act(run: Run) -> None:
        wait_steps(run, rank, steps)
        os.kill(run.pid(rank), signal.SIGKILL)

    return act


def kill_all_after(steps: int) -> Callable[[Run], None]:
    def act(run: Run) -> None:
        wait_steps(run, 0, steps)
        os.killpg(os.getpgid(run.pid(0)), signal.SIGKILL)  # the program's whole process group

    return act


def signal_after(sig: signal.Signals, steps: int) -> Callable[[Run], None]:
    def act(run: Run) -> None:
        wait_steps(run, 0, steps)
        assert run.proc is not None
        if run.recorded:
            os.kill(run.proc.pid, sig)  # only `replay record` itself: it passes the signal on
        else:
            os.killpg(run.proc.pid, sig)  # the program's group, as a terminal's Ctrl-C would

    return act


def random_kill(seed: int, victims: str) -> Callable[[Run], None]:
    """SIGKILL a random rank (or the whole program) after a random number of steps and then a
    random fraction of a step, so the kill lands anywhere: in the step, in the recorder's write,
    between steps, or before the first step."""
    rng = random.Random(seed)

    def act(run: Run) -> None:
        victim = rng.randrange(int(run_opts(run)["world"]))
        wait_for(lambda: (run.prog / f"pid-{victim}").exists() or run.proc.poll() is not None, what="ranks")  # type: ignore[union-attr]
        wait_steps(run, victim, rng.randrange(0, 30))
        time.sleep(rng.uniform(0.0, 0.01))
        (run.root / "victims").write_text(json.dumps([victim]))
        if victims == "one":
            os.kill(run.pid(victim), signal.SIGKILL)
        else:
            (run.root / "victims").write_text(json.dumps(list(range(int(run_opts(run)["world"])))))
            os.killpg(os.getpgid(run.pid(victim)), signal.SIGKILL)

    return act


_OPTS: dict[Path, dict[str, Any]] = {}


def run_opts(run: Run) -> dict[str, Any]:
    return _OPTS[run.root]


def run_scenario(root: Path, sc: Scenario, recorded: bool) -> Run:
    if recorded:
        run = start(root, recorded=True, record_args=sc.record_args, **sc.opts)
    else:
        run = start(root, recorded=False, env=sc.env, **sc.opts)
    _OPTS[root] = sc.opts
    if sc.act is not None:
        sc.act(run)
    finish(run)
    return run


KILL = {"world": 2, "steps": 200, "step_sleep": 0.01}
FAST = [
    Scenario("kill-one", KILL, 137, kill_rank_after(1, 3)),
    Scenario("kill-all", KILL, 137, kill_all_after(4)),
    Scenario("kill-random", {"world": 3, "steps": 60, "step_sleep": 0.004, "pg_timeout": 10}, (137, 143),
             random_kill(11, "one"), plain=False),
    Scenario("raise", {"world": 2, "steps": 12, "raise_at": "1:5"}, 1),
    # Rank 1 never joins step 4's all_reduce: rank 0's collective times out (the process group's
    # 3 s timeout), and the launcher then ends rank 1 with SIGTERM.
    Scenario("hang", {"world": 2, "steps": 12, "hang_at": "1:4", "pg_timeout": 3, "grace": 1}, 143),
    Scenario("sigint", {"world": 2, "steps": 400, "step_sleep": 0.01}, 130, signal_after(signal.SIGINT, 5)),
    Scenario("sigterm", {"world": 2, "steps": 400, "step_sleep": 0.01}, 143, signal_after(signal.SIGTERM, 5)),
    Scenario("max-bytes", {"world": 2, "steps": 30}, 0, record_args=("--max-bytes", "30000")),
]


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Run]]:
    """Run every fast scenario, plain and recorded, four at a time; name -> {"plain", "recorded"}."""
    root = tmp_path_factory.mktemp("faults")
    jobs = [(sc, rec) for sc in FAST for rec in (True, False) if rec or sc.plain]
    out: dict[str, dict[str, Run]] = {sc.name: {} for sc in FAST}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            pool.submit(run_scenario, root / sc.name / ("recorded" if rec else "plain"), sc, rec): (sc, rec)
            for sc, rec in jobs
        }
        for fut, (sc, rec) in futures.items():
            out[sc.name]["recorded" if rec else "plain"] = fut.result()
    return out


def scenario(ran: dict[str, dict[str, Run]], name: str) -> Run:
    """The recorded run of ``name``, after checking its exit code against the plain run's."""
    sc = next(s for s in FAST if s.name == name)
    rec = ran[name]["recorded"]
    expect = sc.expect if isinstance(sc.expect, tuple) else (sc.expect,)
    assert rec.code in expect, (rec.code, rec.stderr()[-3000:])
    if sc.plain:
        assert rec.code == ran[name]["plain"].code, (rec.code, ran[name]["plain"].code)
    return rec


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_sigkill_one_rank(ran: dict[str, dict[str, Run]], run_cli: Any) -> None:
    rec = scenario(ran, "kill-one")
    last = check_kept(rec, 2)
    assert_reports_loss(run_cli, rec, {1}, last)


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_sigkill_all_ranks(ran: dict[str, dict[str, Run]], run_cli: Any) -> None:
    # Without the recorder the launcher itself is killed (137); with it, `replay record` survives
    # the kill of its command's group and returns the same code.
    rec = scenario(ran, "kill-all")
    last = check_kept(rec, 2)
    assert_reports_loss(run_cli, rec, {0, 1}, last)


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_sigkill_at_a_random_moment(ran: dict[str, dict[str, Run]], run_cli: Any) -> None:
    rec = scenario(ran, "kill-random")
    check_trial(rec, run_cli, world=3, steps=60, stats=KillStats())


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_rank_raises_mid_step(ran: dict[str, dict[str, Run]], run_cli: Any) -> None:
    rec = scenario(ran, "raise")
    last = check_kept(rec, 2)
    assert last[1] == 5  # the step that raised is recorded, as raised
    with open_recording(rec.rec) as r:
        view = r["run-000"][1].step(5)
        assert not view.ok and "injected fault" in view.reason
    # Nothing was lost: every rank closed its file. verify says intact; info names the error.
    code, _, text = verify_json(run_cli, rec)
    assert code == 0, text
    info = run_cli("info", str(rec.rec))
    assert info.code == 0 and "rank 1 raised: ValueError: rank 1 raised at step 5" in info.out


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_hung_collective_ended_by_program_timeout(ran: dict[str, dict[str, Run]], run_cli: Any) -> None:
    rec = scenario(ran, "hang")
    last = check_kept(rec, 2)
    assert last == {0: 4, 1: 4}
    with open_recording(rec.rec) as r:
        assert "Timed out" in r["run-000"][0].step(4).reason
        assert not r["run-000"][1].step(4).ok  # ended by SIGTERM inside the step
    code, _, text = verify_json(run_cli, rec)
    assert code == 0, text


@pytest.mark.parametrize("name", ["sigint", "sigterm"])
@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_wrapper_interrupted(ran: dict[str, dict[str, Run]], run_cli: Any, name: str) -> None:
    rec = scenario(ran, name)
    last = check_kept(rec, 2)
    # The ranks ended on the signal, inside a step (recorded as raised), and each closed its
    # file: nothing was lost.
    assert all(v is not None and v < 399 for v in last.values()), last
    code, _, text = verify_json(run_cli, rec)
    assert code == 0, text


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_size_limit_stops_recording_not_the_program(ran: dict[str, dict[str, Run]], run_cli: Any) -> None:
    rec = scenario(ran, "max-bytes")
    assert all(len(rec.completed(r)) == 30 for r in (0, 1))
    assert rec.stderr().count("recording stopped on rank") == 2
    last = check_kept(rec, 2, stopped=True)
    assert all(v is not None and 0 < v < 29 for v in last.values()), last
    code, checks, text = verify_json(run_cli, rec)
    assert code == 4
    for rank in (0, 1):
        assert checks[rank]["state"] == "incomplete"
        assert any(f"recording stopped after step {last[rank]}" in p and "size limit" in p for p in checks[rank]["problems"]), checks[rank]
    assert "recording is incomplete" in text


@contextlib.contextmanager
def unwritable(path: Path) -> Iterator[None]:
    """``path`` (a directory) cannot be written, even by root (chattr +i), for the duration."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root without chattr +i: cannot make a directory unwritable")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_unwritable_output_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    with unwritable(ro):
        # The ranks cannot write there (as on a node whose ranks may not write where the launcher
        # could): each rank says so once and the program runs on, unrecorded, with its own code.
        env = child_environment(ro, RecordSettings(steps=[STEP], state="state"))
        inproc = start(tmp_path / "inproc", recorded=False, env=env, world=2, steps=8)
        # `replay record` itself cannot write there: one line, before anything runs.
        cmd = [sys.executable, "-m", "replay", "record", "--out", str(ro / "rec"), "--quiet", "--step", STEP, "--",
               *program(tmp_path / "wprog", world=2, steps=4)]
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
        assert finish(inproc) == 0
    assert r.returncode not in (0, 70), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("replay: error:") and str(ro / "rec") in lines[0], r.stderr
    assert not (tmp_path / "wprog").exists()  # the command was not started
    assert [len(inproc.completed(rank)) for rank in (0, 1)] == [8, 8]
    err = inproc.stderr()
    stopped = sorted(ln.split(":")[1].strip() for ln in err.splitlines() if "recording stopped on rank" in ln)
    assert stopped == ["recording stopped on rank 0", "recording stopped on rank 1"], err
    assert "Traceback" not in err


def test_info_while_recording(tmp_path: Path, run_cli: Any) -> None:
    """``replay info`` on a live recording: a consistent, growing view; the writer is undisturbed."""
    steps = 300  # 3 s at least: several looks at it even on a loaded machine
    run = start(tmp_path, recorded=True, world=2, steps=steps, step_sleep=0.01)
    wait_steps(run, 1, 2)
    seen: list[int] = []
    while run.proc.poll() is None:  # type: ignore[union-attr]
        before = [run.n_completed(rank) for rank in (0, 1)]
        # issue 15: read the rings after ``before`` and before info: a step in a ring then is
        # in the ring or the journal when info reads it.
        rings = {rank: _live_ring_steps(run, rank) for rank in (0, 1)}
        r = run_cli("info", "--json", str(run.rec))
        after = [run.n_completed(rank) for rank in (0, 1)]
        assert r.code == 0 and r.err == "", r.err
        ranks = {x["rank"]: x for x in r.json()["ranks"]}
        assert set(ranks) == {0, 1}
        for rank in (0, 1):
            n = ranks[rank]["steps"]
            # issue 15: a step is in the rank's record ring before the program logs it, and in
            # the journal once the drain moves it: journal and ring hold every logged step, and
            # the journal is at most one step ahead.
            ring = rings[rank]
            covered = max([n] + [s + 1 for s in ring])
            assert before[rank] <= covered and n <= after[rank] + 1, (rank, before, n, ring, after, ranks[rank], run.stderr()[-2000:])
            assert ranks[rank]["problem"] is None
        seen.append(sum(x["steps"] for x in ranks.values()))
        v = run_cli("verify", "--quick", str(run.rec))
        assert v.code == 0, v.out
        time.sleep(0.05)
    assert finish(run) == 0
    assert len(seen) >= 3 and seen == sorted(seen), seen
    assert check_kept(run, 2) == {0: steps - 1, 1: steps - 1}
    code, _, text = verify_json(run_cli, run)
    assert code == 0, text


def _live_ring_steps(run: Run, rank: int) -> list[int]:  # issue 15: the steps still in a rank's ring
    from replay.format.ring_salvage import live_ring_steps

    return [s for j in run.rec.glob(f"run-*/rank-{rank:05d}.journal") for s in live_ring_steps(j)]


# -- many kills (slow) ---------------------------------------------------------------------------


@dataclass
class KillStats:
    trials: int = 0
    completed_steps: int = 0
    kept_steps: int = 0
    lost_steps: int = 0
    codes: dict[str, int] = field(default_factory=dict)


def check_trial(run: Run, run_cli: Any, *, world: int, steps: int, stats: KillStats) -> None:
    """The checks of one random kill; adds its figures to ``stats``."""
    # The launcher's rule: the largest of its ranks' codes. A rank killed by SIGKILL gives 137;
    # its peers fail with a gloo error (1), or get SIGTERM (143) when stuck waiting for it.
    assert run.code in (137, 143), (run.code, run.stderr()[-2000:])
    stats.codes[str(run.code)] = stats.codes.get(str(run.code), 0) + 1
    completed = sum(len(run.completed(r)) for r in range(world))
    try:
        last = check_kept(run, world)
    except RecordingDamaged as e:
        # Killed before any rank started recording (the kill landed in the launcher's start-up):
        # nothing completed, and every command says so in one line.
        assert "nothing was recorded" in str(e) and completed == 0, e
        r = run_cli("verify", str(run.rec))
        assert r.code == 4 and len(r.err.strip().splitlines()) == 1 and "nothing was recorded" in r.err, r.err
        stats.trials += 1
        return
    kept = sum((v + 1) if v is not None else 0 for v in last.values())
    stats.trials += 1
    stats.completed_steps += completed
    stats.kept_steps += kept
    stats.lost_steps += max(0, completed - kept)
    victims = set(json.loads((run.root / "victims").read_text()))
    # A victim that had finished every step before the kill lost nothing.
    lost = {r for r in victims if not (last[r] == steps - 1 and len(run.completed(r)) == steps)}
    if lost:
        assert_reports_loss(run_cli, run, lost, last)


@pytest.mark.slow
@pytest.mark.parametrize("victims", ["one", "all"])
def test_sigkill_many_random_moments(tmp_path: Path, run_cli: Any, victims: str) -> None:
    trials = int(os.environ.get("REPLAY_FAULT_TRIALS", "40"))
    rng = random.Random(2024 if victims == "one" else 4048)
    stats = KillStats()
    lock = threading.Lock()

    plan = [(rng.choice([2, 3, 4]), rng.randrange(1 << 30)) for _ in range(trials)]  # reproducible

    def trial(i: int) -> None:
        world, seed = plan[i]
        sc = Scenario(f"t{i}", {"world": world, "steps": 60, "step_sleep": 0.004, "pg_timeout": 10}, (137, 143),
                      random_kill(seed, victims), plain=False)
        run = run_scenario(tmp_path / sc.name, sc, True)
        with lock:
            check_trial(run, run_cli, world=world, steps=60, stats=stats)
        shutil.rmtree(run.root, ignore_errors=True)

    with ThreadPoolExecutor(max_workers=3) as pool:
        for fut in [pool.submit(trial, i) for i in range(trials)]:
            fut.result()
    summary = {"victims": victims, **stats.__dict__}
    print(f"\nreplay faults: SIGKILL {victims}: {stats.trials} trials, {stats.completed_steps} completed steps, "
          f"{stats.kept_steps} kept, {stats.lost_steps} lost, exit codes {stats.codes}")
    if os.environ.get("REPLAY_FAULT_STATS"):
        path = Path(os.environ["REPLAY_FAULT_STATS"])
        data = json.loads(path.read_text()) if path.exists() else {}
        data[f"sigkill_{victims}"] = summary
        path.write_text(json.dumps(data, indent=2))
    assert stats.lost_steps == 0


def test_ignored_signals_stay_ignored(tmp_path: Path) -> None:
    """A command started with SIGINT ignored (a background job, nohup) still ignores it under
    `replay record`: the wrapper must not hand CMD a default disposition it did not have."""
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    cmd = [sys.executable, "-m", "replay", "record", "--out", str(tmp_path / "rec"), "--quiet", "--",
           sys.executable, "-c", probe]

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=ignore_sigint, timeout=TIMEOUT)
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, preexec_fn=ignore_sigint)
    assert r.returncode == plain.returncode == 0, r.stderr
    assert r.stdout.strip() == plain.stdout.strip() == "True"


_SIGTERM_PROGRAM = r"""
import os, signal, sys, threading, time
from replay.record import auto

LOCK = threading.RLock()  # as the recorder's: held by the main thread through a step's write

class SlowSession:
    # Like Session.shutdown: the first call takes the recorder and closes it (slowly here, as
    # on a loaded machine), under the recorder's lock; later calls find nothing and return.
    def __init__(self):
        self.taken = False
    def shutdown(self):
        if self.taken:
            return
        self.taken = True
        with LOCK:
            time.sleep(0.6)
            open(sys.argv[1], "w").write("end marker")

auto._close_on_sigterm(SlowSession())

MAIN = threading.main_thread().ident

def terms(n):
    for _ in range(n):
        time.sleep(0.2)
        signal.pthread_kill(MAIN, signal.SIGTERM)  # to the main thread, inside its wait

print("ready", flush=True)  # imports done: the parent times the shutdown from here
threading.Thread(target=terms, args=(int(sys.argv[2]),), daemon=True).start()
while True:
    with LOCK:  # a step waiting for its write, when the signal comes
        threading.Event().wait(0.05)
"""


@pytest.mark.parametrize("terms", [1, 2], ids=["one-sigterm", "wrapper-then-launcher"])
def test_sigterm_inside_a_step_writes_the_end_marker(tmp_path: Path, terms: int) -> None:
    """SIGTERM that lands while the step holds the recorder's lock (its wait for the write) ends
    the rank with its end marker written; so does a second SIGTERM (the wrapper forwards one, a
    launcher sends its ranks another) arriving while the first one's shutdown runs."""
    marker = tmp_path / "closed"
    p = subprocess.Popen([sys.executable, "-c", _SIGTERM_PROGRAM, str(marker), str(terms)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        # Timed from the end of the program's imports, which take seconds on a loaded machine:
        # a shutdown that waited for the lock would take the recorder's 10 s SIGTERM budget.
        ready = p.stdout.readline()
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert ready == "ready\n" and p.returncode == -signal.SIGTERM, err
    assert marker.exists(), "the rank died before its recorder closed"
    assert time.monotonic() - t0 < 8, "the shutdown waited for the step's lock"


# -- a full disk --------------------------------------------------------------------------------


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (needs root; the test is skipped otherwise)."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount command here")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here ({(r.stderr or r.stdout).strip()[:120]})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_full_disk_stops_recording_not_the_program(tmp_path: Path, run_cli: Any) -> None:
    """A real ENOSPC, on a filesystem that fills up mid-run: the program runs every step and
    exits as it would; each rank ends its journal with a `stopped` marker that names the full
    disk (the reserve beside each journal makes room for it); every step kept is whole and bit
    exact, and no partial frame or stray file is left."""
    with small_filesystem(tmp_path / "rec", "256k"):
        run = start(tmp_path, recorded=True, world=2, steps=200, width=64)
        assert finish(run) == 0, run.stderr()[-3000:]
        assert all(len(run.completed(r)) == 200 for r in (0, 1))
        assert run.stderr().count("No space left on device; the program goes on unrecorded") == 2, run.stderr()[-3000:]
        with open_recording(run.rec) as rec:
            part = next(iter(rec.values()))
            kept = []
            for rank in (0, 1):
                steps = part[rank].tables.steps["step"]
                assert steps.size < 200 and list(steps) == list(range(steps.size))
                kept.append(steps.size)
            # Which rank's drain gets the last free blocks is a race (a drain process that starts
            # late may find the disk already full): between them they kept steps.
            assert sum(kept) > 0, kept
        code, checks, text = verify_json(run_cli, run)
        assert code == 4, text
        for rank in (0, 1):
            assert checks[rank]["state"] == "incomplete", checks[rank]
            assert any("No space left on device" in p for p in checks[rank]["problems"]), checks[rank]
            assert not any("killed" in p or "cut short" in p for p in checks[rank]["problems"]), checks[rank]
        left = sorted(p.name for p in (run.rec / "run-000").iterdir())
        assert not [n for n in left if n.endswith((".tmp", ".reserve"))], left
        # A journal is kept only where sealing it did not fit on the full disk (the first rank to
        # seal may take the last blocks), and then the user is told it is kept and readable.
        for n in left:
            if n.endswith(".journal"):
                rank = int(n.split("-")[1].split(".")[0])
                told = re.search(rf"could not seal (run-000 )?rank {rank} \(.*its journal is kept and readable", run.stderr())
                assert told, (n, run.stderr()[-3000:])
        assert not [p.name for p in run.rec.iterdir() if p.name.endswith(".tmp")]


def test_a_write_cut_short_leaves_whole_frames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame or payload write that fails half-way (ENOSPC) is rolled back, so the frame written
    next (the end marker) is read; the reserve is freed on request and at close."""
    from replay.format import journal as jmod

    w = jmod.JournalWriter(tmp_path / "rank-00000.journal", tmp_path / "rank-00000.payload")
    assert w.reserve_path is not None and w.reserve_path.stat().st_size == jmod.RESERVE_BYTES
    w.write_frame(jmod.FrameKind.NOTE, {"step": 0, "message": "whole"})
    off = w.write_payloads([memoryview(b"x" * 100)])
    real_write, real_writev = os.write, os.writev

    def half_then_full(fd: int, data: Any) -> int:
        if len(data) > 4:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(28, "No space left on device")

    def writev_half(fd: int, views: list[memoryview]) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jmod.os, "write", half_then_full)
    with pytest.raises(OSError):
        w.write_frame(jmod.FrameKind.NOTE, {"step": 1, "message": "cut short" * 20})
    real_writev(w._pfd, [memoryview(b"partial")])  # as if writev had put part of its bytes down
    monkeypatch.setattr(jmod.os, "writev", writev_half)
    with pytest.raises(OSError):
        w.write_payloads([memoryview(b"y" * 50)])
    monkeypatch.setattr(jmod.os, "write", real_write)
    monkeypatch.setattr(jmod.os, "writev", real_writev)
    assert (tmp_path / "rank-00000.journal").stat().st_size == w.journal_size
    assert (tmp_path / "rank-00000.payload").stat().st_size == w.payload_size == off + 100
    w.release_reserve()
    assert not (tmp_path / "rank-00000.reserve").exists()
    w.write_frame(jmod.FrameKind.CLOSE, {"status": "stopped", "steps": 1}, over_budget=True)
    w.close()
    frames: list[Any] = []
    scan = jmod.scan_journal(tmp_path / "rank-00000.journal", frames.append)
    assert scan.problem is None
    assert [(f.kind, f.body.get("step")) for f in frames][-2:] == [(jmod.FrameKind.NOTE, 0), (jmod.FrameKind.CLOSE, None)]
