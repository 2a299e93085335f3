"""Built-in profiles: how ``replay record`` finds the steps, state and graphs of known engines.

A profile is data only (names of callables and attributes, as strings): the core never imports
the engine it describes. With ``--profile auto`` (the default) every profile is armed and comes
into force when its trigger module is imported by the recorded program.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replay.record.config import RecordConfig

__all__ = ["StepSpec", "Profile", "PROFILES"]


@dataclass(kw_only=True, slots=True, frozen=True)
class StepSpec:
    """One step callable and how to reach the rest of its target from the step's object.

    Separate from ``RecordConfig``: a profile names several steps, each with its own state,
    factory, ...; a step named on the command line or in ``[tool.replay]`` takes them from the
    config (``from_config``)."""

    step: str
    state: str | None = None
    config: str | None = None
    factory: str | None = None
    tuner: str | None = None
    run_info: str | None = None
    modules: str | None = None
    outputs: tuple[str, ...] = ()
    profile: str | None = None
    kind: str = ""
    """``function``, ``method``, ``module_forward`` or ``compiled``: set when the step is wrapped."""

    @classmethod
    def from_config(cls, step: str, config: RecordConfig, *, kind: str = "") -> StepSpec:
        """The step ``step`` with what ``config`` says about the target (``--state``, ...)."""
        return cls(step=step, state=config.state, config=config.config, factory=config.factory, tuner=config.tuner,
                   run_info=config.run_info, modules=config.modules, outputs=tuple(config.output_names), kind=kind)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "state": self.state,
            "config": self.config,
            "factory": self.factory,
            "tuner": self.tuner,
            "run_info": self.run_info,
            "modules": self.modules,
            "outputs": list(self.outputs),
            "profile": self.profile,
        }


@dataclass(kw_only=True, slots=True, frozen=True)
class Profile:
    name: str
    trigger: str  # the module whose import brings the profile into force
    steps: tuple[StepSpec, ...]
    graph_capture: tuple[str, ...] = ()
    graph_replay: tuple[str, ...] = ()
    probes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Callables inside a step whose outputs are recorded as fields: (target, output names)."""
    description: str = ""
    toggles_doc: dict[str, str] = field(default_factory=dict)


_MTP = "replay.workloads.mtp"

PROFILES: dict[str, Profile] = {
    "mtp": Profile(
        name="mtp",
        trigger=f"{_MTP}.engine",
        description="the reference MTP speculative-decoding engine (replay.workloads.mtp)",
        steps=(
            StepSpec(
                step=f"{_MTP}.engine:Engine.decode_step",
                state="state_tensors",
                config="replay_config",
                factory=f"{_MTP}.factory:build_engine",
                tuner="tuner_choices",
                run_info="last_run_info",
                modules="model",
                profile="mtp",
            ),
        ),
        graph_capture=(f"{_MTP}.graphs:GraphRunner.capture",),
        graph_replay=(f"{_MTP}.graphs:GraphRunner.replay",),
        # Greedy acceptance runs before the lockstep check that raises on drift: probing it
        # records the tokens each rank computed at the step where they first disagree.
        probes=((f"{_MTP}.engine:Engine.accept", ("tokens", "accepted")),),
    ),
}
