"""The training corpus of the built-in trained model (issue 29): the running interpreter's own
standard library, which every machine with Python has.

Selection rule (deterministic for one interpreter build): every `*.py` file under
`sysconfig.get_paths()["stdlib"]`, except anything under `site-packages`, `dist-packages`, a
directory named `test`, `tests`, `idle_test` or `__pycache__`; files that are not valid UTF-8 or
larger than `max_bytes` are skipped. Files are taken in the order of their POSIX relative paths.

Split: by file, so no function is seen in training and held out at once. A file is held out when
the first 8 hex digits of sha256(relative path) read as an integer fall below `heldout` x 2^32
(5% by default): the split depends only on the path, not on the file list.

License: the CPython standard library is distributed under the Python Software Foundation License
Version 2 (PSF-2.0), which permits use and redistribution; a model trained on it ships with that
notice (`LICENSE_NOTE`).

`Corpus.manifest()` records the interpreter version, the rule's parameters, file and byte counts
of each split and the sha256 of the concatenated text of each split, so a training result names
exactly what it learned from.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
SEPARATOR = "\n\n"  # between files in a split's text
LICENSE_NOTE = ("Trained on the CPython standard library (Python Software Foundation License Version 2, "
                "PSF-2.0): https://docs.python.org/3/license.html")


@dataclass(frozen=True)
class CorpusFile:
    path: str  # POSIX path relative to the stdlib root
    text: str


def held_out(rel_path: str, share: float) -> bool:
    """Whether `rel_path` belongs to the held-out split (stable: a function of the path only)."""
    h = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16)
    return h < share * 2**32


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def select(root: Path | None = None, max_bytes: int = 400_000, max_files: int | None = None) -> list[CorpusFile]:
    """The selected files in path order (see the module docstring); max_files keeps the first n
    (the CPU smoke mode)."""
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or not p.is_file() or p.stat().st_size > max_bytes:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(CorpusFile(rel.as_posix(), text))
        if max_files is not None and len(out) >= max_files:
            break
    return out


@dataclass
class Corpus:
    """The train and held-out splits of the selected files."""

    train: list[CorpusFile] = field(default_factory=list)
    heldout: list[CorpusFile] = field(default_factory=list)
    share: float = 0.05
    max_bytes: int = 400_000

    @classmethod
    def build(cls, root: Path | None = None, share: float = 0.05, max_bytes: int = 400_000,
              max_files: int | None = None) -> "Corpus":
        if not 0.0 < share < 1.0:
            raise ValueError(f"heldout share must be in (0, 1), got {share}")
        corpus = cls(share=share, max_bytes=max_bytes)
        for f in select(root, max_bytes, max_files):
            (corpus.heldout if held_out(f.path, share) else corpus.train).append(f)
        if not corpus.train or not corpus.heldout:
            raise ValueError(f"the corpus split is empty ({len(corpus.train)} train, {len(corpus.heldout)} held-out "
                             "files); select more files")
        return corpus

    @staticmethod
    def text(files: list[CorpusFile]) -> str:
        return SEPARATOR.join(f.text for f in files)

    def manifest(self) -> dict:
        def split(files: list[CorpusFile]) -> dict:
            text = self.text(files)
            return {"files": len(files), "bytes": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest()}

        return {"source": "CPython standard library of the running interpreter", "python": sys.version.split()[0],
                "rule": {"glob": "*.py", "skip_dirs": sorted(SKIP_DIRS), "max_bytes": self.max_bytes,
                         "heldout_share": self.share, "split": "sha256(relative path)[:8] < share * 2^32"},
                "license": LICENSE_NOTE, "train": split(self.train), "heldout": split(self.heldout)}
