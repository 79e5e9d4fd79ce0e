"""A folder of wheels for GPU nodes without internet: everything the GPU path needs for Python 3.12
on x86-64 except what an NGC PyTorch container already has (torch, Transformer Engine, Apex, and
torch's CUDA wheels and triton).

    python tools/wheelhouse.py --output wheelhouse            # (make wheelhouse) downloads; needs PyPI
    python tools/wheelhouse.py --output wheelhouse --check    # then: install it offline into a fresh venv
    pip install --no-index --find-links wheelhouse -r wheelhouse/requirements.txt   # on the node

The requirements are requirements-mcore-latest.txt (megatron-core 0.19.2 and the pins tested on
Python 3.12) without torch, plus this project's own wheel. pip resolves them for the target
(``--dry-run --report``, metadata only), the excluded names are dropped and every other pinned
wheel is downloaded (``--no-deps --only-binary=:all:``). ``--check`` proves the folder is complete:
a fresh venv of a Python 3.12 gets a stand-in ``torch`` (the container's version, no code, torch's
own dependencies declared), then ``pip install --no-index`` from the folder alone must satisfy every
requirement and ``pip check``, and the installed libraries that do not need torch must import.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "requirements-mcore-latest.txt"
EXCLUDED = re.compile(r"(torch|triton|apex|transformer[-_]engine.*|nvidia-.*|cuda-.*)", re.IGNORECASE)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")
TORCH = "2.13.0"  # the stand-in's version: what requirements-mcore-latest.txt tests
IMPORTS = "numpy, yaml, psutil, sentencepiece, tokenizers, tiktoken, safetensors, tqdm, pytest"


def pip(*args, python=sys.executable, **kw) -> subprocess.CompletedProcess:
    cmd = [str(python), "-m", "pip", *map(str, args)]
    print("$ " + " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, check=True, **kw)


# the check's pip reads no configuration file (no index, find-links or constraints of this machine)
OFFLINE = dict(env={**os.environ, "PIP_CONFIG_FILE": os.devnull})


def requirements() -> list:
    lines = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    return [r for r in lines if r and not EXCLUDED.fullmatch(re.split(r"[<>=!~; \[]", r)[0])]


def target(python_version: str) -> list:
    return ["--python-version", python_version, *[a for p in PLATFORMS for a in ("--platform", p)], "--only-binary=:all:"]


def download(out: Path, python_version: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    reqs = requirements()
    with tempfile.TemporaryDirectory() as tmp:
        listed = Path(tmp) / "requirements.txt"
        listed.write_text("\n".join(reqs) + "\n")
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", report, *target(python_version),
            "--target", Path(tmp) / "unused", "-r", listed)
        resolved = json.loads(report.read_text())["install"]
    keep = sorted({(i["metadata"]["name"], i["metadata"]["version"]) for i in resolved
                   if not EXCLUDED.fullmatch(i["metadata"]["name"])})
    dropped = sorted(i["metadata"]["name"] for i in resolved if EXCLUDED.fullmatch(i["metadata"]["name"]))
    torch_requires = next((i["metadata"].get("requires_dist", []) for i in resolved if i["metadata"]["name"] == "torch"), [])
    pip("download", "--no-deps", *target(python_version), "--dest", out, *[f"{n}=={v}" for n, v in keep])
    with tempfile.TemporaryDirectory() as tmp:  # this project (pure Python), built from a copy: no build/ left here
        shutil.copy(REPO / "pyproject.toml", tmp)
        shutil.copytree(REPO / "fbt_megatron", Path(tmp) / "fbt_megatron", ignore=shutil.ignore_patterns("__pycache__"))
        pip("wheel", "--no-deps", "--wheel-dir", out, tmp, stdout=subprocess.DEVNULL)
    (out / "requirements.txt").write_text("\n".join([*reqs, "fbt-megatron"]) + "\n")
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    manifest = dict(python=python_version, platforms=PLATFORMS, requirements=reqs, wheels=sorted(f.name for f in out.glob("*.whl")),
                    excluded=dropped, torch_requires=torch_requires, bytes=size)
    (out / "wheelhouse.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(manifest['wheels'])} wheels, {size / 2**20:.0f} MiB in {out}; left to the container: {', '.join(dropped)}")


def stand_in_torch(folder: Path, requires: list) -> Path:
    """A wheel named torch with no code: its metadata only (version, torch's non-CUDA dependencies)."""
    deps = [r for r in requires if not EXCLUDED.fullmatch(re.split(r"[<>=!~; \[(]", r)[0].strip())]
    info = f"torch-{TORCH}.dist-info"
    files = {f"{info}/METADATA": "Metadata-Version: 2.1\nName: torch\nVersion: " + TORCH + "\n"
                                 + "".join(f"Requires-Dist: {d}\n" for d in deps),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"torch-{TORCH}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def check(out: Path, python: str) -> None:
    manifest = json.loads((out / "wheelhouse.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", venv], check=True)
        py = venv / "bin" / "python"
        version = subprocess.run([py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], check=True,
                                 capture_output=True, text=True).stdout.strip()
        if version != manifest["python"]:
            raise SystemExit(f"error: {python} is Python {version}; the wheelhouse is for {manifest['python']}")
        offline = ["--no-index", "--disable-pip-version-check"]
        pip("install", *offline, "--no-deps", stand_in_torch(Path(tmp), manifest["torch_requires"]), python=py, **OFFLINE)
        pip("install", *offline, "--find-links", out, "-r", out / "requirements.txt", python=py, **OFFLINE)
        pip("check", python=py, **OFFLINE)
        subprocess.run([py, "-c", f"import {IMPORTS}"], check=True)
        subprocess.run([py, "-m", "pip", "list", "--format=freeze"], check=True, stdout=open(out / "check-freeze.txt", "w"))
    print(f"check passed: a fresh Python {version} venv installed {out}/requirements.txt with --no-index from {out} alone "
          f"(torch a stand-in: the container's); imported {IMPORTS}")


def python312() -> str:
    """python3.12 on PATH if it runs (a pyenv shim may not), else pyenv's newest 3.12."""
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    pyenv = sorted(Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")).glob("versions/3.12.*/bin/python"),
                   key=lambda p: [int(x) for x in p.parent.parent.name.split(".")])
    return str(pyenv[-1]) if pyenv else "python3.12"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, type=Path, help="the wheelhouse folder")
    p.add_argument("--python-version", default="3.12", help="of the GPU nodes (default 3.12)")
    p.add_argument("--check", action="store_true", help="install the folder offline into a fresh venv instead of downloading")
    p.add_argument("--python", help="the interpreter of --check's venv (default: python3.12 on PATH, "
                   "else pyenv's newest 3.12)")
    args = p.parse_args(argv)
    if args.check:
        check(args.output.resolve(), args.python or python312())
    else:
        download(args.output.resolve(), args.python_version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
