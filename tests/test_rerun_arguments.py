"""A re-run hands the step its recorded arguments as the program did: nested tensor containers (an
HF ``past_key_values``: a tuple of per-layer ``(k, v)`` tuples, ``None`` holes) rebuilt with their
recorded structure, and outputs named as the recording named them (an older recording's
``out{i}``). In-process, no program launched."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from replay.core.outputs import name_outputs
from replay.core.structure import STRUCTURE_ARG, flatten_tensors, rebuild_inputs
from replay.format.reader import Recording
from replay.rerun.runner import RerunOptions, _named_outputs, rerun_step
from replay.rerun.target import StepKind, Target, TargetSpec


def hf_step(input_ids: torch.Tensor, past_key_values: Any = None) -> tuple[torch.Tensor, Any]:
    """An HF-style step: refuses anything but the tuple of tuples it was given when recorded."""
    if not isinstance(past_key_values, tuple) or past_key_values[1] is not None or not isinstance(past_key_values[0], tuple):
        raise TypeError(f"past_key_values is a {type(past_key_values).__name__}, not the recorded tuple")
    k, v = past_key_values[0]
    total = input_ids.float().sum() + (2 * k + v).sum()
    return torch.stack([total, total + 1]).reshape(1, 2), past_key_values


def test_structure_round_trip_keeps_tuples_lists_dicts_and_none_holes() -> None:
    value = ((torch.ones(2), torch.zeros(2)), None, [torch.full((1,), 3.0)], {"a": torch.ones(1)})
    flat, structure = flatten_tensors("pkv", value)
    assert sorted(flat) == ["pkv.0.0", "pkv.0.1", "pkv.2.0", "pkv.3.a"]
    back = rebuild_inputs(flat, {"pkv": structure})["pkv"]
    assert isinstance(back, tuple) and isinstance(back[0], tuple) and back[1] is None
    assert isinstance(back[2], list) and isinstance(back[3], dict) and torch.equal(back[0][0], value[0][0])
    # Without a structure, one level as before: digit keys make a list.
    assert isinstance(rebuild_inputs({"x.0": torch.ones(1), "x.1": torch.ones(1)})["x"], list)


def test_record_calls_reexports_the_structure_helpers() -> None:
    from replay.record import calls

    assert calls.rebuild_inputs is rebuild_inputs and calls.STRUCTURE_ARG == STRUCTURE_ARG


def _recording(tmp_path: Path, *, legacy_names: bool = False) -> Path:
    from replay.record.calls import split_arguments
    from replay.record.config import RecorderConfig
    from replay.record.recorder import Recorder

    out = tmp_path / "rec"
    rec = Recorder(RecorderConfig(out=out, part="run-000", rank=0, world_size=1))
    rec.set_target({"step": "m:hf_step", "step_kind": "function"})
    for s in range(3):
        past = ((torch.full((2,), float(s)), torch.ones(2)), None)
        bound = inspect.signature(hf_step).bind(torch.tensor([s]), past_key_values=past)
        tensors, scalars = split_arguments(bound, skip_first=False)
        assert STRUCTURE_ARG in scalars
        rec.begin_step()
        rec.record_inputs(**tensors)
        rec.record_args(**scalars)
        out_value = hf_step(torch.tensor([s]), past)
        # A recording made before tuples' logits were named: positional names.
        rec.record_outputs(**(name_outputs(out_value, ("out0", "out1")) if legacy_names else name_outputs(out_value, ())))
        rec.end_step()
    rec.close()
    return out


def _rerun(rec_path: Path, step: int) -> Any:
    with Recording(rec_path) as r:
        part = r["run-000"]
        spec = TargetSpec.from_rank_file(part[0])
        settings = RerunOptions(modes=("eager",), device="cpu", spec=spec,
                                make_target=lambda rp: Target(spec, None, hf_step, "cpu", kind=StepKind.FUNCTION))
        return rerun_step(part, 0, step, settings)


@pytest.mark.parametrize("legacy_names", [False, True])
def test_nested_cache_arguments_rerun_bit_for_bit(tmp_path: Path, legacy_names: bool) -> None:
    result = _rerun(_recording(tmp_path, legacy_names=legacy_names), 2)
    run = result.modes["eager"]
    assert run.error is None and run.departed is None, (run.error, run.departed)
    name = "out0" if legacy_names else "logits"
    # The cache the step hands back is a small container: its tensors are outputs too.
    assert set(run.vs_recording) == {name, "out1.0.0", "out1.0.1"}, set(run.vs_recording)
    assert all(c.equal for c in run.vs_recording.values())


def test_outputs_fall_back_to_positional_names_only_for_a_recording_that_has_them() -> None:
    out = (torch.ones(1, 4), (torch.ones(2),))
    # (the tuple inside is a small container: its tensor is an output, out1.0, in every naming)
    assert set(_named_outputs(out, (), {"output.logits": 1})) == {"logits", "out1.0"}
    assert set(_named_outputs(out, (), {"output.out0": 1})) == {"out0", "out1.0"}
    assert set(_named_outputs(out, (), {})) == {"logits", "out1.0"}
    assert set(_named_outputs(out, ("a",), {"output.out0": 1})) == {"a", "out1.0"}  # names given: as given
