"""Reference target and draft models, the protocols the runtime consumes, shipped weights.

Engines plug their own models in by implementing ``TargetModel`` and ``MtpDrafter`` or
``DSparkDrafter`` (see ``protocols`` and docs/embedding.md), each with an ``identity`` from
``checkpoint_identity``; ``load_reference_models()`` gives the small trained models shipped
with the package, which need no download.
"""

from adaspec.models.checkpoint import (
    ReferenceModels,
    checkpoint_identity,
    load_model_card,
    load_reference_models,
)
from adaspec.models.protocols import (
    ContextRows,
    DrafterContext,
    DSparkBlock,
    DSparkDrafter,
    ModelSet,
    MtpDrafter,
    MtpStep,
    PrefillOutput,
    TargetModel,
    TargetOutput,
    VerifyRows,
)

__all__ = [
    "ContextRows",
    "DSparkBlock",
    "DSparkDrafter",
    "DrafterContext",
    "ModelSet",
    "MtpDrafter",
    "MtpStep",
    "PrefillOutput",
    "ReferenceModels",
    "TargetModel",
    "TargetOutput",
    "VerifyRows",
    "checkpoint_identity",
    "load_model_card",
    "load_reference_models",
]
