"""`quick_init` gives the hot-path records a faster `__init__` with the dataclass's own signature,
defaults and factories, and leaves them frozen."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from disagg.core.ledger import PolledState
from disagg.core.types import CostTerms, Decision, InstanceView, RequestFeatures, quick_init
from disagg.sim.metrics import RequestRecord

RECORDS = [RequestFeatures, InstanceView, CostTerms, Decision, PolledState, RequestRecord]


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_signature_is_the_dataclass_fields(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    fields = dataclasses.fields(cls)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        if f.default is not dataclasses.MISSING:
            assert p.default is f.default
        elif f.default_factory is dataclasses.MISSING:
            assert p.default is inspect.Parameter.empty


def test_defaults_factories_and_frozen():
    a, b = Decision("p", "d", "x"), Decision("p", "d", "x")
    assert a == b and a.prefill_cost == CostTerms() and a.prefill_cost is not b.prefill_cost  # one per instance
    given = CostTerms(own_work_s=1.0)
    assert Decision("p", "d", "x", given).prefill_cost is given
    v = InstanceView("d0", None, 1.0, 2, 3, 4)
    assert v.prefix_lookup is None and dataclasses.replace(v, queued=5).queued == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.queued = 7
    with pytest.raises(TypeError):
        InstanceView("d0", None, 1.0)  # missing arguments are still an error


def test_refuses_what_it_does_not_reproduce():
    @dataclasses.dataclass(frozen=True, slots=True)
    class Later:
        x: int

        def __post_init__(self) -> None:
            pass

    with pytest.raises(TypeError):
        quick_init(Later)
