"""Inside the NGC stand-in's build (Containerfile): give the installed torch NGC's pre-release version
(its metadata, its folder's name, ``torch.__version__``), then write /etc/pip/constraint.txt as NGC's
images have it: one ``name==version`` for every package installed (the image's state, so that pip
never changes any of them). Standard library only.

    python ngc_traits.py 2.13.0a0+8145d630e8.nv26.6.54250401
"""

import re
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

CONSTRAINT = Path("/etc/pip/constraint.txt")


def relabel_torch(version: str) -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    [info] = site.glob("torch-*.dist-info")
    old = info.name
    new = f"torch-{version}.dist-info"
    text = (info / "METADATA").read_text()
    (info / "METADATA").write_text(re.sub(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M))
    (info / "RECORD").write_text((info / "RECORD").read_text().replace(f"{old}/", f"{new}/"))
    info.rename(site / new)
    source = site / "torch" / "version.py"
    source.write_text(re.sub(r"^__version__ = .*$", f"__version__ = '{version}'", source.read_text(), count=1, flags=re.M))


def main() -> int:
    [version] = sys.argv[1:]
    relabel_torch(version)
    installed = sorted((d.metadata["Name"], d.version) for d in metadata.distributions())
    CONSTRAINT.parent.mkdir(parents=True, exist_ok=True)
    CONSTRAINT.write_text("".join(f"{name}=={v}\n" for name, v in installed))
    import torch  # the relabelled torch imports, and says NGC's version
    assert torch.__version__ == version, torch.__version__
    print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}); {CONSTRAINT}: {len(installed)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
