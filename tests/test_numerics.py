"""replay.numerics: capture, digest, apply/restore and differences of a step's numerics context."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from replay import numerics


def test_capture_is_json_safe_and_digest_stable() -> None:
    ctx = numerics.capture()
    assert json.loads(json.dumps(ctx)) == ctx
    for key in ("grad_enabled", "inference_mode", "autocast.cpu.enabled", "sdpa.flash", "sdpa.math",
                "backends.cudnn.allow_tf32", "backends.cuda.matmul.allow_tf32", "backends.float32_matmul_precision",
                "deterministic.enabled", "deterministic.warn_only", "default_dtype", "env.CUBLAS_WORKSPACE_CONFIG", "env.NCCL_ALGO"):
        assert key in ctx
    assert numerics.context_digest(ctx) == numerics.context_digest(dict(reversed(list(ctx.items()))))
    assert len(numerics.context_digest(ctx)) == 16


def test_sdpa_kernel_context_is_captured_as_its_flags() -> None:
    outside = numerics.capture()
    with sdpa_kernel(SDPBackend.MATH):
        inside = numerics.capture()
    assert inside["sdpa.math"] is True and inside["sdpa.flash"] is False and inside["sdpa.mem_efficient"] is False
    lines = numerics.differences(inside, outside)
    assert "sdpa.flash: recorded false, now true" in lines
    assert numerics.context_digest(inside) != numerics.context_digest(outside)


def test_modes_and_env_are_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.inference_mode():
        assert numerics.capture()["inference_mode"] is True
    with torch.no_grad():
        assert numerics.capture()["grad_enabled"] is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = numerics.capture()
        assert c["autocast.cpu.enabled"] is True and c["autocast.cpu.dtype"] == "torch.bfloat16"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert numerics.capture()["env.CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert numerics.capture()["env.CUBLAS_WORKSPACE_CONFIG"] is None


def test_apply_sets_everything_and_restores() -> None:
    before = numerics.capture()
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("high")
        os.environ["NCCL_PROTO"] = "LL"
        try:
            recorded = numerics.capture()
        finally:
            torch.use_deterministic_algorithms(False)
            torch.set_float32_matmul_precision("highest")
            os.environ.pop("NCCL_PROTO")
    assert numerics.differences(recorded, numerics.capture())  # they differ now
    with numerics.apply(recorded) as failed:
        assert failed == []
        assert numerics.differences(recorded, numerics.capture()) == []
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert os.environ["NCCL_PROTO"] == "LL"
        assert not torch.is_grad_enabled()
    assert numerics.differences(before, numerics.capture()) == []
    assert "NCCL_PROTO" not in os.environ


def test_apply_enters_inference_mode() -> None:
    with torch.inference_mode():
        recorded = numerics.capture()
    with numerics.apply(recorded):
        assert torch.is_inference_mode_enabled()
        assert torch.zeros(1).is_inference()
    assert not torch.is_inference_mode_enabled()


def test_current_detects_changes_cheaply() -> None:
    d1, c1, _ = numerics.current()
    d2, _, changed = numerics.current()
    assert d1 == d2 and not changed
    with sdpa_kernel(SDPBackend.MATH):
        d3, c3, changed = numerics.current()
        assert changed and d3 != d1 and c3["sdpa.flash"] is False
    d4, _, changed = numerics.current()
    assert changed and d4 == d1


def test_differences_names_unknown_settings() -> None:
    assert numerics.differences({"sdpa.new_backend": True}, {}) == ["sdpa.new_backend: recorded true, not known to this torch"]
    assert numerics.strip_reserved({"__numerics__": "ab", "__stream__": "draft", "pos": 3}) == {"pos": 3}


def test_the_per_step_read_equals_each_setting_read_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``current`` reads every setting through its raw C reader in one pass; the context it
    builds must be what each setting's own (safe, JSON-form) getter says, also when one reader
    refuses (a build that raises for a legacy flag): that one reads as None, the rest as before."""
    with torch.autocast("cpu", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.MATH):
        expected = {s.name: s.get() for s in numerics.SETTINGS}
        got = numerics.capture()
        assert {k: got[k] for k in expected} == expected
        assert got["autocast.cpu.dtype"] == "torch.bfloat16" and got["default_dtype"] == "torch.float32"
        json.dumps(got)  # JSON-safe: dtypes and tuples in their recorded forms

        def refuses() -> bool:
            raise RuntimeError("this build refuses the legacy flag")

        i = next(i for i, s in enumerate(numerics.SETTINGS) if s.name == "backends.cuda.matmul.allow_tf32")
        monkeypatch.setattr(numerics, "_READS", (*numerics._READS[:i], refuses, *numerics._READS[i + 1:]))
        refused = numerics.capture()
        assert refused["backends.cuda.matmul.allow_tf32"] is None
        assert {k: v for k, v in refused.items() if k != "backends.cuda.matmul.allow_tf32"} == \
               {k: v for k, v in got.items() if k != "backends.cuda.matmul.allow_tf32"}


