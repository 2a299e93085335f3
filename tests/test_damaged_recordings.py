"""Damaged recordings get one line and exit 4 from every command, never a verdict (the eighth
newcomer trial, issue 15): stored bytes that no longer match their digest, a rank file whose
unread tables changed after it was sealed, and directories that are no recording at all.

Most tests damage copies of a small recording made in this process with ``Recorder``; those
that re-run a step record a plain script with ``replay record`` and are marked e2e.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from replay import Recorder, RecorderConfig
from replay.errors import RecordingDamaged, RerunError
from replay.format.reader import Recording
from replay.format.schema import TensorKind

DAMAGED = RecordingDamaged.exit_code


def _record(out: Path, *, ranks: int = 1, steps: int = 6, crashed: int | None = None) -> Path:
    """A small sealed recording: inputs and a state keyframe stored in full, logits in the ring.
    ``crashed``: that rank is left as its journal, unsealed, as a killed rank leaves it."""
    for r in range(ranks):
        state = {"kv": torch.zeros(64, 1024)}  # 256 KiB: a keyframe large enough to be hashed once
        rec = Recorder(RecorderConfig(out=out, part="run-000", rank=r, world_size=ranks, keyframe_every=2, ring=4,
                                      inputs="full"), state_fn=lambda: state)
        for s in range(steps):
            rec.begin_step()
            rec.record_inputs(tokens=torch.tensor([[s + 1]]), hidden=torch.full((2, 8), float(s)))
            logits = torch.arange(16, dtype=torch.float32).reshape(1, 16) * (s + 1)
            state["kv"] += 1
            rec.record_outputs(logits=logits, tokens=logits.argmax(-1))
            rec.end_step()
        if r == crashed:
            assert rec.drain()
            kept = {ext: (out / "run-000" / f"rank-{r:05d}.{ext}").read_bytes() for ext in ("journal", "payload")}
        rec.close()
        assert rec.error is None, rec.error
        if r == crashed:
            for ext in ("h5", "sig"):
                (out / "run-000" / f"rank-{r:05d}.{ext}").unlink(missing_ok=True)
            for ext, data in kept.items():
                (out / "run-000" / f"rank-{r:05d}.{ext}").write_bytes(data)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp("damaged") / "rec")


@pytest.fixture(scope="module")
def base2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp("damaged2") / "rec", ranks=2)


def _copy(base: Path, tmp: Path, name: str = "case") -> Path:
    dst = tmp / name
    shutil.copytree(base, dst)
    return dst


def _row(rec: Path, kind: TensorKind, name: str, step: int, rank: int = 0) -> np.void:
    with Recording(rec) as r:
        t = r["run-000"][rank].full()
        for row in t.tensors:
            if (int(row["kind"]), t.string(int(row["name"])), int(row["step"])) == (int(kind), name, step):
                assert int(row["offset"]) >= 0 and int(row["nbytes"]) > 0
                return row
    raise AssertionError(f"no stored {kind.name} {name!r} of step {step}")


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(len(data))
        assert old != data
        f.seek(at)
        f.write(data)


def _damage_payload(rec: Path, kind: TensorKind, name: str, step: int, rank: int = 0) -> None:
    row = _row(rec, kind, name, step, rank)
    _overwrite(rec / "run-000" / f"rank-{rank:05d}.payload", int(row["offset"]), b"\x5a" * min(4, int(row["nbytes"])))


def _one_line(res, code: int = DAMAGED) -> str:
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert res.code == code, (res.code, res.out, res.err)
    assert "Traceback" not in res.err + res.out and len(lines) == 1, res.err
    return lines[0]


# -- 1. stored bytes that no longer match their digest ---------------------------------------


@pytest.mark.parametrize("kind, name, step", [
    pytest.param(TensorKind.INPUT, "tokens", 3, id="input"),
    pytest.param(TensorKind.LOGITS, "logits", 2, id="logits-ring"),
    pytest.param(TensorKind.STATE, "kv", 2, id="keyframe"),
])
def test_a_tensor_whose_bytes_changed_is_damage_when_read(base: Path, tmp_path: Path, kind: TensorKind, name: str,
                                                          step: int) -> None:
    """Inputs a re-run feeds, logits it compares with and keyframes it restores are all read by
    ``read_tensor``: changed bytes are damage naming the tensor and step, never data."""
    rec = _copy(base, tmp_path)
    _damage_payload(rec, kind, name, step)

    def read(rf, at: int) -> object:
        return rf.keyframe(at) if kind == TensorKind.STATE else rf.step(at).tensors(kind)

    with Recording(rec) as r:
        rf = r["run-000"][0]
        with pytest.raises(RecordingDamaged) as e:
            read(rf, step)
        # A RerunError too: a re-run reading a catch-up step's inputs stops on it instead of
        # taking it as the program's step raising (and then suggesting --keyframe-every 1).
        assert isinstance(e.value, RerunError) and e.value.exit_code == DAMAGED
        msg = str(e.value)
        assert f"tensor {name!r} of step {step}" in msg and "damaged" in msg and "replay verify" in msg, msg
        read(rf, step - 1)  # the others read as before


def test_verify_still_lists_every_damaged_tensor(base: Path, tmp_path: Path, run_cli) -> None:
    rec = _copy(base, tmp_path)
    _damage_payload(rec, TensorKind.INPUT, "tokens", 1)
    _damage_payload(rec, TensorKind.INPUT, "hidden", 4)
    res = run_cli("verify", "--json", rec)
    assert res.code == DAMAGED
    problems = res.json()["ranks"][0]["problems"]
    assert any("'tokens' of step 1" in p for p in problems) and any("'hidden' of step 4" in p for p in problems), problems


def test_a_large_stored_tensor_is_hashed_once(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check costs one digest per tensor read; a keyframe read again is not hashed again."""
    from replay.format import reader

    calls: list[int] = []
    real = reader.digest_bytes
    monkeypatch.setattr(reader, "digest_bytes", lambda data: calls.append(len(data)) or real(data))
    with Recording(base) as r:
        rf = r["run-000"][0]
        rf.keyframe(3)
        n = len(calls)
        assert n >= 1
        rf.keyframe(3)
        assert len(calls) == n  # the keyframe again: not hashed again
        rf.step(2).inputs
        assert len(calls) == n + 2  # step 2's two inputs, one digest each


