"""Protos <-> engine types, in one place: handlers convert at the edge and work in engine types."""

from __future__ import annotations

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from pdserve.v1 import inference_pb2 as pb
from services.router.api import Delta, KvFailurePolicy, ServingMode, Timings, Usage

_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
)

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}

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


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    return SamplingParams(
        **kwargs,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logit_bias=dict(msg.logit_bias) or None,
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        stop=params.stop, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.logit_bias:
        msg.logit_bias.update(params.logit_bias)
    return msg


def logprobs_to_proto(entries: list[dict[int, float] | None]) -> list[pb.Logprobs]:
    return [
        pb.Logprobs(token_ids=list(e), logprobs=list(e.values())) if e is not None else pb.Logprobs()
        for e in entries
    ]


def logprobs_from_proto(msgs) -> list[dict[int, float] | None]:
    return [dict(zip(m.token_ids, m.logprobs, strict=True)) if m.token_ids else None for m in msgs]


def _set_stop_reason(msg: pb.GenerateResponse, reason: int | str | None) -> None:
    if isinstance(reason, str):
        msg.stop_string = reason
    elif isinstance(reason, int):
        msg.stop_token_id = reason


def output_to_proto(out: RequestOutput, first: bool) -> pb.GenerateResponse:
    """This step's delta of an engine output (logprobs of the new tokens; prompt logprobs on the first)."""
    n = len(out.new_token_ids)
    msg = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text)
    if out.logprobs is not None and n:
        msg.logprobs.extend(logprobs_to_proto(out.logprobs[-n:]))
    if first and out.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs[1:]))
    if out.finished and out.finish_reason in FINISH_REASONS:
        msg.finish_reason = FINISH_REASONS[out.finish_reason]
        _set_stop_reason(msg, out.stop_reason)
    return msg


def merge(into: pb.GenerateResponse, more: pb.GenerateResponse) -> None:
    """Append a later delta to an earlier one (several tokens ready together go in one message)."""
    into.token_ids.extend(more.token_ids)
    into.text += more.text
    into.logprobs.extend(more.logprobs)
    into.prompt_logprobs.extend(more.prompt_logprobs)
    if more.finish_reason:
        into.finish_reason = more.finish_reason
    which = more.WhichOneof("stop_reason")
    if which:
        setattr(into, which, getattr(more, which))


def delta_from_proto(msg: pb.GenerateResponse) -> Delta:
    which = msg.WhichOneof("stop_reason")
    delta = Delta(
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=logprobs_from_proto(msg.logprobs) if len(msg.logprobs) else None,
        prompt_logprobs=[None, *logprobs_from_proto(msg.prompt_logprobs)]
        if len(msg.prompt_logprobs)
        else None,
        finish_reason=_FINISH_NAMES.get(msg.finish_reason),
        stop_reason=getattr(msg, which) if which else None,
        disaggregated=msg.disaggregated,
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


def delta_to_proto(request_id: str, delta: Delta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=FINISH_REASONS.get(delta.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        disaggregated=delta.disaggregated,
    )
    if delta.logprobs:
        msg.logprobs.extend(logprobs_to_proto(delta.logprobs))
    if delta.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_proto(delta.prompt_logprobs[1:]))
    _set_stop_reason(msg, delta.stop_reason)
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
