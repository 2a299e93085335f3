"""A module whose forward calls its base class's forward (``super().forward(x)``,
``Base.forward(self, x)``), recorded with no flags and re-run by re-launching the program: the
step is the outermost forward on the recorded object, not the base's inside it. Before, the
re-launch skipped the call the recording missed (discovery's first), then took the base's
forward inside the next call (same name, ``self`` of the recorded class) and failed, exit 7,
"cannot find the function of Child.forward in the re-launched program". A class that inherits
forward without defining its own is still taken at the base's frame, which is its step's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROGRAM = textwrap.dedent("""
    import torch, torch.nn as nn
    torch.set_num_threads(1)

    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x)

    class Mid(Base):
        def forward(self, x):
            return super().forward(x) + 1

    {child}

    torch.manual_seed(0)
    m = Child().eval()
    x = torch.ones(1, 16)
    with torch.no_grad():
        for _ in range(5):
            x = m(x).tanh()
    print("%.6f" % float(x.sum()))
""")

_CHILDREN = {
    "super": "class Child(Base):\n    def forward(self, x):\n        return super().forward(x) * 2",
    "base_forward": "class Child(Base):\n    def forward(self, x):\n        return Base.forward(self, x) * 2",
    # Inherits forward: the step's frame is the base class's forward.
    "inherits": "class Child(Base):\n    pass",
    # Inherits a forward that calls its own base's: the outer one (Mid's) is the step.
    "inherits_super": "class Child(Mid):\n    pass",
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _replay(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=180)


@pytest.mark.e2e
@pytest.mark.parametrize("child", sorted(_CHILDREN))
def test_a_forward_calling_its_base_forward_is_re_run(tmp_path, child):
    (tmp_path / "engine.py").write_text(_PROGRAM.replace("{child}", _CHILDREN[child]))
    rec = _replay("record", "--quiet", "--out", "rec", "--", sys.executable, "engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stdout + rec.stderr
    r = _replay("step", "rec", "--step", "2", "--no-save", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("reproduced:"), r.stdout + r.stderr
