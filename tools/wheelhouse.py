"""A folder of wheels for the project's GPU image: what NGC PyTorch lacks, for Python 3.12 on x86-64,
never the image's own torch, Transformer Engine, Apex, triton or nvidia-*/cuda-* packages.

    python tools/wheelhouse.py --output wheelhouse             # (make wheelhouse) downloads; needs PyPI
    python tools/wheelhouse.py --output wheelhouse --check     # (make wheelhouse-check) offline, against the image
    python tools/wheelhouse.py --output wheelhouse --install   # in the image (packaging/container/Dockerfile)

The requirements are requirements-gpu.txt plus this project's own wheel. pip resolves them for the
target (``--dry-run --report``, metadata only) under the image's pip constraints (``--constraint``:
its /etc/pip/constraint.txt, default packaging/container/ngc-pytorch-26.06-constraint.txt, without
the pins of the image's own stack, which the wheelhouse leaves alone); the image's stack is dropped
and every other pinned wheel is downloaded (``--no-deps --only-binary=:all:``).

``--install`` installs the folder offline into this Python under its pip configuration (in the
image: NGC's ``PIP_CONSTRAINT``), after a dry run that must resolve and must install none of the
image's stack; a conflict with a constraint is one ``error:`` line. ``--check`` proves both halves
here, offline, in two fresh Python 3.12 venvs without pip configuration: (1) the folder alone is
complete: on a stand-in ``torch`` (a wheel of metadata only: the constraint file's torch version,
e.g. NGC's pre-release ``2.13.0a0+…``, and torch's own dependencies), ``pip install --no-index``
from the folder satisfies every requirement and ``pip check``, and the libraries that do not need
torch import; (2) it installs in the image: on stand-ins of every package the constraint file pins
(their versions, no code), ``--install``'s own steps with that file as ``PIP_CONSTRAINT``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import itertools
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
REQUIREMENTS = REPO / "requirements-gpu.txt"
CONSTRAINT = REPO / "packaging" / "container" / "ngc-pytorch-26.06-constraint.txt"
# The image's own stack (canonical names): never in the wheelhouse, never installed over the image's.
IMAGE_STACK = re.compile(r"torch|torchvision|torchaudio|triton|pytorch-triton|apex|transformer-engine.*|flash-attn.*|nvidia-.*|cuda-.*")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")
IMPORTS = "numpy, yaml, psutil, sentencepiece, tokenizers, tiktoken, safetensors, tqdm, pytest"
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


def pip(*args, python=sys.executable, **kw) -> subprocess.CompletedProcess:
    cmd = [str(python), "-m", "pip", *map(str, args)]
    print("$ " + " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, check=True, **kw)


# the check's pip reads no configuration file (no index, find-links or constraints of this machine)
OFFLINE = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
OFFLINE.pop("PIP_CONSTRAINT", None)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_stack(name: str) -> bool:
    """A package of the image's own stack (a distribution or wheel file name, any spelling)."""
    return IMAGE_STACK.fullmatch(canonical(name)) is not None


def requirement_name(line: str) -> str:
    return re.split(r"[<>=!~; \[(]", line, maxsplit=1)[0].strip()


def requirements() -> list:
    lines = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    reqs = [r for r in lines if r]
    stack = [r for r in reqs if image_stack(requirement_name(r))]
    if stack:
        raise SystemExit(f"error: {REQUIREMENTS.name} names {stack[0]}: that is the image's (NGC PyTorch ships it); "
                         "remove the line")
    return reqs


def pins(constraint: Path) -> dict:
    """{canonical name: (name, version)} of a pip constraint file shaped like NGC's: one
    ``name==version`` per line (comments and blank lines aside)."""
    return pins_text(constraint.read_text(), constraint)


def pins_text(text: str, constraint="the constraint file") -> dict:
    """``pins`` of a constraint file's text."""
    found = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#")[0].strip()
        if not line:
            continue
        match = PIN.fullmatch(line)
        if not match:
            raise SystemExit(f"error: {constraint}:{number}: {line!r} is not a pin (name==version), the shape of NGC's "
                             "/etc/pip/constraint.txt")
        found[canonical(match[1])] = (match[1], match[2])
    if "torch" not in found:
        raise SystemExit(f"error: {constraint} pins no torch: give the image's own file "
                         "(docker run --rm IMAGE cat /etc/pip/constraint.txt > FILE)")
    return found


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def target(python_version: str) -> list:
    return ["--python-version", python_version, *[a for p in PLATFORMS for a in ("--platform", p)], "--only-binary=:all:"]


