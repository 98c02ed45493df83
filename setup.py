"""Builds the engine model as a C extension (mypyc), which the simulator and the TTFT estimator run
(the simulator 1.2–1.3× faster: docs/results.md). The Python module stays the source; the extension
is built from it, beside it, and shadows it on import. `DISAGG_NO_COMPILE=1` installs without a C
compiler (everything runs, the simulator slower).

Each compiled source's digest is written beside it; `disagg.core.compiled` checks it at import, so
an editable install whose source changed after the build fails loudly instead of running old code.
This file does not import the package: its check would refuse a stale build, which is what a
rebuild replaces."""

import glob
import hashlib
import json
import os

from setuptools import setup

COMPILED = ["disagg/core/engine_model.py"]
DIGESTS = "disagg/core/compiled-sources.json"


def built_extensions(source: str) -> list[str]:
    stem = source[: -len(".py")]
    return glob.glob(f"{stem}.*.so") + glob.glob(f"{stem}__mypyc.*.so") + glob.glob(f"{stem}.*.pyd")


ext_modules = []
if os.environ.get("DISAGG_NO_COMPILE", "") in ("", "0"):
    from mypyc.build import mypycify

    digests = {os.path.basename(s): hashlib.sha256(open(s, "rb").read()).hexdigest() for s in COMPILED}
    with open(DIGESTS, "w") as f:
        json.dump(digests, f, indent=1)
    # the compiled modules import the rest of the package, type-checked only as far as they need
    ext_modules = mypycify(["--ignore-missing-imports", "--follow-imports=silent", *COMPILED], opt_level="3")
else:  # an earlier build's extensions would shadow the source
    for path in [DIGESTS, *(so for s in COMPILED for so in built_extensions(s))]:
        if os.path.exists(path):
            os.remove(path)

setup(ext_modules=ext_modules)
