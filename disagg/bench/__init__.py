"""The measurement harness: `disagg bench` drives the live app (or the simulator) with a trace.

loadgen  — an open-loop HTTP load generator with client-side TTFT/TPOT and its own send lag;
harness  — settings, correctness gates, per-policy runs, resumable per-request JSON lines;
report   — results.json, Markdown tables and PNG plots from those lines;
script   — what every benchmark script shares: its log line, run metadata, atomic JSON result.
"""
