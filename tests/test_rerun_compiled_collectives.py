"""A tensor-parallel step recorded under torch.compile: its collectives ran inside the compiled
graph, so the recording holds none for it. A one-rank re-run that calls one
says so, rather than blaming the rebuilt target's code path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replay.errors import RerunError
from replay.format.reader import Recording
from replay.rerun.collectives import RecordedCollectives


def _two_ranks_no_collectives(tmp_path: Path) -> Path:
    from replay.record.config import RecorderConfig
    from replay.record.recorder import Recorder

    out = tmp_path / "rec"
    for r in range(2):
        rec = Recorder(RecorderConfig(out=out, part="run-000", rank=r, world_size=2))
        rec.set_target({"step": "m:decode", "step_kind": "compiled"})
        rec.begin_step()
        rec.record_inputs(x=torch.ones(2))
        rec.record_outputs(logits=torch.ones(1, 3))
        rec.end_step()
        rec.close()
    return out


@pytest.mark.parametrize("compiled, says", [
    (True, "ran compiled on 2 ranks, and collectives inside a compiled graph are not recorded"),
    (False, "does not follow the recorded code path"),
])
def test_a_collective_the_recording_lacks_is_explained(tmp_path: Path, compiled: bool, says: str) -> None:
    with Recording(_two_ranks_no_collectives(tmp_path)) as r:
        c = RecordedCollectives(r["run-000"][1], 1, 2, recorded_compiled=compiled)
        c.begin_step(0)
        with pytest.raises(RerunError, match=says):
            c._next("all_reduce", [torch.ones(2)])  # noqa: SLF001 - what a patched all_reduce calls first
