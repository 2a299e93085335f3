"""Found by the ninth newcomer trial (issue 15's session 19), each a test that failed before its
fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _plain, _record, _replay, _script

pytestmark = pytest.mark.e2e


# An encoder-decoder decoded as ``generate()`` does it: the encoder called on its own once, then
# the whole model each step (which calls the decoder). The encoder and the decoder are one class
# with a flag (T5's ``T5Stack``), or two classes (BART's encoder and decoder).
_SEQ2SEQ = """
    import torch, torch.nn as nn
    torch.manual_seed(0)

    class Stack(nn.Module):
        def __init__(self, cross):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.mix = nn.Linear(16, 16)
            self.cross = nn.Linear(16, 16) if cross else None
        def forward(self, ids, memory=None):
            h = torch.tanh(self.mix(self.emb(ids)))
            if self.cross is not None:
                h = h + self.cross(memory.mean(1, keepdim=True))
            return {"last_hidden_state": h}

    class Decoder(Stack):
        pass

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Stack(False)
            self.decoder = DECODER(True)
            self.head = nn.Linear(16, 50)
        def forward(self, ids, memory):
            return self.head(self.decoder(ids, memory)["last_hidden_state"])

    model = Seq2Seq().eval()
    src = torch.randint(0, 50, (2, 7))
    ids = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        memory = model.encoder(src)["last_hidden_state"]
        for _ in range(6):
            logits = model(ids[:, -1:], memory)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    print(ids.tolist())
"""


@pytest.mark.parametrize("decoder", ["Stack", "Decoder"])
def test_an_encoder_run_once_before_the_loop_is_not_the_step(tmp_path: Path, decoder: str) -> None:
    """The first outermost module call was the encoder's, run once before the loop: the step is
    the model that holds it, called each step (before: the encoder's class was the step; with a
    decoder of its class, the decoder's calls were recorded and the re-launch took the encoder's
    call as the step's, 'not reproduced' with other weights; with a class of its own, nothing
    was recorded)."""
    _script(tmp_path, "s2s", _SEQ2SEQ.replace("DECODER", decoder))
    plain = _plain(tmp_path, "s2s")
    out, p = _record(tmp_path, "s2s")
    assert p.stdout == plain.stdout
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert [c["step"] for c in info["step_callables"]] == ["s2s:Seq2Seq"], info["step_callables"]
    assert info["ranks"][0]["steps"] == 5  # the first call revealed it
    summary = _replay("record", "--out", tmp_path / "again", "--", "python3", "s2s.py", cwd=tmp_path).stderr
    assert "which holds s2s:Stack" in summary, summary
    for step in (0, 4):
        r = _replay("step", out, "--rank", "0", "--step", step, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


# An HF-style output object: a dict of its own class, read by place (``encoder_outputs[0]``).
_MODEL_OUTPUT_ARG = """
    import collections
    import torch, torch.nn as nn
    torch.manual_seed(0)

    class Output(collections.OrderedDict):
        def __getitem__(self, k):
            return list(self.values())[k] if isinstance(k, int) else super().__getitem__(k)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.out = nn.Linear(16, 50)
        def forward(self, ids, encoder_outputs):
            return self.out(self.emb(ids) + encoder_outputs[0].mean(1, keepdim=True))

    model = Decoder().eval()
    enc = Output(last_hidden_state=torch.randn(2, 5, 16))
    ids = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(5):
            ids = model(ids, enc).argmax(-1)
    print(ids.tolist())
"""


def test_a_dict_of_its_own_class_is_given_back_as_that_class(tmp_path: Path) -> None:
    """A step argument that is a dict subclass read by place (an HF ``ModelOutput``'s
    ``encoder_outputs[0]``): the re-run gives the step the program's class with the recorded
    items (before: a plain dict, and the step raised KeyError: 0 in the re-run)."""
    _script(tmp_path, "mo", _MODEL_OUTPUT_ARG)
    out, _ = _record(tmp_path, "mo")
    r = _replay("step", out, "--rank", "0", "--step", "2", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


def test_a_re_launch_takes_the_call_of_the_recorded_model_not_another_instance(tmp_path: Path) -> None:
    """An encoder and a decoder of one class, each called at the top level: the encoder's one
    call revealed the step, the decoder's calls are what was recorded. The re-launched program
    calls the encoder first: that call runs as the program runs it, and the decoder's is taken
    (before: the encoder's call was taken as the step's, and the verdict was 'not reproduced'
    with other weights)."""
    _script(tmp_path, "pair", _SEQ2SEQ.replace("DECODER", "Stack").replace(
        "memory = model.encoder(src)", "memory = model.encoder(src)").replace(
        "logits = model(ids[:, -1:], memory)", "logits = model.head(model.decoder(ids[:, -1:], memory)['last_hidden_state'])"))
    out, _ = _record(tmp_path, "pair")
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert [c["step"] for c in info["step_callables"]] == ["pair:Stack"], info["step_callables"]
    assert info["ranks"][0]["steps"] == 6  # the decoder's calls, every one
    r = _replay("step", out, "--rank", "0", "--step", "3", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr
