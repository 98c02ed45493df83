"""The router's control plane, behind `/admin/*` (the ingress holds the routes and delegates here).

- `state()`: the models' policies and cost models, every live instance's latest poll with its
  ledger backlog and queue, the requests in flight and the counters;
- `set_policy(body)`: switch P/D policy without restarting engines: `{"name", "params", "model"}`;
- `set_cost_model(body)`: reload a model's cost model: a shipped profile name, or a YAML file inside
  `router.cost_model_dir` (`access.CostModelFiles`; anything else is one 400 that does not
  say whether the path exists);
- `prefix(body)`: what this router replica's prefix index says each instance holds of a prompt,
  `{"prompt_token_ids": [...], "model"}`: its leading cached tokens, and whether that comes from
  the engine's KV events or the router's model of the cache;
- `reset_prefix_cache()`: drop every engine's cached prefixes (between benchmark runs), and
  `forget_prefixes()` this router replica's index of them (the ingress has every replica do it);
- `probe(body)`: one calibration measurement on exactly one instance (`disagg calibrate --live`):
  `{"instance", "kind": "prefill"|"decode", "size", "tokens", "seed", "repeats", "context"}`, sizes bounded
  by what the model's engines take.
A body naming no `model` applies to every model. Invalid bodies raise `ApiError` (400) naming the
field, and change nothing: every target's new policy is built before any is swapped in.
Who may call these is the ingress's business (`access.Access.admin`), checked before they run.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Mapping

from disagg.core.cost_model import CostModel, CostModelError, SharedHost
from disagg.core.ledger import Ledger
from disagg.core.policies import PolicyError, build_policy, known_policies
from disagg.core.prefix_index import prompt_block_hashes
from serve_app.access import CostModelFiles
from serve_app.messages import PROBE_CONTEXT, ProbeCall, ProbeKind
from serve_app.openai_api import ApiError
from serve_app.registry import Instance, InstanceRegistry
from serve_app.request_log import Counters
from serve_app.served_model import ServedModel

PROBE_TOKENS = 32  # a decode probe's tokens per stream, unless the body says
PROBE_MAX_TOKENS = 512
PROBE_MAX_REPEATS = 16
PROBE_TIMEOUT_S = 60.0


def one_host(cost_models: Mapping[str, CostModel]) -> SharedHost | None:
    """The host the models' engines share, pooled from each model's measurement of it; None when
    every engine owns its device. CostModelError when two describe hosts of different sizes: the
    models of one app run on one host, and pricing one with another's cores would be wrong."""
    hosts = {name: cm.shared_host for name, cm in cost_models.items() if cm.shared_host is not None}
    try:
        return SharedHost.pooled(list(hosts.values())) if hosts else None
    except ValueError:
        sizes = ", ".join(f"{name}: {h.cores:g}" for name, h in hosts.items())
        raise CostModelError(f"shared_host.cores: the models of one app share one host, these cost models "
                             f"describe hosts of different sizes ({sizes} cores)") from None


