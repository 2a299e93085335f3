"""Vocabulary that recording and re-running both use, below both (docs/architecture.md).

Nothing here imports ``record``, ``rerun`` or anything above them: the collective table, how a
step's outputs are named, what an nn.Module carries between steps, the random generators'
state, per-parameter weight digests, the target's Python scalar state, and how nested tensor
arguments (an HF ``past_key_values``) are flattened and rebuilt.
"""
