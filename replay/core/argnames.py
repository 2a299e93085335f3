"""The reserved keys of a step's recorded arguments (its ``args`` JSON text), in a module without
torch: ``replay info`` reads them, and it imports no torch."""

from __future__ import annotations

__all__ = ["STRUCTURE_ARG", "POSITIONAL_ARG", "UNRECORDED_ARG"]

# The recorded arguments' reserved key holding the shape of nested tensor arguments.
STRUCTURE_ARG = "__structure__"
# The recorded arguments' reserved key naming, in order, the arguments a re-run passes by
# position (``*args`` items as ``args.0``, ``args.1``, ...); absent when keywords do.
POSITIONAL_ARG = "__positional__"
# The step argument naming the tensors a step gave the recorder that it could not record
# (``unrecordable``: a nested or sparse output), ``{"outputs.parts": "nested tensor"}``; a
# re-run says they were not compared, ``info`` names them.
UNRECORDED_ARG = "__unrecorded__"