class Admin:
    def __init__(self, models: Mapping[str, ServedModel], registry: InstanceRegistry, ledger: Ledger,
                 counters: Counters, alias: str | None, lam: float, replica_index: int = 0,
                 cost_model_files: CostModelFiles = CostModelFiles()) -> None:
        self.models = models
        one_host({name: m.cost_model for name, m in models.items()})  # one host, or say which file disagrees
        self.cost_model_files = cost_model_files  # what set_cost_model may load (default: profile names only)
        self.replica_index = replica_index  # policies are built for this router replica (`Policy.for_replica`)
        self.registry = registry
        self.ledger = ledger
        self.counters = counters
        self.alias = alias
        self.lam = lam
        # the changes applied since the config (`apply`): the latest per (op, model), in the order they came
        self._changes: dict[tuple[str, str | None], bytes] = {}

    def apply(self, op: str, raw_body: bytes) -> dict:
        """Apply a change (`set_policy` or `set_cost_model`) and keep it, replacing the earlier one of
        its kind: replaying the latest of each (op, model) in their order ends in the same state as
        replaying them all, which is how a router replica starting later catches up (`changes`)."""
        out = getattr(self, op)(raw_body)
        key = (op, json.loads(raw_body).get("model"))
        self._changes.pop(key, None)
        self._changes[key] = raw_body
        return out

    def changes(self) -> list[tuple[str, bytes]]:
        """The changes applied since the config, as (op, body), in order."""
        return [(op, body) for (op, _), body in self._changes.items()]

    def state(self) -> dict:
        first = next(iter(self.models.values()))  # the one-model fields predate several models
        return {
            "policy": first.policy.name, "policy_params": first.policy_params,
            "cost_model": first.cost_model.name, "alias": self.alias, "lambda": self.lam,
            "models": {m.name: {"policy": m.policy.name, "policy_params": m.policy_params,
                                "cost_model": m.cost_model.name,
                                "layout": "colocated" if m.cfg.is_colocated else "disaggregated",
                                "prefix_index_block_tokens": m.prefix_index.block_tokens if m.prefix_index else None,
                                # what `disagg calibrate --live` needs to know of the fleet
                                "source": m.cfg.model.source, "max_model_len": m.cfg.model.max_model_len,
                                "max_num_seqs": m.cfg.engine.max_num_seqs,
                                "stream_interval_s": m.cfg.engine.stream_interval_s,
                                "stream_interval_max_s": m.cfg.engine.stream_interval_max_s,
                                "cost_model_constants": m.cost_model.to_dict()}
                       for m in self.models.values()},
            "instances": {i.instance_id: {"role": i.role.value, "model": i.model, **i.report.as_dict(),
                                          "backlog_s": self.ledger.backlog_s(i.instance_id),
                                          "queued": self.ledger.queued(i.instance_id),
                                          "prefix_index_blocks": self._indexed_blocks(i.model, i.instance_id),
                                          "prefix_source": self._prefix_source(i.model, i.instance_id),
                                          **self._constants(i)}
                          for i in self.registry.instances.values()},
            "in_flight": len(self.ledger), "counters": asdict(self.counters),
        }

    def _constants(self, inst: Instance) -> dict:
        """The constants the router prices this instance with, and whether they were measured on it
        (`disagg calibrate --live`, with `measured_at`) or are its model's pool-wide ones."""
        cm = self.models[inst.model].cost_model
        own = inst.instance_id in cm.instances
        return {"constants": self.registry.constants(self.models[inst.model], inst).model_dump(mode="json"),
                "constants_source": "instance" if own else "pool"}

    def _indexed_blocks(self, model: str, instance_id: str) -> int:
        """Blocks this router replica's prefix index believes the instance holds."""
        index = self.models[model].prefix_index
        return index.blocks_held().get(instance_id, 0) if index else 0

    def _prefix_source(self, model: str, instance_id: str) -> str:
        """"events" (the engine's KV events), "model" (what the router sent where) or "none" (nothing known)."""
        index = self.models[model].prefix_index
        if index is None or index.lookup(instance_id) is None:
            return "none"
        return "events" if index.exact(instance_id) else "model"

    def prefix(self, raw_body: bytes) -> dict:
        """What this replica's index says each of a model's instances holds of a prompt."""
        body = _json_object(raw_body, '{"prompt_token_ids": [<int>, ...], "model": <name>}', "prompt_token_ids")
        ids = body.get("prompt_token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError("prompt_token_ids must be a non-empty list of integers", param="prompt_token_ids")
        targets = self._targets(body)
        if len(targets) != 1:
            raise ApiError(f"model is required when several are served: {sorted(self.models)}", param="model")
        m = targets[0]
        index = m.prefix_index
        if index is None:
            return {"model": m.name, "block_tokens": None, "instances": {}}
        hashes = prompt_block_hashes(ids, index.block_tokens)
        reusable = (len(ids) - 1) // index.block_tokens  # vLLM recomputes a prompt's last token

        def cached_tokens(instance_id: str) -> int:
            lookup = index.lookup(instance_id)
            return min(lookup(hashes), reusable) * index.block_tokens if lookup else 0

        return {"model": m.name, "block_tokens": index.block_tokens,
                "instances": {i.instance_id: {"role": i.role.value, "cached_tokens": cached_tokens(i.instance_id),
                                              "source": self._prefix_source(m.name, i.instance_id)}
                              for i in self.registry.instances.values() if i.model == m.name}}

    def _targets(self, body: dict) -> list[ServedModel]:
        """The models an admin call applies to: `model` in the body, else all of them."""
        name = body.get("model")
        if name is None:
            return list(self.models.values())
        if name not in self.models:
            raise ApiError(f"unknown model {name!r}; served: {sorted(self.models)}", param="model")
        return [self.models[name]]

    def set_policy(self, raw_body: bytes) -> dict:
        """{"name": ..., "params": {...}, "model": ...} (without `model`: every model; a colocated
        model takes only 'colocated')."""
        try:
            body = json.loads(raw_body)
            name, params = body["name"], body.get("params") or {}
            targets = self._targets(body)
            built = []
            for m in targets:
                policy = build_policy(name, m.cost_model, params).for_replica(self.replica_index)
                if policy.simulator_only:
                    raise PolicyError(f"policy {name!r} runs in the simulator only")
                if m.cfg.is_colocated and name != "colocated":
                    raise ApiError(f"model {m.name!r} is colocated: its only policy is 'colocated'", param="model")
                built.append(policy)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ApiError('body must be {"name": <policy>, "params": {...}}', param="name") from None
        except PolicyError as e:
            raise ApiError(str(e), param="name") from None
        for m, policy in zip(targets, built):
            m.policy, m.policy_params = policy, dict(params)
        return {"policy": name, "params": params, "models": [m.name for m in targets],
                "known": known_policies(False)}

    def set_cost_model(self, raw_body: bytes) -> dict:
        """{"cost_model": <profile name, or YAML path inside cost_model_dir>, "model": ...} (`model` may
        be left out when the app serves one model); the model's policy is rebuilt on it."""
        try:
            body = json.loads(raw_body)
            source = body["cost_model"]
            targets = self._targets(body)
            if len(targets) != 1:
                raise ApiError(f"this app serves {len(self.models)} models: name one with 'model'", param="model")
            m = targets[0]
            cm = self.cost_model_files.load(source)
            if cm.calibrated and cm.model and cm.model != m.cfg.model.source:
                raise CostModelError(f"{source} was calibrated for model {cm.model!r}; this app serves "
                                     f"{m.cfg.model.source!r}")
            one_host({**{n: o.cost_model for n, o in self.models.items()}, m.name: cm})
            policy = build_policy(m.policy.name, cm, m.policy_params).for_replica(self.replica_index)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ApiError('body must be {"cost_model": <profile name or path>}', param="cost_model") from None
        except (CostModelError, PolicyError) as e:
            raise ApiError(str(e), param="cost_model") from None
        m.cost_model, m.policy = cm, policy
        return {"cost_model": cm.name, "calibrated": cm.calibrated, "model": m.name}

    async def probe(self, raw_body: bytes) -> dict:
        """Run one calibration probe on the instance the body names; 400 naming the field for a bad
        body, an unknown instance or a size its engines cannot take."""
        body = _json_object(raw_body, '{"instance": <id>, "kind": "prefill"|"decode", "size": <int>}', "instance")
        inst = self.registry.get(body.get("instance")) if isinstance(body.get("instance"), str) else None
        if inst is None:
            raise ApiError(f"instance must be a live instance id, got {body.get('instance')!r}; live: "
                           f"{sorted(self.registry.instances)}", param="instance")
        try:
            kind = ProbeKind(body.get("kind"))
        except ValueError:
            raise ApiError(f"kind must be one of {[k.value for k in ProbeKind]}, got {body.get('kind')!r}",
                           param="kind") from None
        cfg = self.models[inst.model].cfg
        top = cfg.model.max_model_len - 1 if kind is ProbeKind.PREFILL else cfg.engine.max_num_seqs
        size = _bounded_int(body, "size", 1, top, None)
        tokens = _bounded_int(body, "tokens", 2, PROBE_MAX_TOKENS, PROBE_TOKENS) if kind is ProbeKind.DECODE else 1
        seed = _bounded_int(body, "seed", 0, 2**31 - 1, 0)
        repeats = _bounded_int(body, "repeats", 1, PROBE_MAX_REPEATS, 1)
        # a decode stream's prompt: its KV and the steps' context stay within the model's length
        context = _bounded_int(body, "context", 1, cfg.model.max_model_len - tokens, PROBE_CONTEXT) \
            if kind is ProbeKind.DECODE else PROBE_CONTEXT
        handle = self.models[inst.model].handles[inst.role]
        try:
            reply = await asyncio.wait_for(
                handle.probe.remote(ProbeCall(kind, size, tokens, seed, repeats, context), replica=inst.replica),
                PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(f"the probe on {inst.instance_id} took over {PROBE_TIMEOUT_S:g} s", status=504,
                           kind="timeout_error", param="instance") from None
        except Exception as e:  # the engine failed it: say which and why, not a bare 500
            why = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
            raise ApiError(f"the probe on {inst.instance_id} failed: {why}", status=502, kind="engine_error",
                           param="instance") from None
        if reply.replica != inst.replica:  # the pinned replica left between the lookup and the call
            raise ApiError(f"instance {inst.instance_id} is gone; probed {reply.replica} instead, discarded",
                           status=409, kind="conflict", param="instance")
        return {"instance": inst.instance_id, "kind": kind.value, "size": size, "tokens": tokens, "repeats": repeats,
                "context": context,
                "seconds": reply.seconds, "samples": list(reply.samples), "kv_capacity_tokens": reply.kv_capacity_tokens}

    def forget_prefixes(self, raw_body: bytes = b"") -> dict:
        """Empty this replica's prefix index (the engines' caches were reset)."""
        for m in self.models.values():
            if m.prefix_index is not None:
                m.prefix_index.clear()
        return {}

    async def reset_prefix_cache(self) -> dict:
        out = {}
        for m in self.models.values():
            for role, h in m.handles.items():
                key = role.value if len(self.models) == 1 else f"{m.name}:{role.value}"
                out[key] = await h.broadcast("reset_prefix_cache").results_async(timeout_s=30.0)
        return out


def _json_object(raw_body: bytes, shape: str, param: str) -> dict:
    """The body as a JSON object, or a 400 naming `param` and the expected `shape`."""
    try:
        body = json.loads(raw_body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        raise ApiError(f"body must be {shape}", param=param)
    return body


def _bounded_int(body: dict, key: str, low: int, high: int, default: int | None) -> int:
    v = body.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ApiError(f"{key} must be an integer in [{low}, {high}], got {v!r}", param=key)
    return v
