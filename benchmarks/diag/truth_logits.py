"""Diagnosis (issue 14, H200): the logits digests of tinyllm's compiled decode step as the program
computes them without the recorder. Usage: python truth_logits.py ENGINE_DIR generate-args..."""
import json
import sys

import torch

sys.path.insert(0, sys.argv[1])
from replay.digest import digest  # noqa: E402

real = torch.compile
seen = []


def compile(fn=None, **kw):
    c = real(fn, **kw)

    def wrapped(*a, **k):
        out = c(*a, **k)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seen.append([f"{digest(t.detach().cpu()):016x}" for t in out])
        return out

    return wrapped


torch.compile = compile
import generate  # noqa: E402

generate.main(sys.argv[2:])
print("TRUTH " + json.dumps(seen))
