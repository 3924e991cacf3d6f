"""The built-in reference families: a target and its two drafters, trained and shipped together.

``small`` is the default: on a CPU its verified rows cost almost nothing beside the fixed cost
of a forward, as on an accelerator at low load, so wide verification is free and adaptivity must
lose nothing. ``large`` is twice as wide with half the layers: its matrix products dominate a
forward once a batch holds a few dozen rows, as on an accelerator at high load, so every verified
row costs and trimming unlikely ones pays.
"""

from dataclasses import dataclass

from adaspec.models.drafters import DSparkConfig, MtpConfig
from adaspec.models.target import TargetConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    name: str
    folder: str
    """Subfolder of the weights package holding its checkpoints and model card."""
    target: TargetConfig
    mtp: MtpConfig
    dspark: DSparkConfig
    target_steps: int
    """Training steps of the target (the drafters' steps are ``draft_steps``)."""
    draft_steps: int


FAMILIES: dict[str, Family] = {
    "small": Family(name="small", folder=".", target=TargetConfig(), mtp=MtpConfig(),
                    dspark=DSparkConfig(), target_steps=700, draft_steps=800),
    "large": Family(name="large", folder="large",
                    target=TargetConfig(hidden_size=256, num_layers=4, num_heads=4,
                                        mlp_hidden=1024),
                    mtp=MtpConfig(num_heads=4, mlp_hidden=1024),
                    dspark=DSparkConfig(mlp_hidden=1024),
                    # Fewer steps than the small family: a step costs about four times as
                    # much on two cores, and the regime needs realistic acceptance, not the
                    # best loss.
                    target_steps=350, draft_steps=300),
}
DEFAULT_FAMILY = "small"


def family_of(target: TargetConfig) -> str | None:
    """The family whose target has this configuration, if any."""
    return next((name for name, found in FAMILIES.items() if found.target == target), None)


def family(name: str) -> Family:
    found = FAMILIES.get(name)
    if found is None:
        raise ValueError(f"reference family {name!r}: expected one of {', '.join(FAMILIES)}")
    return found
