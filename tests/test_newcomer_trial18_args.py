"""Found in the twenty-fifth session's newcomer trials: a step's plain-container arguments and
``--repeat``'s verdict per output, each a test that failed before its fix. Nothing in the scripts
was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _record, _replay, _script

pytestmark = pytest.mark.e2e

# A paged-KV engine: a preallocated pool, and a block table (a dict of lists) and sequence lengths
# (a dict of ints) that the loop changes in place every step, passed to the model's forward.
_PAGED = """
    import torch, torch.nn as nn
    torch.manual_seed(0)
    V, D, BLK, NBLK = 32, 16, 2, 16
    class PagedModel(nn.Module):
        def __init__(self):
            super().__init__(); self.emb = nn.Embedding(V, D); self.kv = nn.Linear(D, D); self.out = nn.Linear(D, V)
        def forward(self, ids, pool, block_table, seq_lens):
            h = self.emb(ids)  # h: [B, D]
            kvn = self.kv(h)
            outs = []
            for b, rid in enumerate(sorted(block_table)):
                L, blocks = seq_lens[rid], block_table[rid]
                pool[blocks[L // BLK], L % BLK] = kvn[b]
                keys = pool[torch.tensor(blocks)].reshape(-1, D)[: L + 1]  # keys: [L + 1, D]
                outs.append(torch.softmax(keys @ h[b], 0) @ keys)
            return self.out(torch.stack(outs) + h)
    model = PagedModel().eval()
    pool = torch.zeros(NBLK, BLK, D)  # pool: [NBLK, BLK, D]
    free = list(range(NBLK))
    block_table = {r: [free.pop()] for r in range(2)}
    seq_lens = {r: 0 for r in range(2)}
    ids = torch.tensor([1, 5])
    with torch.no_grad():
        for i in range(6):
            for r in block_table:
                if seq_lens[r] // BLK >= len(block_table[r]):
                    block_table[r].append(free.pop())
            ids = model(ids, pool, block_table, seq_lens).argmax(-1)
            for r in seq_lens:
                seq_lens[r] += 1
"""


def test_a_dict_argument_the_loop_changes_in_place_is_named_at_record_time(tmp_path: Path) -> None:
    _script(tmp_path, "paged", _PAGED)
    p = _replay("record", "--out", tmp_path / "rec", "--keyframe-every", 4, "--", sys.executable, "paged.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # Before: no line at all (a dict's own contents were not fingerprinted, so it always looked
    # unchanged), and only `replay step` said later that the re-run used the program's objects.
    said = [line for line in p.stderr.splitlines() if "recorded by class name only" in line]
    assert said, p.stderr[-3000:]
    assert "block_table (a dict)" in said[0] and "seq_lens (a dict)" in said[0], said


# Logits are deterministic; the tokens come from a sampler seeded from the clock inside the step,
# which no repeat can set back. With a factory (re-run in this process) or without (re-launched).
_CLOCK_SAMPLER = """
    import random, time, torch, torch.nn as nn
    V, D = 32, 16
    class Model(nn.Module):
        def __init__(self):
            super().__init__(); torch.manual_seed(0); self.emb = nn.Embedding(V, D); self.head = nn.Linear(D, V)
        def forward(self, ids):
            logits = self.head(self.emb(ids))  # logits: [B, V]
            random.seed(time.time_ns())
            tokens = torch.tensor([random.randrange(1 << 30) % V for _ in range(ids.shape[0])])
            return {"logits": logits, "tokens": tokens}
    def build(config, *, rank=0, world_size=1, device="cpu", options=None): return Model().eval()
    if __name__ == "__main__":
        model = build({}); ids = torch.tensor([1, 2])
        with torch.no_grad():
            for i in range(6):
                ids = model(ids)["tokens"]
"""


@pytest.mark.parametrize("how", ["factory", "relaunch"])
def test_repeats_say_which_output_varied(tmp_path: Path, how: str) -> None:
    _script(tmp_path, "clock", _CLOCK_SAMPLER)
    flags = ("--factory", "clock:build") if how == "factory" else ()
    rec, _ = _record(tmp_path, "clock", *flags)
    # Before: "bits vary" on the logits row too, though only the tokens varied.
    p = _replay("step", rec, "--rank", 0, "--step", 3, "--repeat", 2, "--no-save", cwd=tmp_path)
    rows = {line.split()[1]: line for line in p.stdout.splitlines() if line.startswith("  eager  ")}
    assert "same bits" in rows["logits"] and "bits vary" in rows["tokens"], p.stdout
    p = _replay("step", rec, "--rank", 0, "--step", 3, "--repeat", 2, "--no-save", "--json", cwd=tmp_path)
    eager = json.loads(p.stdout)["modes"]["eager"]
    assert eager["repeats_equal"] is False, eager
    assert eager["repeats_equal_by_output"] == {"logits": True, "tokens": False}, eager
