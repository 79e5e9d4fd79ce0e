"""The project's GPU image (packaging/container/, tools/wheelhouse.py, issue 43): the install its build
runs (``wheelhouse.py --install``) with real pip, offline, into fresh venvs holding stand-ins of an
image's packages (wheels of metadata only, as ``--check`` makes them) under a constraint file as
``PIP_CONSTRAINT``, as NGC sets it. The image keeps its pins and gets what it lacks; a constraint
conflict is one ``error:`` line and installs nothing; a plan that would install any of the image's
stack (torch, Transformer Engine, nvidia-*, triton) is refused even where no constraint pins it;
NGC 25.01's pre-release torch is below megatron-core's ``torch>=2.6.0``, 26.06's is not. The
wheelhouses here are small folders of such wheels whose requirements are the real packages' (their
METADATA); ``make wheelhouse-check`` runs the same install on the real wheelhouse (docs/gpu.md).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import wheelhouse  # tools/wheelhouse.py
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
CONTAINER = ROOT / "packaging" / "container"
NGC_2606_TORCH = "2.13.0a0+8145d630e8.nv26.6.54250401"  # nvcr.io/nvidia/pytorch:26.06-py3 (docs/gpu.md#the-container)
NGC_2501_TORCH = "2.6.0a0+ecf3bae40a.nv25.1"  # 25.01's torch 2.6.0a0+ecf3bae40a.nv25.01, as pip normalizes it
# The requirements of the real wheels (their METADATA): megatron-core 0.19.2, transformers 5.24.0 and 5.17.0.
MEGATRON = {("megatron-core", "0.19.2"): ["torch>=2.6.0", "packaging>=24.2"]}
TRANSFORMERS_5_24 = {("transformers", "5.24.0"): ["huggingface-hub<3.0,>=1.31.0", "packaging>=20.0"]}
TRANSFORMERS_5_17 = {("transformers", "5.17.0"): ["huggingface-hub<2.0,>=1.5.0", "packaging>=20.0"]}


def image(tmp: Path, packages: dict) -> Path:
    """A fresh venv holding stand-ins of an image's ``packages`` {name: version}; its python."""
    folder, wheels = tmp / "image", tmp / "image-wheels"
    wheels.mkdir()
    subprocess.run([sys.executable, "-m", "venv", folder], check=True)
    py = folder / "bin" / "python"
    stand_ins = [wheelhouse.stand_in(wheels, name, version) for name, version in packages.items()]
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--disable-pip-version-check",
                    *stand_ins], check=True, env=wheelhouse.OFFLINE)
    return py


def house(tmp: Path, wheels: dict, requirements: list) -> Path:
    """A wheelhouse of {(name, version): requirements} and its requirements.txt."""
    out = tmp / "wheelhouse"
    out.mkdir()
    for (name, version), requires in wheels.items():
        wheelhouse.stand_in(out, name, version, requires)
    (out / "requirements.txt").write_text("\n".join(requirements) + "\n")
    return out


def install(tmp: Path, out: Path, py: Path, pins: dict) -> list:
    """``--install``'s steps into ``py`` with a constraint file of ``pins`` as PIP_CONSTRAINT."""
    constraint = tmp / "constraint.txt"
    constraint.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
    return wheelhouse.install(out, py, {**wheelhouse.OFFLINE, "PIP_CONSTRAINT": str(constraint)})


