"""benchmarks/host_study_variants.py: the variants of the shared-host model it simulates recorded runs under."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from disagg.core.cost_model import SharedHost, load_profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("host_study_variants", ROOT / "benchmarks" / "host_study_variants.py")
variants = importlib.util.module_from_spec(spec)
spec.loader.exec_module(variants)

HOST = SharedHost(engine_cores=1, cores=2, idle_cores=0.4, prefill_weight=1.6, mixed_cores=1.1)


def test_the_leftover_share_is_tried_only_inside_its_variant_and_then_put_back():
    cm = load_profile("cpu-tiny").model_copy(update={"shared_host": HOST})
    additive = HOST.stretch(2, 1.0)
    with variant_of("leftover-share", cm) as priced:
        assert priced is cm
        # two engines on one core share what a fifth of every core (the background) leaves; the steps'
        # work at full speed adds its share a = 0.5 on top of the sharing: (2 + 0.5) / 0.8
        assert HOST.stretch(2, 1.0) == pytest.approx(2.5 / 0.8)
        assert HOST.stretch(1, 0.0, 10.0) == pytest.approx(1 / variants.LEAST_FREE)  # never less than its floor
    assert HOST.stretch(2, 1.0) == additive  # the model as it is, once the variant ends


def test_even_weight_shares_a_prefills_core_evenly_and_changes_nothing_else():
    cm = load_profile("cpu-tiny").model_copy(update={"shared_host": HOST})
    with variant_of("even-weight", cm) as priced:
        host = priced.shared_host
        assert (host.prefill_weight, host.mixed_cores) == (1.0, None)
        assert (host.engine_cores, host.idle_cores) == (HOST.engine_cores, HOST.idle_cores)
    assert cm.shared_host is HOST


def variant_of(name, cm):
    return variants.variant(name, cm)
