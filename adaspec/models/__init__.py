"""Reference target and draft models, the protocols the runtime consumes, shipped weights.

Engines plug their own models in by implementing ``TargetModel`` and ``MtpDrafter`` or
``DSparkDrafter`` (see ``protocols``); ``load_reference_models()`` gives the small trained
models shipped with the package, which need no download.
"""

from adaspec.models.checkpoint import ReferenceModels, load_model_card, load_reference_models
from adaspec.models.protocols import (
    DSparkBlock,
    DSparkDrafter,
    MtpDrafter,
    MtpStep,
    PrefillOutput,
    TargetModel,
    TargetOutput,
    VerifyRows,
)

__all__ = [
    "DSparkBlock",
    "DSparkDrafter",
    "MtpDrafter",
    "MtpStep",
    "PrefillOutput",
    "ReferenceModels",
    "TargetModel",
    "TargetOutput",
    "VerifyRows",
    "load_model_card",
    "load_reference_models",
]