# -- 2. a rank file changed after sealing, in a table `info` does not load -------------------


def _h5(rec: Path, rank: int = 0) -> Path:
    return rec / "run-000" / f"rank-{rank:05d}.h5"


def _header_of(path: Path, table: str) -> int:
    with h5py.File(path, "r") as f:
        addr = getattr(h5py.h5o.get_info(f[table].id), "addr", None)
    if addr is None:
        pytest.skip("this h5py does not give object header addresses")
    return int(addr)


def _chunk_of(path: Path, table: str) -> int:
    with h5py.File(path, "r") as f:
        return int(f[table].id.get_chunk_info(0).byte_offset)


@pytest.mark.parametrize("where", ["header", "chunk"])
def test_a_rank_file_changed_after_sealing_is_damage_for_every_command(base: Path, base2: Path, tmp_path: Path, run_cli,
                                                                       where: str) -> None:
    """16 bytes overwritten in the object header of /collectives, or in the data of /tensors:
    tables `info` never loaded. Every command that opens the recording says what `step` and
    `verify` say, exit 4, rather than reading it as fine (the trial's bad/rec_corrupt)."""
    want = "metadata checksum" if where == "header" else "checksum does not match"

    def damage(rec: Path, rank: int) -> None:
        h5 = _h5(rec, rank)
        at = _header_of(h5, "collectives") + 40 if where == "header" else _chunk_of(h5, "tensors") + 200
        _overwrite(h5, at, b"X" * 16)

    # Two ranks, one damaged: `info` and `report` show the other, name this one, exit 4; the
    # commands that need every rank say the damage in one line.
    rec = _copy(base2, tmp_path, "two")
    damage(rec, 1)
    res = run_cli("verify", "--json", rec)
    assert res.code == DAMAGED and want in json.dumps(res.json()), res.out
    for argv in (["info", rec], ["report", rec, "-o", tmp_path / "r2.html"]):
        res = run_cli(*argv)
        assert res.code == DAMAGED and "rank 1 cannot be read" in res.err, (argv, res.code, res.err)
    for argv in (["diff", rec, base2], ["diff", base2, rec], ["bisect", "steps", rec, "--no-save"]):
        line = _one_line(run_cli(*argv))
        assert want in line and "rank-00001.h5" in line, (argv, line)
    # One rank, damaged: nothing to show, and why in one line.
    rec = _copy(base, tmp_path, "one")
    damage(rec, 0)
    for argv in (["info", rec], ["report", rec, "-o", tmp_path / "r1.html"], ["diff", rec, base],
                 ["bisect", "steps", rec, "--no-save"], ["seal", rec]):
        line = _one_line(run_cli(*argv))
        assert want in line and "rank-00000.h5" in line, (argv, line)
        res = run_cli(*argv, "--json")
        assert res.code == DAMAGED and res.json()["kind"] == "error", (argv, res.out)