def installed(py: Path) -> dict:
    listing = subprocess.run([py, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"], check=True,
                             capture_output=True, text=True, env=wheelhouse.OFFLINE).stdout
    return {wheelhouse.canonical(p["name"]): p["version"] for p in json.loads(listing)}


def refusal(excinfo) -> str:
    message = str(excinfo.value)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_the_image_keeps_its_torch_and_pins_and_gets_what_it_lacks(tmp_path):
    """26.06's torch (a pre-release) satisfies megatron-core's torch>=2.6.0 as installed; the image's
    huggingface-hub 1.18.0 stays although the wheelhouse holds a newer one."""
    pins = {"torch": NGC_2606_TORCH, "huggingface-hub": "1.18.0", "packaging": "26.0"}
    py = image(tmp_path, pins)
    out = house(tmp_path, {**MEGATRON, **TRANSFORMERS_5_17, ("huggingface-hub", "1.40.0"): [], ("packaging", "26.4"): []},
                ["megatron-core==0.19.2", "transformers>=5.16.1,<=5.24.0"])
    planned = install(tmp_path, out, py, pins)
    assert sorted(planned) == [("megatron-core", "0.19.2"), ("transformers", "5.17.0")], planned
    assert {k: v for k, v in installed(py).items() if k in ("torch", "huggingface-hub", "packaging", "transformers")} == {
        "torch": NGC_2606_TORCH, "huggingface-hub": "1.18.0", "packaging": "26.0", "transformers": "5.17.0"}


def test_a_constraint_conflict_is_one_line_and_installs_nothing(tmp_path):
    """transformers 5.24.0 needs huggingface-hub >= 1.31; NGC 26.06 pins 1.18.0."""
    pins = {"torch": NGC_2606_TORCH, "huggingface-hub": "1.18.0", "packaging": "26.0"}
    py = image(tmp_path, pins)
    out = house(tmp_path, {**TRANSFORMERS_5_24, ("huggingface-hub", "2.4.0"): []}, ["transformers==5.24.0"])
    with pytest.raises(SystemExit) as excinfo:
        install(tmp_path, out, py, pins)
    message = refusal(excinfo)
    assert f"{out}/requirements.txt does not install under the constraints {tmp_path}/constraint.txt: " in message
    assert re.search(r"transformers 5\.24\.0 depends on huggingface-hub<3\.0(,| and )>=1\.31\.0; The user requested "
                     r"\(constraint\) huggingface-hub==1\.18\.0 \(rebuild", message), message  # pip's words, as one line
    assert "transformers" not in installed(py) and installed(py)["huggingface-hub"] == "1.18.0"


def test_ngc_2501s_torch_is_below_megatron_cores_requirement(tmp_path):
    """2.6.0a0 < 2.6.0 (PEP 440): in 25.01 megatron-core does not install; the message names torch."""
    pins = {"torch": NGC_2501_TORCH, "packaging": "26.0"}
    py = image(tmp_path, pins)
    out = house(tmp_path, MEGATRON, ["megatron-core==0.19.2"])
    with pytest.raises(SystemExit) as excinfo:
        install(tmp_path, out, py, pins)
    message = refusal(excinfo)
    assert f"megatron-core 0.19.2 depends on torch>=2.6.0; The user requested (constraint) torch=={NGC_2501_TORCH}" in message


@pytest.mark.parametrize("pinned", [True, False], ids=["torch-pinned", "no-pins"])
def test_the_image_stack_is_never_installed(tmp_path, pinned):
    """A wheelhouse that would bring nvidia-* or torch is refused in one line and installs nothing,
    with the image's torch pinned (a conflict) or with no pins at all (the stack guard itself)."""
    py = image(tmp_path, {"torch": NGC_2606_TORCH})
    out = house(tmp_path, {("needs-nccl", "1.0"): ["nvidia-nccl-cu13==2.30.4"], ("nvidia-nccl-cu13", "2.30.4"): [],
                           ("needs-torch", "1.0"): ["torch==2.13.0"], ("torch", "2.13.0"): []},
                ["needs-nccl", "needs-torch"])
    with pytest.raises(SystemExit) as excinfo:
        install(tmp_path, out, py, {"torch": NGC_2606_TORCH} if pinned else {})
    message = refusal(excinfo)
    if pinned:
        assert f"needs-torch 1.0 depends on torch==2.13.0; The user requested (constraint) torch=={NGC_2606_TORCH}" in message
    else:
        assert f"installing {out} would put " in message and "nvidia-nccl-cu13 2.30.4" in message and "torch 2.13.0" in message
    assert installed(py)["torch"] == NGC_2606_TORCH and "nvidia-nccl-cu13" not in installed(py)


def test_the_stand_in_constraint_file_is_26_06s_and_megatron_core_accepts_its_torch():
    """The committed stand-in (packaging/container/) parses; its torch is 26.06's pre-release, which
    megatron-core's own requirement accepts (this venv's megatron-core METADATA) and 25.01's is not."""
    pins = wheelhouse.pins(wheelhouse.CONSTRAINT)
    assert pins["torch"] == ("torch", NGC_2606_TORCH) and pins["transformer-engine"][1].startswith("2.16.0")
    [torch_requirement] = [Requirement(r) for r in importlib.metadata.requires("megatron-core") if r.startswith("torch")]
    assert str(torch_requirement.specifier) == ">=2.6.0"
    assert torch_requirement.specifier.contains(Version(NGC_2606_TORCH), prereleases=True)
    assert not torch_requirement.specifier.contains(Version(NGC_2501_TORCH), prereleases=True)


def test_bad_constraint_files_and_requirements_are_one_line(tmp_path, monkeypatch):
    bad = tmp_path / "bad.txt"
    bad.write_text("torch==2.13.0a0\nnumpy>=2\n")
    with pytest.raises(SystemExit) as excinfo:
        wheelhouse.pins(bad)
    assert refusal(excinfo) == (f"error: {bad}:2: 'numpy>=2' is not a pin (name==version), the shape of NGC's "
                                "/etc/pip/constraint.txt")
    bad.write_text("# an empty image\nnumpy==2.1.0  # a comment\n")
    with pytest.raises(SystemExit) as excinfo:
        wheelhouse.pins(bad)
    assert "pins no torch: give the image's own file (docker run --rm IMAGE cat /etc/pip/constraint.txt > FILE)" in refusal(excinfo)

    assert "megatron-core==0.19.2" in wheelhouse.requirements()  # requirements-gpu.txt names none of the image's stack
    gpu = tmp_path / "requirements-gpu.txt"
    gpu.write_text("megatron-core==0.19.2\ntransformer-engine[pytorch]>=2.0  # the PyPI build\n")
    monkeypatch.setattr(wheelhouse, "REQUIREMENTS", gpu)
    with pytest.raises(SystemExit) as excinfo:
        wheelhouse.requirements()
    assert refusal(excinfo) == ("error: requirements-gpu.txt names transformer-engine[pytorch]>=2.0: that is the image's "
                                "(NGC PyTorch ships it); remove the line")


def test_check_refuses_another_images_wheelhouse_and_one_holding_the_image_stack(tmp_path):
    out = tmp_path / "wheelhouse"
    out.mkdir()
    wheels = ["megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl", "nvidia_nccl_cu13-2.30.4-py3-none-manylinux_2_18_x86_64.whl",
              "transformer_engine-2.16.0-py3-none-any.whl"]
    for constraint, sha in [("/images/ngc-25.12.txt", "0" * 64), (str(wheelhouse.CONSTRAINT), wheelhouse.sha256(wheelhouse.CONSTRAINT))]:
        (out / "wheelhouse.json").write_text(json.dumps({"python": "3.12", "wheels": wheels,
                                                         "constraint": {"file": constraint, "sha256": sha}}))
        with pytest.raises(SystemExit) as excinfo:
            wheelhouse.check(out, sys.executable, wheelhouse.CONSTRAINT)
        assert refusal(excinfo) == (
            f"error: {out} was resolved against /images/ngc-25.12.txt, not {wheelhouse.CONSTRAINT}: check it with --constraint "
            f"/images/ngc-25.12.txt, or rebuild it with --constraint {wheelhouse.CONSTRAINT}" if sha == "0" * 64 else
            f"error: {out} holds {wheels[1]}, {wheels[2]}: the image's own (rebuild it with make wheelhouse)")


def test_the_recipe_builds_from_the_tag_of_its_constraint_file_and_copies_what_its_context_holds():
    """Dockerfile, its .dockerignore and the stand-in constraint file agree: the same NGC tag; every
    COPY source exists (the wheelhouse once made) and is let through; the build runs --install, then
    the training job's first step for GPU nodes."""
    dockerfile = (CONTAINER / "Dockerfile").read_text()
    [tag] = re.findall(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:(\S+)-py3$", dockerfile, flags=re.M)
    assert wheelhouse.CONSTRAINT.name == f"ngc-pytorch-{tag}-constraint.txt"
    assert f"/etc/pip/constraint.txt of nvcr.io/nvidia/pytorch:{tag}-py3" in wheelhouse.CONSTRAINT.read_text()
    allowed = [line[1:].rstrip("/") for line in (CONTAINER / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")]
    sources = [s for line in re.findall(r"^COPY (.+)$", dockerfile, flags=re.M) for s in line.split()[:-1]]
    assert sorted(sources) == sorted(allowed), (sources, allowed)
    assert all((ROOT / s).exists() for s in sources if s != "wheelhouse")
    run = dockerfile.split("\nRUN ", 1)[1]
    assert "wheelhouse.py --output /tmp/fbt-megatron/wheelhouse --install" in run and "image_check.py ${IMAGE_CHECK}" in run
    assert "\nARG IMAGE_CHECK=--gpu\n" in dockerfile  # a GPU image's check unless told (the CPU stand-in: tools/container_image.py)
    assert "PIP_CONSTRAINT" not in run  # the image's, as it is
