"""`replay.record.settings`: what `replay record` tells every process it starts, from the command
line and `[tool.replay]`, checked where it enters."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.record import settings as S
from replay.record.settings import RecordSettings, load_pyproject_settings


def test_round_trip_through_the_environment_keeps_every_field() -> None:
    s = RecordSettings(steps=["pkg.engine:Engine.step"], state="state_tensors", keyframe_every=4, ring=0,
                       collectives="full", probes=["pkg.layers:attn"], output_names=["logits", "tokens"])
    assert RecordSettings.from_env(s.to_env()) == s


def test_a_newer_recorder_s_unknown_field_is_ignored_by_an_older_process() -> None:
    text = RecordSettings(ring=3).to_env().replace('"ring": 3', '"ring": 3, "from_the_future": 1')
    assert RecordSettings.from_env(text).ring == 3


def test_command_line_overrides_pyproject_and_lists_add_up() -> None:
    base = RecordSettings(steps=["a:f"], ring=16, state="s")
    m = base.merged(steps=["b:g", "a:f"], ring=0, state=None, probes=[], keyframe_every=None)
    assert m.steps == ["a:f", "b:g"]  # added, once each, in order
    assert m.ring == 0  # 0 given on the command line is a value, not "not given"
    assert m.state == "s" and m.keyframe_every == 50  # None / empty: not given


@pytest.mark.parametrize("bad", [{"steps": ["no_colon"]}, {"probes": ["x"]}, {"keyframe_every": -1}, {"ring": -2}, {"profile": "mpt"}],
                         ids=["step", "probe", "keyframe", "ring", "profile"])
def test_bad_values_are_refused_where_they_enter(bad: dict) -> None:
    with pytest.raises(ValueError):
        RecordSettings(**bad)


def test_pyproject_nearest_table_with_hyphenated_keys(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.replay]\nsteps = ["outer:f"]\n')
    inner = tmp_path / "pkg" / "sub"
    inner.mkdir(parents=True)
    (tmp_path / "pkg" / "pyproject.toml").write_text('[tool.replay]\nkeyframe-every = 7\nstate = "kv"\n')
    assert load_pyproject_settings(inner) == {"keyframe_every": 7, "state": "kv"}  # the nearest file only
    assert load_pyproject_settings(tmp_path) == {"steps": ["outer:f"]}
    assert RecordSettings(**load_pyproject_settings(inner)).keyframe_every == 7


def test_pyproject_without_a_table_or_with_unknown_keys(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert load_pyproject_settings(tmp_path) == {}
    (tmp_path / "pyproject.toml").write_text('[tool.replay]\nkeyframes = 3\n')
    with pytest.raises(ValueError, match="unknown \\[tool.replay\\] keys: keyframes"):
        load_pyproject_settings(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool.replay\n')
    with pytest.raises(ValueError, match="cannot read"):
        load_pyproject_settings(tmp_path)


def test_current_reads_what_replay_record_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(S.ENV_DIR, raising=False)
    monkeypatch.delenv(S.ENV_SETTINGS, raising=False)
    assert S.current() is None
    monkeypatch.setenv(S.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(S.ENV_SETTINGS, RecordSettings(ring=5).to_env())
    got = S.current()
    assert got is not None and got[0] == tmp_path and got[1].ring == 5


@pytest.mark.parametrize("bad", [{"record_ring_mib": -1}, {"ring_full": "wait"}, {"record_ring_mib": "64"}],
                         ids=["negative", "policy", "type"])
def test_record_ring_settings_are_checked_where_they_enter(bad: dict) -> None:
    with pytest.raises(ValueError):
        RecordSettings(**bad)


def test_record_ring_settings_from_pyproject_reach_the_recorder(tmp_path: Path) -> None:
    """issue 15: [tool.replay] record-ring-mib / ring-full, then the command line, down to the
    recorder's config (0 MiB: no ring, the writer-thread path)."""
    from replay.record.session import Session

    (tmp_path / "pyproject.toml").write_text('[tool.replay]\nrecord-ring-mib = 8\nring-full = "drop"\n')
    s = RecordSettings(**load_pyproject_settings(tmp_path))
    assert (s.record_ring_mib, s.ring_full) == (8, "drop")
    assert s.merged(record_ring_mib=0, ring_full=None).record_ring_mib == 0  # 0 given is a value
    session = Session(tmp_path / "rec", s)
    try:
        rec = session.ensure_recorder()
        assert rec is not None and rec.config.record_ring_bytes == 8 << 20 and rec.config.ring_full == "drop"
        assert rec.ring_stats()["policy"] == "drop"
    finally:
        session.shutdown()


