"""vLLM's OpenAI API, live: every case of conformance_cases.py (each one of vLLM's own tests under
tests/entrypoints/openai/, replayed) against the running stack, once per topology.

- disaggregated: policy `marginal_cost`, the prompt prefilled on the prefill engine, its KV moved over
  NIXL, the answer decoded on a decode engine;
- colocated: policy `colocated`, a decode engine prefilling locally.

The policy is switched once per topology (a module-scoped fixture, so all cases of one topology run
together) and the one the stack ran with is restored at the end. The router must answer what
vLLM 0.32 answers, in both.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from conformance_cases import CASES, Live

pytestmark = pytest.mark.stack

TOPOLOGIES = {"disaggregated": "marginal_cost", "colocated": "colocated"}
TIMEOUT = httpx.Timeout(120.0)


def set_policy(client: httpx.Client, name: str, params: dict | None = None) -> None:
    r = client.post("/admin/policy", json={"name": name, "params": params or {}})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def live(request, stack):
    topology, policy = request.param, TOPOLOGIES[request.param]
    with httpx.Client(base_url=stack.base_url, timeout=TIMEOUT) as http, \
            openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", timeout=120, max_retries=0) as sdk:
        r = http.get("/admin/state")
        assert r.status_code == 200, r.text
        before = r.json()
        set_policy(http, policy)
        try:
            yield Live(sdk=sdk, http=http, topology=topology, policy=policy)
        finally:
            set_policy(http, before["policy"], before["policy_params"])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_conformance(live, case):
    case.run(live)
