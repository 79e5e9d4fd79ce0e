"""Build the project's image (packaging/container/Dockerfile) with a container engine, as a site builds
it: the wheelhouse resolved against the base image's own /etc/pip/constraint.txt, installed offline
under its PIP_CONSTRAINT, the image check at the end of the build; optionally imported by enroot into
the squashfs file that pyxis's ``--container-image`` takes.

    python tools/container_image.py --base cpu --sqsh images/fbt-megatron+cpu.sqsh   # (make image-cpu)
    python tools/container_image.py --base nvcr.io/nvidia/pytorch:26.06-py3          # (make image)

``--base cpu`` first builds a CPU stand-in for NGC's PyTorch image here, with no registry
(packaging/container/ngc-standin: Debian 12 by debootstrap, Python 3.12, PyPI's torch relabelled with
NGC's pre-release version, NGC's other pins, PIP_CONSTRAINT), and builds the image on it with the CPU
jobs' image check (imports only: it has no Transformer Engine). Podman builds with ``--isolation
chroot`` (no OCI runtime or cgroups needed, as in an unprivileged CI container); docker as it is.
Work files go to ``--work`` (default .image-build/, ignored by git); the images to the engine's store.
Needs network for debootstrap and PyPI at build time, none when the image runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wheelhouse  # noqa: E402  (tools/: the wheelhouse's resolution, pins and image stack)

REPO = wheelhouse.REPO
STANDIN = REPO / "packaging" / "container" / "ngc-standin"
OS_IMAGE = "localhost/fbt-debian:bookworm"
STANDIN_IMAGE = "localhost/fbt-ngc-standin:26.06"
# What the stand-in's root file system has beyond debootstrap's minimal one: the libraries pyenv's
# Python 3.12 and torch load (ssl, ffi, sqlite, compression, readline, OpenMP), certificates, ps.
OS_PACKAGES = "ca-certificates,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libgomp1,libreadline8,libncursesw6,libuuid1,libgdbm6,procps"
MIRROR = "http://deb.debian.org/debian"
# the wheels a Debian 12 (glibc 2.36) x86-64 takes: torch's CUDA libraries come as manylinux_2_17 … _2_31
GLIBC_2_36 = [a for tag in [*(f"manylinux_2_{minor}" for minor in range(36, 4, -1)), "manylinux2014", "manylinux2010",
                             "manylinux1"] for a in ("--platform", f"{tag}_x86_64")]


class Steps:
    """Each step's command echoed and timed; its output kept in the work folder's build.log."""

    def __init__(self, engine: str, log: Path):
        self.engine, self.log, self.times = engine, log, {}
        log.write_text("")

    def run(self, name: str, cmd: list, **kw) -> str:
        print(f"$ {' '.join(map(str, cmd))}", flush=True)
        started = time.monotonic()
        lines = []
        with self.log.open("a") as log:  # written as it comes: `tail -f` the log to follow a build
            log.write(f"\n$ {' '.join(map(str, cmd))}\n")
            log.flush()
            with subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw) as run:
                for line in run.stdout:
                    lines.append(line)
                    log.write(line)
                    log.flush()
        self.times[name] = self.times.get(name, 0.0) + time.monotonic() - started
        if run.returncode:
            tail = "".join(lines[-15:])
            raise SystemExit(f"{tail}error: {name} failed (exit {run.returncode}; all of it in {self.log})")
        return "".join(lines)

    def build(self, name: str, containerfile: Path, context: Path, tag: str, args: dict) -> str:
        isolation = ["--isolation", "chroot"] if Path(self.engine).name in ("podman", "buildah") else []
        build_args = [a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")]
        return self.run(name, [self.engine, "build", *isolation, "--network", "host", *build_args, "-f", containerfile,
                               "-t", tag, context])

    def exists(self, tag: str) -> bool:
        return subprocess.run([self.engine, "image", "inspect", tag], capture_output=True).returncode == 0

    def size(self, tag: str) -> int:
        return int(self.run("inspect", [self.engine, "image", "inspect", "--format", "{{.Size}}", tag]).strip())

    def read(self, tag: str, path: str) -> str:
        """A file of an image, without running it (no OCI runtime needed)."""
        box = self.run("inspect", [self.engine, "create", tag, "true"]).strip().splitlines()[-1]
        try:
            with tempfile.TemporaryDirectory() as tmp:
                self.run("inspect", [self.engine, "cp", f"{box}:{path}", tmp])
                return (Path(tmp) / Path(path).name).read_text()
        finally:
            subprocess.run([self.engine, "rm", box], capture_output=True)


def os_image(steps: Steps, work: Path) -> None:
    """Debian 12 by debootstrap, imported as OS_IMAGE (once: kept in the engine's store)."""
    if steps.exists(OS_IMAGE):
        return
    rootfs = work / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    steps.run("debootstrap", ["debootstrap", "--variant=minbase", f"--include={OS_PACKAGES}", "bookworm", rootfs, MIRROR])
    tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
    steps.run("debootstrap", [steps.engine, "import", "-", OS_IMAGE], stdin=tar.stdout)
    tar.wait()
    shutil.rmtree(rootfs)


def standin(steps: Steps, work: Path) -> str:
    """The CPU stand-in for NGC's PyTorch image, built from packaging/container/ngc-standin."""
    os_image(steps, work)
    pinned = wheelhouse.pins(wheelhouse.CONSTRAINT)
    ngc_torch = pinned["torch"][1]
    context = work / "ngc-standin"  # kept: its wheels/ (4 GiB) are downloaded once
    shutil.rmtree(context / "python", ignore_errors=True)
    context.mkdir(parents=True, exist_ok=True)
    python = Path(wheelhouse.python312()).resolve().parent.parent  # pyenv's prefix: bin/, lib/, include/
    for part in ("bin", "lib", "include"):  # not its site-packages beyond pip (this machine's own .pth files)
        shutil.copytree(python / part, context / "python" / part, symlinks=True, ignore=lambda folder, names: [
            n for n in names if n in ("__pycache__", "test", "idlelib")
            or (Path(folder).name == "site-packages" and not n.startswith("pip"))
            or (Path(folder).name == "bin" and n not in ("python", "python3", "python3.12"))])  # scripts: pyenv's shebangs
    # torch at the release NGC's pre-release is built from (2.13.0a0+… → 2.13.0), NGC's other pins
    release = ngc_torch.split("a")[0].split("+")[0]
    wanted = [f"torch=={release}", *(f"{n}=={v}" for n, v in pinned.values() if not wheelhouse.image_stack(n))]
    (context / "requirements.txt").write_text("\n".join(wanted) + "\n")
    steps.run("stand-in wheels", [sys.executable, "-m", "pip", "download", "--quiet", "--python-version", "3.12", "--only-binary=:all:",
                                  *GLIBC_2_36, "--dest", context / "wheels", *wanted])
    shutil.copy(STANDIN / "ngc_traits.py", context)
    steps.build("stand-in build", STANDIN / "Containerfile", context, STANDIN_IMAGE, {"OS_IMAGE": OS_IMAGE, "TORCH_VERSION": ngc_torch})
    return STANDIN_IMAGE


def image(steps: Steps, work: Path, base: str, tag: str, cpu: bool) -> str:
    """The project's image on ``base``: the wheelhouse against base's own constraint file, the Dockerfile's
    build in a context of only what it copies. The image check's line, as the build printed it."""
    context = work / "context"
    shutil.rmtree(context, ignore_errors=True)
    (context / "tools").mkdir(parents=True)
    (context / "fbt_megatron/launch/slurm").mkdir(parents=True)
    shutil.copy(REPO / "tools/wheelhouse.py", context / "tools")
    shutil.copy(REPO / "fbt_megatron/launch/slurm/image_check.py", context / "fbt_megatron/launch/slurm")
    constraint = work / "constraint.txt"
    constraint.write_text(steps.read(base, "/etc/pip/constraint.txt"))
    steps.run("wheelhouse", [sys.executable, REPO / "tools/wheelhouse.py", "--output", context / "wheelhouse", "--constraint", constraint])
    args = {"BASE_IMAGE": base, **({"IMAGE_CHECK": ""} if cpu else {})}  # the stand-in: the CPU jobs' check
    output = steps.build("image build", REPO / "packaging/container/Dockerfile", context, tag, args)
    return next((line.strip() for line in output.splitlines() if line.startswith("=== environment:")), "(no image check line)")


def squashfs(steps: Steps, tag: str, out: Path) -> None:
    """enroot's import of the image from the engine's store into a squashfs file (pyxis's --container-image)."""
    if shutil.which("enroot") is None:
        raise SystemExit("error: --sqsh needs enroot (https://github.com/NVIDIA/enroot): install it, or leave --sqsh out")
    out.parent.mkdir(parents=True, exist_ok=True)
    engine = Path(steps.engine).name
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial, env = Path(tmp) / out.name, dict(os.environ)
        if engine == "podman":  # enroot's podman:// import removes its container with `docker rm` (enroot 4.1.2,
            shim = Path(tmp) / "bin"  # docker.sh's EXIT trap): where that is not podman it fails, exit 1, and leaves it
            shim.mkdir()
            (shim / "docker").write_text('#!/bin/sh\nexec podman "$@"\n')
            (shim / "docker").chmod(0o755)
            env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
        steps.run("enroot import", ["enroot", "import", "--output", partial, f"{engine}://{tag}"], env=env)
        partial.replace(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the base image: NGC PyTorch (e.g. nvcr.io/nvidia/pytorch:26.06-py3), "
                   "or 'cpu' for the stand-in built here")
    p.add_argument("--tag", help="the image's tag (default: localhost/fbt-megatron:26.06, :26.06-cpu on the stand-in)")
    p.add_argument("--sqsh", type=Path, help="also import the image with enroot into this squashfs file")
    p.add_argument("--engine", default="podman", help="podman (default) or docker")
    p.add_argument("--work", type=Path, default=REPO / ".image-build", help="work folder (default .image-build/)")
    args = p.parse_args(argv)
    if shutil.which(args.engine) is None:
        raise SystemExit(f"error: no {args.engine} here: install it (Debian: apt-get install podman), or give --engine docker")
    cpu = args.base == "cpu"
    tag = args.tag or ("localhost/fbt-megatron:26.06-cpu" if cpu else "localhost/fbt-megatron:26.06")
    args.work.mkdir(parents=True, exist_ok=True)
    steps = Steps(args.engine, args.work / "build.log")
    started = time.monotonic()
    base = standin(steps, args.work) if cpu else args.base
    checked = image(steps, args.work, base, tag, cpu)
    if args.sqsh:
        squashfs(steps, tag, args.sqsh.resolve())
    summary = dict(image=tag, base=base, bytes=steps.size(tag), seconds={k: round(v) for k, v in steps.times.items()},
                   total_seconds=round(time.monotonic() - started), image_check=checked,
                   **({"sqsh": str(args.sqsh), "sqsh_bytes": args.sqsh.stat().st_size} if args.sqsh else {}))
    (args.work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    sqsh = f"; {args.sqsh} {summary['sqsh_bytes'] / 2**30:.1f} GiB" if args.sqsh else ""
    print(f"{tag} on {base}: {summary['bytes'] / 2**30:.1f} GiB{sqsh}, built in {summary['total_seconds']} s "
          f"({', '.join(f'{k} {v} s' for k, v in summary['seconds'].items())})\n{checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
