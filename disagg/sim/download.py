"""Fetch the public Azure LLM inference traces (Splitwise, ISCA'24) into a data directory.

The files are published in the Azure/AzurePublicDataset repository; they are fetched byte for byte
from a pinned commit, checked for their header, and written atomically.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

from disagg.files import atomic_write

_COMMIT = "7909210"
_BASE = f"https://raw.githubusercontent.com/Azure/AzurePublicDataset/{_COMMIT}/data"
TRACES = {
    "azure_conv_2023": f"{_BASE}/AzureLLMInferenceTrace_conv.csv",
    "azure_code_2023": f"{_BASE}/AzureLLMInferenceTrace_code.csv",
}
_HEADER = b"TIMESTAMP,ContextTokens,GeneratedTokens"


def download_traces(dest: Path, names: list[str] | None = None, timeout_s: float = 120.0) -> list[Path]:
    names = names or sorted(TRACES)
    unknown = [n for n in names if n not in TRACES]
    if unknown:
        raise ValueError(f"unknown trace name(s) {unknown}; known: {sorted(TRACES)}")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        target = dest / f"{name}.csv"
        if target.exists():
            written.append(target)
            continue
        with urllib.request.urlopen(TRACES[name], timeout=timeout_s) as resp:
            body = resp.read()
        if not body.startswith(_HEADER):
            raise ValueError(f"{TRACES[name]}: unexpected content (no Azure trace header)")
        with atomic_write(target, "wb") as f:
            f.write(body)
        written.append(target)
    return written
