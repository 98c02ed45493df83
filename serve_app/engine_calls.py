"""What the router's calls to engine replicas share, on the prefill side (`dispatcher`) and on the
decode side (`streams`): the state version a call names, and how a failed call reads.

Apart from both so that neither imports the other for these.
"""

from __future__ import annotations

from serve_app.flight import Flight
from serve_app.messages import InvalidRequest
from serve_app.openai_api import ApiError


def last_line(e: BaseException | None) -> str:
    """A remote error's own message, without the Ray traceback around it."""
    lines = str(e).strip().splitlines()
    return lines[-1][:500] if lines else type(e).__name__


def refusal(e: BaseException) -> InvalidRequest | None:
    """The engine's `InvalidRequest` behind `e`, if that is what `e` is: Ray delivers it as a
    `RayTaskError` that is also an `InvalidRequest`, with the original as `.cause`."""
    for x in (getattr(e, "cause", None), e):
        if isinstance(x, InvalidRequest):
            return x
    return None


# the request fields behind an engine-side sampling parameter, by preference
_FIELDS_OF = {"structured_outputs": ("structured_outputs", "response_format", "tool_choice"),
              "logprobs": ("top_logprobs", "logprobs")}


def bad_request(refused: InvalidRequest, f: Flight) -> ApiError:
    """An engine's refusal as a 400 naming the field the client set."""
    param = refused.param
    if param in _FIELDS_OF:
        param = next((name for name in _FIELDS_OF[param] if name in f.fields), param)
    return ApiError(f"{param}: {refused.message}" if param else refused.message, param=param, kind="BadRequestError")


def decided_on(f: Flight, instance_id: str) -> tuple[int, float]:
    """(the version of the instance's state the flight was routed on, when): 0 for an instance its
    decision did not pick (a retry elsewhere), whose state age is then not measured."""
    return f.state_seen.get(instance_id, 0), f.decided_at
