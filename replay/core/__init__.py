"""Vocabulary that recording and re-running both use, below both (docs/architecture.md).

Nothing here imports ``record``, ``rerun`` or anything above them: the collective table, how a
step's outputs are named, what an nn.Module carries between steps, the random generators'
state, per-parameter weight digests, and the target's Python scalar state.
"""