# -- one RecordConfig from the command line, [tool.replay] and the environment to the recorder --


def test_replay_record_and_the_direct_recorder_share_one_set_of_defaults(tmp_path: Path) -> None:
    from dataclasses import fields

    from replay import RecorderConfig
    from replay.record.config import RecordConfig

    direct, default = RecorderConfig(out=tmp_path), RecordConfig()
    assert RecordSettings is RecordConfig  # the former name
    for f in fields(RecordConfig):
        assert getattr(direct, f.name) == getattr(default, f.name), f.name
    assert (default.keyframe_every, default.ring, default.record_ring_bytes) == (50, 16, 64 << 20)


def test_every_field_reaches_the_recorder_unchanged(tmp_path: Path) -> None:
    """[tool.replay] may set any field, the recorder's knobs too; the session's recorder gets them all."""
    from dataclasses import fields

    from replay.record.config import RecordConfig
    from replay.record.session import Session

    (tmp_path / "pyproject.toml").write_text(
        '[tool.replay]\noutputs = "full"\nqueue-depth = 7\ndrain-lag-s = 0.5\nrng = false\nkeyframe-every = 3\n'
        'record-ring-mib = 0\ntoken-outputs = ["toks"]\nsteps = ["m:f"]\n')
    s = RecordSettings.from_env(RecordSettings(**load_pyproject_settings(tmp_path)).merged(ring=2).to_env())
    assert (s.outputs, s.queue_depth, s.drain_lag_s, s.rng, s.ring, s.token_outputs) == ("full", 7, 0.5, False, 2, ("toks",))
    session = Session(tmp_path / "rec", s)
    try:
        rec = session.ensure_recorder()
        assert rec is not None and rec.config.rank == 0 and rec.config.out == tmp_path / "rec"
        assert {f.name: getattr(rec.config, f.name) for f in fields(RecordConfig)} == \
               {f.name: getattr(s, f.name) for f in fields(RecordConfig)}
    finally:
        session.shutdown()


def test_pyproject_outputs_as_a_list_are_output_names(tmp_path: Path) -> None:
    from replay.record.profiles import StepSpec

    (tmp_path / "pyproject.toml").write_text('[tool.replay]\noutputs = ["logits", "tokens"]\nstate = "kv"\n')
    s = RecordSettings(**load_pyproject_settings(tmp_path))
    assert (s.output_names, s.outputs) == (["logits", "tokens"], "digest")
    spec = StepSpec.from_config("m:f", s, kind="function")
    assert (spec.step, spec.state, spec.outputs, spec.kind) == ("m:f", "kv", ("logits", "tokens"), "function")


@pytest.mark.parametrize("bad", [{"outputs": "some"}, {"queue_depth": 0}, {"rank": 2}, {"part": "../x"}, {"rng": 1},
                                 {"drain_lag_s": -1.0}, {"token_outputs": [1]}],
                         ids=["outputs", "queue", "rank", "part", "rng", "lag", "tokens"])
def test_the_direct_recorder_config_is_checked_the_same_way(tmp_path: Path, bad: dict) -> None:
    from replay import RecorderConfig

    with pytest.raises(ValueError):
        RecorderConfig(out=tmp_path, **bad)
