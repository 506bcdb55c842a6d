"""torchtitan's Llama 3 training as torch runs it and as ported to shardwise.

torchtitan's own files are not kept here: ``prepare(variant, dest, torchtitan)`` copies the 12 of
``COPIED`` from an installed torchtitan 0.2.2 (``installed_torchtitan(python)`` finds it, the
package folder of the interpreter's ``torchtitan``), checks each against the hash the torchtitan
wheel's ``RECORD`` lists, and writes them beside this folder's own files: tiny stand-ins for the
infrastructure they import (config parsing, tokenizers, activation checkpointing...) and
``train_llama.py``, the per-rank program. The copies need only torch (the stand-ins replace what
else they import), so any interpreter with torch runs the result. The CPU substitution is in
the stand-in ``torchtitan/tools/utils.py`` (torchtitan's ``device_type``), so no copied line
changes. ``dest`` gets the files as they are for ``"torch"``, with
``tests/pytorch_programs/port.py``'s import rewrite for ``"shardwise"``.

``python tests/torchtitan_programs/titan_harness.py [NPROC]`` runs the single-device reference, then
both variants under ``python -m shardwise.launch --nproc NPROC`` (default 4, dp=NPROC/2 x
tp=2) and prints every run's losses (summed over dp as torchtitan logs them). torchtitan is
looked up in ``SHARDWISE_LIBRARY_PYTHON`` (``scripts/library_venv.sh`` makes a venv with it),
else in this interpreter.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"

# path -> the sha256 torchtitan-0.2.2-py3-none-any.whl's RECORD gives it (urlsafe base64)
COPIED: dict[str, str] = {
    "torchtitan/components/loss.py": "xESEG2iPD-4xxRKw0eLakIgNmybUkN3fly153-OxBSQ",
    "torchtitan/config/job_config.py": "7EBuP2m52tNsC4qb-jZQbWeluq0ZuATyTSJYcV-zXZ4",
    "torchtitan/distributed/__init__.py": "noanmAKnH6Ufym5lExvfEsZEGFbDYfyQ-GYfJul44Y4",
    "torchtitan/distributed/parallel_dims.py": "RS-o8KB0G19o8-oHECUsb-QFmnl4ILe8h5PxYNDdnLE",
    "torchtitan/distributed/tensor_parallel.py": "haDJQkhwt7do67YoHS2JSWakA--FCuLKcgbkV2BEXxE",
    "torchtitan/models/__init__.py": "C8Xi3bCVTjZiOC0o9DyCwlbkiY30vdY2y4cX7ymSNeg",
    "torchtitan/models/attention.py": "4PDkO-3aC57lPnzcQF7UzkPu1OgOGCxXXdCY4edgS1A",
    "torchtitan/models/llama3/infra/parallelize.py": "AB-wAJVSbxjakKg2r3Xq1s2b3eN6xOv8U5MTUve-F0A",
    "torchtitan/models/llama3/model/args.py": "On00q752d6UkYVoZWWy68dUwKxhw42b63yb3Rlt1wPY",
    "torchtitan/models/llama3/model/model.py": "YWjmM5qNootJG7W6LJNjB4ZlVj9YUVknFu0H8bxVGz8",
    "torchtitan/protocols/model.py": "qeHyHDOEEPYKfOIvoSNPSzZ4rKB4s2hGXaqjgTsEK1k",
    "torchtitan/tools/logging.py": "hVIiraYbAybPDHpTWwY72nuRizRjRuDLAAO10_Gym3g",
}


def library_python() -> str:
    """The interpreter torchtitan is looked up in (the library venv's, else this one)."""
    return os.environ.get("SHARDWISE_LIBRARY_PYTHON", sys.executable)


def installed_torchtitan(python: str) -> Path | None:
    """The folder of the ``torchtitan`` package ``python`` imports, None where it has none
    (found without importing it: its ``__init__`` loads triton and more)."""
    script = ("import importlib.util, os; s = importlib.util.find_spec('torchtitan'); "
              "print(os.path.dirname(s.origin) if s and s.origin else '')")
    try:
        found = subprocess.run([python, "-c", script], capture_output=True, text=True,
                               timeout=120)
    except OSError:
        return None
    folder = found.stdout.strip()
    return Path(folder) if found.returncode == 0 and folder else None


class NotTorchtitan022(ValueError):
    """An installed torchtitan file is not the one the 0.2.2 wheel records."""


def record_digest(data: bytes) -> str:
    """A file's sha256 as a wheel's ``RECORD`` writes it (urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def sources() -> list[Path]:
    """This folder's files of the program (stand-ins and ``train_llama.py``), relative to it."""
    return sorted(p.relative_to(HERE) for p in HERE.rglob("*.py")
                  if p.name != "titan_harness.py" and "__pycache__" not in p.parts)


def prepare(variant: str, dest: Path, torchtitan: Path) -> int:
    """Write the program for ``variant`` ("torch" or "shardwise") into ``dest``: this folder's
    files and the ``COPIED`` files of the installed package folder ``torchtitan`` (each
    checked against its RECORD hash: ``NotTorchtitan022`` if one differs); return the lines the
    port changed outside import statements (0 for torch)."""
    if variant not in ("torch", "shardwise"):
        raise ValueError(f"variant must be 'torch' or 'shardwise', got {variant!r}")
    sys.path.insert(0, str(HERE.parent / "pytorch_programs"))
    try:
        from port import port
    finally:
        sys.path.remove(str(HERE.parent / "pytorch_programs"))
    files = {rel: (HERE / rel).read_text() for rel in sources()}
    for rel, digest in COPIED.items():
        data = (torchtitan.parent / rel).read_bytes()
        if record_digest(data) != digest:
            raise NotTorchtitan022(f"{torchtitan.parent / rel} is not torchtitan 0.2.2's: sha256 "
                                   f"{record_digest(data)}, its wheel's RECORD has {digest}")
        files[Path(rel)] = data.decode()
    beyond_imports = 0
    for rel, source in files.items():
        if variant == "shardwise":
            ported = port(source)
            source = ported.source
            beyond_imports += ported.other_lines_changed
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(source)
    return beyond_imports


def _launch(folder: Path, nproc: int | None) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    launch = [] if nproc is None else ["-m", "shardwise.launch", "--nproc", str(nproc)]
    proc = subprocess.run([sys.executable, *launch, "train_llama.py"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return f"exit {proc.returncode}\n" + "\n".join(proc.stdout.splitlines()[-15:]
                                                       + proc.stderr.splitlines()[-30:])
    lines = [ln.split("] ", 1)[-1] for ln in proc.stdout.splitlines()]
    losses: dict[int, list[float]] = {}
    for line in lines:
        words = line.split()
        if words[:1] == ["reference"]:
            return " ".join(words[1:])
        if words[:1] == ["rank"] and words[2] == "dp":
            losses.setdefault(int(words[3]), [float(w) for w in words[4:]])
    summed = [sum(step) for step in zip(*losses.values(), strict=True)]
    return " ".join(f"{v:.7g}" for v in summed)


def main(argv: list[str]) -> int:
    nproc = int(argv[0]) if argv else 4
    torchtitan = installed_torchtitan(library_python())
    if torchtitan is None:
        print(f"no torchtitan in {library_python()} (set SHARDWISE_LIBRARY_PYTHON to a venv "
              "with torchtitan 0.2.2: scripts/library_venv.sh)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("torch", "shardwise"):
            beyond = prepare(variant, Path(tmp) / variant, torchtitan)
        print(f"copied torchtitan 0.2.2's files from {torchtitan}; "
              f"port: {beyond} lines changed beyond imports")
        print("single device    ", _launch(Path(tmp) / "torch", None))
        for variant in ("torch", "shardwise"):
            print(f"{variant:<9} --nproc {nproc}", _launch(Path(tmp) / variant, nproc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