def download(out: Path, python_version: str, constraint: Path) -> None:
    reqs, pinned = requirements(), pins(constraint)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.whl"):  # a wheelhouse is one resolution: none of an earlier one's wheels
        stale.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        listed = Path(tmp) / "requirements.txt"
        listed.write_text("\n".join(reqs) + "\n")
        # the image's pins, but not its stack: those builds are NVIDIA's (not on PyPI) and stay out
        outside = Path(tmp) / "constraint.txt"
        outside.write_text("".join(f"{n}=={v}\n" for n, v in pinned.values() if not image_stack(n)))
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", report, *target(python_version),
            "--target", Path(tmp) / "unused", "--constraint", outside, "-r", listed)
        resolved = json.loads(report.read_text())["install"]
    keep = sorted({(i["metadata"]["name"], i["metadata"]["version"]) for i in resolved
                   if not image_stack(i["metadata"]["name"])})
    dropped = sorted(i["metadata"]["name"] for i in resolved if image_stack(i["metadata"]["name"]))
    torch_requires = next((i["metadata"].get("requires_dist", []) for i in resolved if i["metadata"]["name"] == "torch"), [])
    pip("download", "--no-deps", *target(python_version), "--dest", out, *[f"{n}=={v}" for n, v in keep])
    with tempfile.TemporaryDirectory() as tmp:  # this project (pure Python), built from a copy: no build/ left here
        shutil.copy(REPO / "pyproject.toml", tmp)
        shutil.copytree(REPO / "fbt_megatron", Path(tmp) / "fbt_megatron", ignore=shutil.ignore_patterns("__pycache__"))
        pip("wheel", "--no-deps", "--wheel-dir", out, tmp, stdout=subprocess.DEVNULL)
    (out / "requirements.txt").write_text("\n".join([*reqs, "fbt-megatron"]) + "\n")
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    manifest = dict(python=python_version, platforms=PLATFORMS, requirements=reqs, wheels=sorted(f.name for f in out.glob("*.whl")),
                    excluded=dropped, torch_requires=torch_requires, bytes=size,
                    constraint=dict(file=str(constraint), sha256=sha256(constraint), torch=pinned["torch"][1]))
    (out / "wheelhouse.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(manifest['wheels'])} wheels, {size / 2**20:.0f} MiB in {out}, resolved against {constraint}; "
          f"left to the image: {', '.join(dropped)}")


def stand_in(folder: Path, name: str, version: str, requires=()) -> Path:
    """A wheel of metadata only: what an installed package of the image looks like to pip."""
    stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    info = f"{stem}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {d}\n" for d in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def torch_stand_in(folder: Path, version: str, manifest: dict) -> Path:
    """torch at the image's version, declaring torch's own dependencies but not its CUDA wheels."""
    return stand_in(folder, "torch", version,
                    [r for r in manifest["torch_requires"] if not image_stack(requirement_name(r))])


def conflict(output: str) -> str:
    """pip's reason for a failed resolution, as one line."""
    lines = [line.strip() for line in output.splitlines()]
    if "The conflict is caused by:" in lines:
        start = lines.index("The conflict is caused by:") + 1
        return "; ".join(itertools.takewhile(bool, lines[start:]))
    errors = [line[len("ERROR: "):] for line in lines if line.startswith("ERROR: ")]
    return errors[0] if errors else (lines[-1] if lines else "pip failed")


def install(out: Path, python=sys.executable, env=None) -> list:
    """Install the wheelhouse into ``python`` offline, under ``env``'s pip configuration (in the
    image: NGC's PIP_CONSTRAINT). A dry run first: a failed resolution (a constraint conflict) or a
    plan that installs any of the image's stack ends here, in one line. What was installed."""
    offline = ["--no-index", "--disable-pip-version-check", "--find-links", out, "-r", out / "requirements.txt"]
    given = (env or os.environ).get("PIP_CONSTRAINT") or "none"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [str(python), "-m", "pip", "install", "--dry-run", "--report", str(report), *map(str, offline)]
        print("$ " + " ".join(cmd[2:]) + f"  (PIP_CONSTRAINT={given})", flush=True)
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"error: {out}/requirements.txt does not install under the constraints {given}: "
                             f"{conflict(run.stdout + run.stderr)} (rebuild the wheelhouse against the image's "
                             "file: python tools/wheelhouse.py --output DIR --constraint FILE; or choose "
                             "requirements-gpu.txt's pins the image allows)")
        planned = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    stack = [f"{n} {v}" for n, v in planned if image_stack(n)]
    if stack:
        raise SystemExit(f"error: installing {out} would put {', '.join(stack)} over the image's own: the wheelhouse "
                         "must leave torch, Transformer Engine, Apex, triton and nvidia-*/cuda-* to the image "
                         "(rebuild it with make wheelhouse)")
    pip("install", "--quiet", *offline, python=python, env=env)
    return planned


