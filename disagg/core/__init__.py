"""The pure core: cost model, engine model, ledger, policies, estimators."""

from disagg.core.compiled import check_compiled_sources

check_compiled_sources()
