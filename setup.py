"""The build copies the data the installed package reads into the wheel, from where the repository keeps it: the
bundled checkpoints into ``reference/_models`` (read by ``reference.models``), the golden records, the examples and
the constraints files into ``cbverify/_data`` (read by ``cbverify.data``). An editable install reads them in place."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

BUNDLED = {
    "golden/models": "reference/_models",
    "golden/records": "cbverify/_data/records",
    "examples": "cbverify/_data/examples",
    "constraints.txt": "cbverify/_data/constraints.txt",
    "constraints-vllm.txt": "cbverify/_data/constraints-vllm.txt",
}


class BuildWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for source, target in BUNDLED.items():
            src, dst = Path(source), Path(self.build_lib) / target
            if not src.exists():
                raise SystemExit(f"cannot build: {source} is missing (a clean clone has it)")
            if dst.exists():
                shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
            else:
                shutil.copy2(src, dst)


setup(cmdclass={"build_py": BuildWithData})