def venv(python: str, folder: Path, manifest: dict) -> Path:
    """A fresh venv of ``python`` (its Python must be the wheelhouse's); its interpreter."""
    subprocess.run([python, "-m", "venv", folder], check=True)
    py = folder / "bin" / "python"
    version = subprocess.run([py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], check=True,
                             capture_output=True, text=True).stdout.strip()
    if version != manifest["python"]:
        raise SystemExit(f"error: {python} is Python {version}; the wheelhouse is for {manifest['python']}")
    return py


def check(out: Path, python: str, constraint: Path) -> None:
    manifest = json.loads((out / "wheelhouse.json").read_text())
    built = manifest.get("constraint", {})
    if built.get("sha256") != sha256(constraint):
        raise SystemExit(f"error: {out} was resolved against {built.get('file', 'no constraint file')}, not {constraint}: "
                         f"check it with --constraint {built.get('file', 'FILE')}, or rebuild it with --constraint {constraint}")
    image = pins(constraint)
    stack = [w for w in manifest["wheels"] if image_stack(w.split("-")[0])]
    if stack:
        raise SystemExit(f"error: {out} holds {', '.join(stack)}: the image's own (rebuild it with make wheelhouse)")
    offline = ["--no-index", "--disable-pip-version-check"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # (1) the folder alone: only torch (a stand-in at the image's version) is there before it
        py = venv(python, tmp / "alone", manifest)
        pip("install", *offline, "--no-deps", torch_stand_in(tmp, image["torch"][1], manifest), python=py, env=OFFLINE)
        pip("install", *offline, "--quiet", "--find-links", out, "-r", out / "requirements.txt", python=py, env=OFFLINE)
        pip("check", python=py, env=OFFLINE)
        subprocess.run([py, "-c", f"import {IMPORTS}"], check=True)
        subprocess.run([py, "-m", "pip", "list", "--format=freeze"], check=True, stdout=open(out / "check-freeze.txt", "w"))
        # (2) in the image: stand-ins of everything it pins, and its constraint file as PIP_CONSTRAINT
        py = venv(python, tmp / "image", manifest)
        folder = tmp / "image-stand-ins"
        folder.mkdir()
        wheels = [torch_stand_in(folder, version, manifest) if key == "torch" else stand_in(folder, name, version)
                  for key, (name, version) in image.items()]
        pip("install", *offline, "--no-deps", "--quiet", *wheels, python=py, env=OFFLINE)
        planned = install(out, py, {**OFFLINE, "PIP_CONSTRAINT": str(constraint)})
    print(f"check passed: (1) a fresh Python {manifest['python']} venv installed {shown(out)}/requirements.txt with "
          f"--no-index from {shown(out)} alone on a stand-in torch {image['torch'][1]} (the image's), pip check clean, "
          f"imported {IMPORTS}; (2) on stand-ins of the {len(image)} packages {shown(constraint)} pins, with it as "
          f"PIP_CONSTRAINT, it added {len(planned)} packages and replaced none of the image's")


def shown(path: Path) -> str:
    """A path as the check's summary prints it: relative to the working folder when inside it."""
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


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
    p.add_argument("--python-version", default="3.12", help="of the image (default 3.12)")
    p.add_argument("--constraint", type=Path, default=CONSTRAINT,
                   help="the image's pip constraint file (its /etc/pip/constraint.txt; default: "
                        f"{CONSTRAINT.relative_to(REPO)})")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="check the folder offline against the image instead of downloading")
    what.add_argument("--install", action="store_true", help="install the folder into this Python (inside the image)")
    p.add_argument("--python", help="the interpreter of --check's venvs (default: python3.12 on PATH, "
                   "else pyenv's newest 3.12)")
    args = p.parse_args(argv)
    if args.install:
        planned = install(args.output.resolve())
        print(f"installed {len(planned)} packages from {args.output}; none of the image's stack")
    elif args.check:
        check(args.output.resolve(), args.python or python312(), args.constraint.resolve())
    else:
        download(args.output.resolve(), args.python_version, args.constraint.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
