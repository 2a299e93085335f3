"""Which environment variables a recording keeps (as digests) to name a difference later."""

from __future__ import annotations

from replay.core.environment import env_differences, env_digests


def test_a_program_s_own_replay_named_variable_is_kept_and_replay_s_are_not() -> None:
    kept = env_digests({"REPLAY_BUG": "1", "REPLAY_RECORD_DIR": "/tmp/x", "REPLAY_RERUN": "1", "REPLAY_DEBUG": "1"})
    assert sorted(kept) == ["REPLAY_BUG"]


def test_a_variable_torch_sets_inside_the_re_run_is_not_named_and_a_user_s_inductor_setting_is() -> None:
    recorded = env_digests({"TORCHINDUCTOR_FREEZING": "1"})
    now = {"TORCHINDUCTOR_FREEZING": "0", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "1"}
    assert env_differences(recorded, now) == ["TORCHINDUCTOR_FREEZING (another value here)"]
