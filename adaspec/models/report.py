"""What ``adaspec models`` reports about the shipped reference models.

Identities and parameter counts are computed from the installed weights; quality figures come
from the model card, measured by the training script on the full held-out split. ``measure``
re-measures acceptance live on the packaged held-out excerpt, a smaller sample.
"""

import json
from importlib import resources
from typing import Any

import numpy as np

from adaspec.models.checkpoint import (
    ReferenceModels,
    load_model_card,
    load_reference_models,
    shipped_folder,
)
from adaspec.models.families import family_of
from adaspec.models.quality import BATCH, acceptance_summary, sample_contexts, trace_contexts

DATA_PACKAGE = "adaspec.models.data"


def heldout_excerpt() -> dict[str, str]:
    """domain -> about 8 KiB of held-out evaluation text shipped with the package."""
    text = resources.files(DATA_PACKAGE).joinpath("heldout_excerpt.json").read_text()
    excerpt: dict[str, str] = json.loads(text)
    return excerpt


def models_report(models: ReferenceModels | None = None,
                  card: dict[str, object] | None = None) -> dict[str, object]:
    """Identities and sizes of ``models`` (default: the small family) beside the quality
    figures of their model card (default: the card of the family their target belongs to)."""
    models = models or load_reference_models()
    if card is None:
        name = family_of(models.target.config)
        if name is None:
            raise ValueError("these models belong to no built-in family: pass their card")
        card = load_model_card(shipped_folder(name))
    # Every identity, not the target's alone: retraining the drafters (--reuse_target)
    # keeps the target, and a run stopped before its card is written leaves the old card.
    for name in ("target", "mtp", "dspark"):
        described = card["models"][name]["identity"]  # type: ignore[index]
        found = getattr(models, name).identity
        if described != found:
            raise ValueError(f"the model card describes {name} {described}, not the models' "
                             f"{found}: pass the card written with these models")
    described = {}
    for name, module in (("target", models.target), ("mtp", models.mtp),
                         ("dspark", models.dspark)):
        described[name] = {
            "identity": module.identity,
            "parameters": sum(p.numel() for p in module.parameters()),
            "config": module.config.as_dict(),
        }
    described["target"]["context_limit"] = models.target.context_limit
    return {
        "models": described,
        "quality": card["quality"],
        "quality_source": "model card: measured by python -m adaspec.models.train on the "
                          "held-out evaluation split",
        "corpus": card["corpus"],
    }


def measure_excerpt(models: ReferenceModels, contexts_per_domain: int = 32, width: int = 7,
                    seed: int = 0) -> dict[str, dict[str, object]]:
    """Greedy acceptance of both drafters on the shipped excerpt, per domain."""
    rng = np.random.default_rng(seed)
    models.target.allocate(BATCH)
    models.mtp.allocate(BATCH)
    result: dict[str, dict[str, object]] = {}
    for domain, text in heldout_excerpt().items():
        contexts = sample_contexts(text.encode(), contexts_per_domain, width,
                                   models.target.context_limit, rng)
        traces = trace_contexts(models.target, models.mtp, models.dspark, contexts, width)
        result[domain] = {name: acceptance_summary(trace.greedy_accept)
                          for name, trace in traces.items()}
    return result


def _row(label: str, values: list[float]) -> str:
    return f"  {label:28}" + " ".join(f"{v:6.3f}" for v in values)


def format_report(report: dict[str, Any]) -> str:
    """A terminal summary of ``models_report`` (acceptance length counts the bonus token)."""
    models, quality = report["models"], report["quality"]
    lines = [f"{report['model']} and its drafts", ""] if "model" in report else []
    lines.append("model    identity                          parameters")
    for name, info in models.items():
        lines.append(f"{name:8} {info['identity']}  {info['parameters']:>10,}")
    losses = quality["target"]["heldout_loss_nats_per_byte"]
    lines += ["", "target held-out loss (nats/byte): "
              + ", ".join(f"{d} {v:.3f}" for d, v in losses.items()), "",
              "prefix acceptance by position (width 7); AL = accepted + 1 (residual or bonus)"]
    for name in ("mtp", "dspark"):
        for temp in ("temperature_0", "temperature_1"):
            figures = quality[name][temp]
            lines.append(_row(f"{name} {temp.replace('_', ' ')}", figures["prefix"])
                         + f"   AL {figures['acceptance_length']:.3f}")
    continued = {name: quality[name]["own_continuations"]["temperature_0"]
                 for name in ("mtp", "dspark") if "own_continuations" in quality[name]}
    if continued:  # cards written before continuations were measured lack the entry
        lines += ["", "inside the target's own greedy continuations"]
        for name, figures in continued.items():
            lines.append(_row(f"{name} temperature 0", figures["prefix"])
                         + f"   AL {figures['acceptance_length']:.3f}")
    confidence = quality["dspark"]["confidence"]
    lines += ["", f"dspark confidence: prefix-survival ECE {confidence['ece_before_scaling']:.4f}"
                  f" before scaling, {confidence['ece_after_scaling']:.4f} after; "
                  f"AUC {confidence['auc_prefix_survival']}"]
    cost = report.get("drafter_cost")
    if isinstance(cost, dict):
        ms = cost["ms"]
        lines += ["", f"drafter cost at one request ({cost['threads']} torch thread(s), fastest "
                      f"of interleaved rounds): target step {ms['target_step']:.3f} ms, verify "
                      f"of {cost['width'] + 1} rows {ms['target_verify']:.3f} ms",
                  f"  dspark block of {cost['width']}: {ms['dspark_block']:.3f} ms = "
                  f"{cost['dspark_over_target_verify']:.3f} of that verify, "
                  f"{cost['dspark_over_target_step']:.3f} of a target step",
                  f"  mtp step: {ms['mtp_step']:.3f} ms = "
                  f"{cost['mtp_step_over_target_verify']:.3f} of that verify, "
                  f"{cost['mtp_step_over_target_step']:.3f} of a target step"]
    measured = report.get("measured_on_excerpt")
    if isinstance(measured, dict):
        lines += ["", "re-measured on the packaged excerpt (temperature 0, prefix acceptance)"]
        for domain, by_drafter in measured.items():
            for name, figures in by_drafter.items():
                lines.append(_row(f"{domain} {name}", figures["prefix"])
                             + f"   AL {figures['acceptance_length']:.3f}")
    return "\n".join(lines)