def test_a_reader_returning_another_shape_reads_as_none_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch before 2.10 returns one bool for the cuBLAS fp16/bf16 reduced-precision pair, which
    the recorded form (a list) does not take: that setting reads as None, and the context is
    still read (an error here would stop recording at the first step and every re-run)."""
    name = "backends.cuda.matmul.allow_fp16_reduced_precision_reduction"
    i = next(i for i, s in enumerate(numerics.SETTINGS) if s.name == name)
    monkeypatch.setattr(numerics, "_READS", (*numerics._READS[:i], lambda: True, *numerics._READS[i + 1:]))
    monkeypatch.setattr(numerics, "_cache", numerics._Cache())
    got = numerics.capture()
    assert got[name] is None and got["grad_enabled"] is torch.is_grad_enabled()
    digest, ctx, _ = numerics.current()
    assert ctx[name] is None and len(digest) == 16
    setting = numerics.SETTINGS[i]
    monkeypatch.setattr(numerics, "SETTINGS", (*numerics.SETTINGS[:i], numerics.Setting(name, lambda: True, setting.set, setting.form),
                                               *numerics.SETTINGS[i + 1:]))
    assert numerics.SETTINGS[i].get() is None


def test_a_reader_refusing_every_step_is_read_every_step_and_only_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that refuses one setting at every step: that setting reads as None each time, its
    reader is still asked each time (a refusal may end), and the others stay on the one-pass
    read (the refusing reader is not called twice a step)."""
    calls = []

    def refuses() -> bool:
        calls.append(1)
        raise RuntimeError("mixed legacy and new TF32 settings")

    i = next(i for i, s in enumerate(numerics.SETTINGS) if s.name == "backends.cuda.matmul.allow_tf32")
    monkeypatch.setattr(numerics, "_READS", (*numerics._READS[:i], refuses, *numerics._READS[i + 1:]))
    assert numerics.capture()["backends.cuda.matmul.allow_tf32"] is None
    first = len(calls)  # the one-pass read, then each reader on its own
    for n in range(1, 4):
        assert numerics.capture()["backends.cuda.matmul.allow_tf32"] is None
        assert len(calls) == first + n


def test_flush_denormal_is_captured_and_set_back() -> None:
    """torch.set_flush_denormal has no getter; one rank that set it computed otherwise, and
    "numerics the same" was said without it ever being compared."""
    assert numerics.capture()["flush_denormal"] is False
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        recorded = numerics.capture()
    finally:
        torch.set_flush_denormal(False)
    assert recorded["flush_denormal"] is True
    assert any("flush_denormal" in str(d) for d in numerics.differences(recorded, numerics.capture()))
    with numerics.apply(recorded) as failed:
        assert failed == [] and numerics.capture()["flush_denormal"] is True
        assert 1e-310 * float(os.environ.get("ONE", "1")) == 0.0  # denormals flushed, as recorded
    assert numerics.capture()["flush_denormal"] is False
