"""The project's image as a container engine built it (``make image-cpu``: tools/container_image.py,
podman, from packaging/container/Dockerfile on the CPU stand-in for NGC's PyTorch image), held to
what it must contain: the base's Python 3.12 and its pre-release torch; every package the base's
/etc/pip/constraint.txt pins still at its pin (the wheelhouse added, replaced nothing); megatron-core,
transformers and this project from the wheelhouse, ``pip check`` clean; ``PIP_CONSTRAINT`` still set;
the image check passing as a CPU job's first step and refusing as a GPU job's (no Transformer Engine in
a CPU image), in one line; nothing of the build left in /tmp.

The commands run inside the image by buildah (``--isolation chroot``: no OCI runtime or cgroups, as
the build itself). The image takes minutes and 7 GiB to build, so CI does not build it: without it
these tests skip, and fail where ``FBT_REQUIRE_IMAGE`` is set.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import wheelhouse  # noqa: E402

IMAGE = os.environ.get("FBT_IMAGE", "localhost/fbt-megatron:26.06-cpu")
INSPECT = r"""
import json, os, subprocess, sys
from importlib import metadata
print(json.dumps({
    "python": sys.version.split()[0],
    "installed": {d.metadata["Name"]: d.version for d in metadata.distributions()},
    "constraint": open(os.environ["PIP_CONSTRAINT"]).read() if os.environ.get("PIP_CONSTRAINT") else None,
    "pip_check": subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout,
    "leftovers": os.listdir("/tmp"),
}))
"""


def engine_has(image: str) -> bool:
    return shutil.which("podman") is not None and subprocess.run(["podman", "image", "exists", image]).returncode == 0


@pytest.fixture(scope="module")
def box():
    """A working container of the image (buildah), removed afterwards."""
    if not engine_has(IMAGE):
        message = f"no image {IMAGE} in podman's store: build it with make image-cpu (docs/gpu.md#the-container)"
        if os.environ.get("FBT_REQUIRE_IMAGE"):
            pytest.fail(message + " (FBT_REQUIRE_IMAGE is set)")
        pytest.skip(message)
    name = subprocess.run(["buildah", "from", IMAGE], check=True, capture_output=True, text=True).stdout.strip()
    yield name
    subprocess.run(["buildah", "rm", name], capture_output=True)


def run_in(box: str, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["buildah", "run", "--isolation", "chroot", box, "--", *cmd], capture_output=True, text=True)


def test_the_image_keeps_its_bases_stack_and_adds_the_wheelhouse(box):
    config = json.loads(subprocess.run(["podman", "image", "inspect", IMAGE], check=True, capture_output=True, text=True).stdout)[0]
    assert "PIP_CONSTRAINT=/etc/pip/constraint.txt" in config["Config"]["Env"], config["Config"]["Env"]
    seen = run_in(box, "python", "-c", INSPECT)
    assert seen.returncode == 0, seen.stderr
    found = json.loads(seen.stdout)
    installed = {wheelhouse.canonical(name): version for name, version in found["installed"].items()}
    pins = {key: version for key, (_, version) in wheelhouse.pins_text(found["constraint"]).items()}
    assert found["python"].startswith("3.12.")
    torch = installed["torch"]
    assert torch == pins["torch"] and "a0+" in torch, torch  # the base's pre-release, e.g. 2.13.0a0+8145d630e8.nv26.6.54250401
    changed = {k: (v, installed.get(k)) for k, v in pins.items() if installed.get(k) != v}
    assert not changed, changed  # every package of the base at its pin: the wheelhouse replaced none
    assert installed["megatron-core"] == "0.19.2" and installed["fbt-megatron"], installed
    assert "5.16.1" <= installed["transformers"] <= "5.24.0", installed["transformers"]
    added = sorted(set(installed) - set(pins))
    assert {"megatron-core", "transformers", "fbt-megatron", "sentencepiece", "tiktoken", "pytorch-optimizer"} <= set(added)
    assert found["pip_check"].strip() == "No broken requirements found.", found["pip_check"]
    assert "fbt-megatron" not in found["leftovers"], found["leftovers"]  # the build's wheelhouse and scripts removed
    print(f"\n{IMAGE}: python {found['python']}, torch {torch}, {len(pins)} packages of the base at their pins, "
          f"{len(added)} added: {', '.join(f'{k} {installed[k]}' for k in added)}")


def test_the_image_check_passes_a_cpu_jobs_first_step_and_refuses_a_gpu_jobs_in_one_line(box):
    """The installed project's own check (as a CPU job runs it, and as a GPU job would)."""
    check = "/usr/local/lib/python3.12/site-packages/fbt_megatron/launch/slurm/image_check.py"
    cpu = run_in(box, "python", check, "--image", IMAGE)
    assert cpu.returncode == 0 and cpu.stdout.startswith(f"=== environment: --container-image {IMAGE}: python 3.12."), cpu
    assert "torch 2.13.0a0+" in cpu.stdout and "megatron-core 0.19.2" in cpu.stdout, cpu.stdout
    gpu = run_in(box, "python", check, "--gpu", "--image", IMAGE)
    buildahs = ("subprocess exited with status", "Error: exit status")  # buildah's own lines after a failed command
    lines = [line for line in gpu.stderr.splitlines() if line and not line.startswith(buildahs)]
    assert gpu.returncode == 2 and len(lines) == 1, gpu
    assert lines[0].startswith(f"error: --container-image {IMAGE} cannot run this job: import transformer_engine.pytorch "
                               "failed (ModuleNotFoundError: No module named 'transformer_engine'), needed on GPU nodes"), lines
    print(f"\n{cpu.stdout.strip()}\n{lines[0]}")


def test_a_wheelhouse_that_would_replace_the_bases_torch_ends_the_build_in_one_line(tmp_path):
    """The Dockerfile's build on the stand-in, with the wheelhouse of ``make image-cpu`` asking for PyPI's
    torch 2.13.0 besides its requirements: pip's dry run under the base's PIP_CONSTRAINT (torch pinned at
    NGC's pre-release) cannot resolve, and the build ends with one error: line from tools/wheelhouse.py."""
    context = ROOT / ".image-build" / "context"
    if not (engine_has("localhost/fbt-ngc-standin:26.06") and (context / "wheelhouse" / "requirements.txt").is_file()):
        message = "no stand-in image or wheelhouse of make image-cpu here"
        if os.environ.get("FBT_REQUIRE_IMAGE"):
            pytest.fail(message + " (FBT_REQUIRE_IMAGE is set)")
        pytest.skip(message)
    bad = tmp_path / "context"
    shutil.copytree(context, bad)
    requirements = bad / "wheelhouse" / "requirements.txt"
    requirements.write_text(requirements.read_text() + "torch==2.13.0\n")
    build = subprocess.run(["podman", "build", "--isolation", "chroot", "--build-arg", "BASE_IMAGE=localhost/fbt-ngc-standin:26.06",
                            "--build-arg", "IMAGE_CHECK=", "-f", str(ROOT / "packaging/container/Dockerfile"), "-t",
                            "localhost/fbt-megatron:refused", str(bad)], capture_output=True, text=True)
    errors = [line for line in build.stdout.splitlines() + build.stderr.splitlines() if line.startswith("error: ")]
    assert build.returncode != 0 and len(errors) == 1, build.stdout[-3000:] + build.stderr[-3000:]
    assert errors[0].startswith("error: /tmp/fbt-megatron/wheelhouse/requirements.txt does not install under the constraints "
                                "/etc/pip/constraint.txt: "), errors
    assert "torch" in errors[0], errors
    print(f"\n{errors[0]}")