def test_an_intact_rank_file_still_opens(base2: Path, run_cli, tmp_path: Path) -> None:
    assert run_cli("info", base2).code == 0
    assert run_cli("diff", base2, base2).code == 0
    assert run_cli("seal", base2).code == 0


# -- 3 and 4. directories that are not recordings: bisect steps and seal ---------------------


def _not_recordings(base: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    """Each as the trial made it: (path, what the other commands say of it)."""
    empty = tmp / "emptydir"
    empty.mkdir()
    text = _copy(base, tmp, "rec_text")
    _h5(text).write_text("this is not hdf5\n")
    trunc = _copy(base, tmp, "rec_trunc")
    data = _h5(trunc).read_bytes()
    _h5(trunc).write_bytes(data[: len(data) // 2])
    unrelated = _copy(base, tmp, "rec_unrelated")
    _h5(unrelated).unlink()
    with h5py.File(_h5(unrelated), "w") as f:
        f["x"] = np.arange(10)
    return {"emptydir": (empty, "not a recording"), "rec_text": (text, "not an HDF5 file"),
            "rec_trunc": (trunc, "truncated"), "rec_unrelated": (unrelated, "not a replay rank file")}


def test_bisect_steps_says_a_recording_is_damaged_not_too_few_ranks(base: Path, tmp_path: Path, run_cli) -> None:
    for name, (path, says) in _not_recordings(base, tmp_path).items():
        line = _one_line(run_cli("bisect", "steps", path, "--no-save"))
        assert says in line and "two or more" not in line, (name, line)
        res = run_cli("bisect", "steps", path, "--no-save", "--json")
        assert res.code == DAMAGED and res.json()["kind"] == "error" and says in res.json()["error"], (name, res.out)


def test_seal_says_a_directory_is_not_a_recording_or_damaged(base: Path, tmp_path: Path, run_cli) -> None:
    for name, (path, says) in _not_recordings(base, tmp_path).items():
        before = sorted((p.name, p.stat().st_size) for p in path.rglob("*"))
        line = _one_line(run_cli("seal", path))
        assert says in line and "nothing to seal" not in line, (name, line)
        res = run_cli("seal", path, "--json")
        assert res.code == DAMAGED and res.json() == {"kind": "error", "error": res.json()["error"], "exit_code": DAMAGED}
        assert says in res.json()["error"], (name, res.out)
        assert sorted((p.name, p.stat().st_size) for p in path.rglob("*")) == before, "seal changed what it read"


def test_seal_seals_what_it_can_and_names_a_damaged_rank_file(tmp_path: Path, run_cli) -> None:
    """Rank 0 left as a journal, rank 1 sealed and then damaged: rank 0 is sealed, and the exit
    is 4 with one line naming rank 1 (it is not "every rank file is sealed")."""
    rec = _record(tmp_path / "rec", ranks=2, crashed=0)
    assert (rec / "run-000" / "rank-00000.journal").exists() and not _h5(rec, 0).exists()
    _h5(rec, 1).write_text("not hdf5 any more\n")
    res = run_cli("seal", "--json", rec)
    assert res.code == DAMAGED, (res.code, res.out, res.err)
    data = res.json()
    assert [(r["rank"], r["error"]) for r in data["sealed"]] == [(0, None)], data
    assert [(u["rank"], "not an HDF5 file" in u["problem"]) for u in data["unreadable_ranks"]] == [(1, True)], data
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and "rank 1" in lines[0] and "not an HDF5 file" in lines[0], res.err
    assert _h5(rec, 0).exists()
    assert run_cli("info", rec).code == DAMAGED  # rank 0 shown, rank 1 left out


def test_seal_of_an_intact_recording_has_nothing_to_seal(base: Path, run_cli) -> None:
    res = run_cli("seal", base)
    assert res.code == 0 and res.out.startswith("nothing to seal"), res.out


# -- 1, end to end: `replay step` on a recorded plain script ----------------------------------

_LOOP = """
    import torch
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.head = torch.nn.Linear(16, 32)
            self.register_buffer("k", torch.zeros(1, 16, 16))

        def forward(self, tok, pos):
            h = self.emb(tok)
            self.k[:, pos] = h[:, -1]
            return self.head(h + self.k[:, : pos + 1].mean(1, keepdim=True))

    m = Tiny().eval()
    tok = torch.tensor([[1]])
    with torch.no_grad():
        for i in range(8):
            tok = m(tok, i)[:, -1:].argmax(-1)
    print("done")
"""


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.test_newcomer_scripts import _record, _script

    tmp = tmp_path_factory.mktemp("damaged-e2e")
    _script(tmp, "loop", _LOOP)
    out, _ = _record(tmp, "loop")
    return tmp, out


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["input", "logits", "keyframe"])
def test_step_on_damaged_payload_says_damaged_not_a_verdict(recorded: tuple[Path, Path], tmp_path: Path,
                                                             case: str) -> None:
    """The trial's bad/rec_tok, rec_logit and rec_kv: before, `step` said the step departed,
    was different or departed at step 0 (exit 0 or 7); now the damage, exit 4."""
    from tests.test_newcomer_scripts import _replay

    tmp, base_rec = recorded
    rec = _copy(base_rec, tmp_path)
    with Recording(rec) as r:
        t = r["run-000"][0].full()
        names = {(int(row["kind"]), int(row["step"])): t.string(int(row["name"])) for row in t.tensors}
    kind, at, run = {"input": (TensorKind.INPUT, 3, 5), "logits": (TensorKind.LOGITS, 3, 3),
                     "keyframe": (TensorKind.STATE, 0, 2)}[case]
    name = names[(int(kind), at)]
    _damage_payload(rec, kind, name, at)
    p = _replay("step", rec, "--step", run, "--no-save", cwd=tmp)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("replay: error:")]
    assert p.returncode == DAMAGED and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stdout, p.stderr)
    assert f"tensor {name!r} of step {at}" in lines[0] and "damaged" in lines[0], lines[0]
    assert "keyframe-every" not in p.stderr and "departed" not in p.stdout + p.stderr
    p = _replay("step", rec, "--step", run, "--no-save", "--json", cwd=tmp)
    assert p.returncode == DAMAGED and json.loads(p.stdout)["kind"] == "error", p.stdout


@pytest.mark.e2e
def test_step_on_an_intact_recording_still_reproduces(recorded: tuple[Path, Path]) -> None:
    from tests.test_newcomer_scripts import _replay

    tmp, rec = recorded
    p = _replay("step", rec, "--step", 5, "--no-save", cwd=tmp)
    assert p.returncode == 0 and p.stdout.startswith("reproduced"), (p.stdout, p.stderr)
