"""Protos <-> engine types (sampling parameters, outputs, logprobs), for every service: handlers
convert at the edge and work in engine types. The router's own API types convert in
services/router/api_proto.py."""

from __future__ import annotations

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import ConstraintKind, StructuredOutputsParams
from pdserve.v1 import inference_pb2 as pb

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
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,  # set by the router's fronts, never by an engine
}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    return SamplingParams(
        **kwargs,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logit_bias=dict(msg.logit_bias) or None,
        structured_outputs=structured_from_proto(msg.structured_outputs)
        if msg.HasField("structured_outputs")
        else None,
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
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(params.structured_outputs))
    return msg


def structured_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    """ValueError naming structured_outputs when no kind is set (validate checks the rest)."""
    which = msg.WhichOneof("kind")
    if which is None:
        raise ValueError(
            "structured_outputs must set one of json_schema, json_object, regex, choice, grammar"
        )
    if which == "json_schema":
        return StructuredOutputsParams(json=msg.json_schema)
    if which == "json_object":
        if not msg.json_object:
            raise ValueError("structured_outputs.json_object must be true when set")
        return StructuredOutputsParams(json_object=True)
    if which == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.choices))
    return StructuredOutputsParams(**{which: getattr(msg, which)})


def structured_to_proto(params: StructuredOutputsParams) -> pb.StructuredOutputs:
    kind, text = params.key()  # a schema travels as its compact JSON text
    if kind is ConstraintKind.JSON:
        return pb.StructuredOutputs(json_schema=text)
    if kind is ConstraintKind.JSON_OBJECT:
        return pb.StructuredOutputs(json_object=True)
    if kind is ConstraintKind.CHOICE:
        return pb.StructuredOutputs(choice=pb.Choices(choices=params.choice))
    return pb.StructuredOutputs(**{kind.value: text})  # regex, grammar


def logprobs_to_proto(entries: list[dict[int, float] | None]) -> list[pb.Logprobs]:
    return [
        pb.Logprobs(token_ids=list(e), logprobs=list(e.values())) if e is not None else pb.Logprobs()
        for e in entries
    ]


def logprobs_from_proto(msgs) -> list[dict[int, float] | None]:
    return [dict(zip(m.token_ids, m.logprobs, strict=True)) if m.token_ids else None for m in msgs]


def set_stop_reason(msg: pb.GenerateResponse, reason: int | str | None) -> None:
    if isinstance(reason, str):
        msg.stop_string = reason
    elif isinstance(reason, int):
        msg.stop_token_id = reason


def output_to_proto(out: RequestOutput, first: bool) -> pb.GenerateResponse:
    """This step's delta of an engine output (logprobs of the new tokens; prompt logprobs on the first)."""
    msg = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text)
    if out.new_logprobs:  # not the tail of out.logprobs: the engine thread may have appended since
        msg.logprobs.extend(logprobs_to_proto(out.new_logprobs))
    if first and out.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs[1:]))
    if out.finished and out.finish_reason in FINISH_REASONS:
        msg.finish_reason = FINISH_REASONS[out.finish_reason]
        set_stop_reason(msg, out.stop_reason)
        if out.error:
            msg.error = out.error
    return msg


def merge(into: pb.GenerateResponse, more: pb.GenerateResponse) -> None:
    """Append a later delta to an earlier one (several tokens ready together go in one message);
    what only a request's last message carries comes from `more`."""
    into.token_ids.extend(more.token_ids)
    into.text += more.text
    into.logprobs.extend(more.logprobs)
    into.prompt_logprobs.extend(more.prompt_logprobs)
    if more.finish_reason:
        into.finish_reason = more.finish_reason
        into.error = more.error
    which = more.WhichOneof("stop_reason")
    if which:
        setattr(into, which, getattr(more, which))
    for last_only in ("usage", "timings"):
        if more.HasField(last_only):
            getattr(into, last_only).CopyFrom(getattr(more, last_only))
    into.disaggregated = into.disaggregated or more.disaggregated
