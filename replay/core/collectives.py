"""The collectives replay knows: their tensor arguments, and whether every rank receives the same bits.

The recorder wraps these (``replay.record.collectives``) and a re-run answers them from the
recording (``replay.rerun.collectives``); both read the table from here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COLLECTIVES", "CollectiveSpec", "FUNCTIONAL", "FUNCTIONAL_PREFIX"]


@dataclass(frozen=True, slots=True)
class CollectiveSpec:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    compare: bool  # every rank of the group receives the same bits


COLLECTIVES: dict[str, CollectiveSpec] = {
    "all_reduce": CollectiveSpec(("tensor",), ("tensor",), True),
    "broadcast": CollectiveSpec(("tensor",), ("tensor",), True),
    "all_gather": CollectiveSpec(("tensor",), ("tensor_list",), True),
    "all_gather_into_tensor": CollectiveSpec(("input_tensor",), ("output_tensor",), True),
    "reduce": CollectiveSpec(("tensor",), ("tensor",), False),
    "reduce_scatter": CollectiveSpec(("input_list",), ("output",), False),
    "reduce_scatter_tensor": CollectiveSpec(("input",), ("output",), False),
    "all_to_all_single": CollectiveSpec(("input",), ("output",), False),
    "all_to_all": CollectiveSpec(("input_tensor_list",), ("output_tensor_list",), False),
    "gather": CollectiveSpec(("tensor",), ("gather_list",), False),
    "scatter": CollectiveSpec(("scatter_list",), ("tensor",), False),
    "send": CollectiveSpec(("tensor",), (), False),
    "recv": CollectiveSpec((), ("tensor",), False),
    "barrier": CollectiveSpec((), (), False),
}


# torch's functional collectives (``torch.distributed._functional_collectives``), which DTensor and
# ``torch.distributed.tensor.parallel`` call instead of the API above: out of place, the output
# returned (maybe as an AsyncCollectiveTensor to wait on). Recorded as ``funcol.<name>``.
# name -> every rank of the group receives the same bits. Names missing from a torch version are
# skipped; a name that calls another (all_gather_tensor -> all_gather_single) is recorded once.
FUNCTIONAL_PREFIX = "funcol."
FUNCTIONAL: dict[str, bool] = {
    "all_reduce": True,
    "all_gather_tensor": True,
    "all_gather_single": True,
    "broadcast": True,
    "reduce_scatter_tensor": False,
    "reduce_scatter_single": False,
    "all_to_all_single": False,
    "permute_tensor": False,
    "all_reduce_coalesced": True,
    "all_gather_into_tensor_coalesced": True,
    "reduce_scatter_tensor_coalesced": False,
}
