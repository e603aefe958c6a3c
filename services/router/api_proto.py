"""The router's API types (services/router/api.py) <-> protos: serving modes, KV failure
policies, the stream deltas the router relays (with the tool calls parsed from them) and a whole
answer made of them."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.v1 import inference_pb2 as pb
from services.common.convert import (
    FINISH_NAMES,
    FINISH_REASONS,
    logprobs_from_proto,
    logprobs_to_proto,
    set_stop_reason,
)
from services.router.api import Delta, KvFailurePolicy, ServingMode, Timings, Usage
from services.router.tool_parser import CallDelta

SERVING_MODES = {
    pb.SERVING_MODE_AUTO: ServingMode.AUTO,
    pb.SERVING_MODE_DISAGGREGATED: ServingMode.DISAGGREGATED,
    pb.SERVING_MODE_COLOCATED: ServingMode.COLOCATED,
}
KV_FAILURE_POLICIES = {
    pb.KV_FAILURE_POLICY_FAIL: KvFailurePolicy.FAIL,
    pb.KV_FAILURE_POLICY_RECOMPUTE: KvFailurePolicy.RECOMPUTE,
}
KV_FAILURE_POLICY_TO_PROTO = {v: k for k, v in KV_FAILURE_POLICIES.items()}


def serving_mode_from_proto(value: int) -> ServingMode:
    """GenerateRequest.mode as a ServingMode; ValueError naming `mode` for a value outside the enum."""
    return _enum_from_proto("mode", pb.ServingMode, SERVING_MODES, value)


def kv_failure_policy_from_proto(value: int) -> KvFailurePolicy:
    """kv_failure_policy as a KvFailurePolicy; ValueError naming the field for a value outside the enum."""
    return _enum_from_proto("kv_failure_policy", pb.KvFailurePolicy, KV_FAILURE_POLICIES, value)


def _enum_from_proto(field: str, enum, table: dict, value: int):
    # proto3 keeps enum numbers it does not know (a newer or a hostile client): not our bug, theirs.
    try:
        return table[value]
    except KeyError:
        names = ", ".join(enum.Name(v) for v in table)
        raise ValueError(f"{field} must be one of {names}, got {value!r}") from None


def delta_from_proto(msg: pb.GenerateResponse) -> Delta:
    which = msg.WhichOneof("stop_reason")
    delta = Delta(
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=logprobs_from_proto(msg.logprobs) if len(msg.logprobs) else None,
        prompt_logprobs=[None, *logprobs_from_proto(msg.prompt_logprobs)]
        if len(msg.prompt_logprobs)
        else None,
        finish_reason=FINISH_NAMES.get(msg.finish_reason),
        stop_reason=getattr(msg, which) if which else None,
        disaggregated=msg.disaggregated,
        error=msg.error or None,
    )
    if msg.HasField("usage"):
        u = msg.usage
        delta.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.kv_transfer_bytes)
    if msg.HasField("timings"):
        t = msg.timings
        delta.timings = Timings(
            t.queue_ns / 1e9, t.prefill_ns / 1e9, t.kv_transfer_ns / 1e9, t.ttft_ns / 1e9, t.e2e_ns / 1e9
        )
    return delta


def delta_to_proto(request_id: str, delta: Delta, calls: Sequence[CallDelta] = ()) -> pb.GenerateResponse:
    """A delta and the parts of tool calls parsed from it (its text is then the content only)."""
    msg = pb.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=FINISH_REASONS.get(delta.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        disaggregated=delta.disaggregated,
        tool_calls=[
            pb.ToolCallDelta(index=c.index, id=c.id or "", name=c.name or "", arguments=c.arguments)
            for c in calls
        ],
    )
    if delta.logprobs:
        msg.logprobs.extend(logprobs_to_proto(delta.logprobs))
    if delta.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_proto(delta.prompt_logprobs[1:]))
    set_stop_reason(msg, delta.stop_reason)
    if delta.usage is not None:
        u = delta.usage
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_tokens=u.cached_tokens,
                kv_transfer_bytes=u.kv_transfer_bytes,
            )
        )
    if delta.timings is not None:
        t = delta.timings
        msg.timings.CopyFrom(
            pb.Timings(
                queue_ns=int(t.queue * 1e9),
                prefill_ns=int(t.prefill * 1e9),
                kv_transfer_ns=int(t.kv_transfer * 1e9),
                ttft_ns=int(t.ttft * 1e9),
                e2e_ns=int(t.e2e * 1e9),
            )
        )
    return msg


def merge_responses(msgs: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """A stream's messages as one answer: token ids, logprobs, text and echo concatenated, each
    tool call whole (its parts' arguments in order), the rest from the message that set it (the
    last one's finish_reason, stop_reason, usage, timings)."""
    out = pb.GenerateResponse()
    text, echo = [], []
    calls: dict[int, pb.ToolCallDelta] = {}
    for msg in msgs:
        text.append(msg.text)
        echo.append(msg.echo_text)
        for part in msg.tool_calls:
            if part.index in calls:
                calls[part.index].arguments += part.arguments
            else:
                calls[part.index] = pb.ToolCallDelta()
                calls[part.index].CopyFrom(part)
        rest = pb.GenerateResponse()
        rest.CopyFrom(msg)
        rest.ClearField("text")
        rest.ClearField("echo_text")
        rest.ClearField("tool_calls")
        out.MergeFrom(rest)  # repeated fields append, set scalars and messages overwrite
    out.text, out.echo_text = "".join(text), "".join(echo)
    out.tool_calls.extend(calls[i] for i in sorted(calls))
    return out
