"""The public `Inference` gRPC service: protos in, engine types to the router core, protos out.

A chat's tool fields become the dict the HTTP API reads (`chat_tool_request`), checked and enforced
by services/router/tools.py, and its output goes through the same tool-call parser as over HTTP."""

from __future__ import annotations

import dataclasses
import json
import uuid

from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from services.common import convert
from services.common.errors import InvalidArgument, NotFound
from services.router import api_proto
from services.router.api import (
    CHAT_ROLES,
    ConstraintCheck,
    ConstraintError,
    GenerateInput,
    check_prompt_bytes,
    check_prompt_logprobs,
    echo_text,
    prepare_echo,
)
from services.router.core import RouterCore
from services.router.tool_parser import ToolCallParser
from services.router.tools import ToolError, ToolRequest, conflict, tool_request

VERSION = "0.1.0"


def chat_messages(chat: pb.Chat) -> list[dict]:
    """The chat as the template takes it; INVALID_ARGUMENT naming the message for a role the
    template does not render (it would be dropped from the prompt without a word), and for a tool
    message without the id of its call."""
    if not chat.messages:
        raise InvalidArgument("chat.messages must not be empty")
    messages = []
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"chat.messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.role[:64]!r}"
            )
        message = {"role": CHAT_ROLES[m.role], "content": m.content}
        if m.role == "tool":
            if not m.tool_call_id:
                raise InvalidArgument(f"chat.messages[{i}].tool_call_id must be set on a tool message")
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidArgument(
                    f"chat.messages[{i}].tool_calls is only allowed on an assistant message"
                )
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments or "{}"},
                }
                for c in m.tool_calls
            ]
        messages.append(message)
    return messages


TOOL_CHOICE_MODES = {
    pb.TOOL_CHOICE_MODE_AUTO: "auto",
    pb.TOOL_CHOICE_MODE_NONE: "none",
    pb.TOOL_CHOICE_MODE_REQUIRED: "required",
}


def chat_tool_request(chat: pb.Chat) -> ToolRequest | None:
    """The chat's tools, tool_choice and parallel_tool_calls, checked as over HTTP (None without
    tools); INVALID_ARGUMENT naming the field: chat.tools[i].function.name,
    chat.tool_choice.function.name, ... with the HTTP API's wording."""
    body = {
        "tools": [_tool(t, i) for i, t in enumerate(chat.tools)],
        "tool_choice": _tool_choice(chat) if chat.HasField("tool_choice") else None,
        "parallel_tool_calls": chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None,
    }
    try:
        return tool_request(body)
    except ToolError as e:
        raise InvalidArgument(f"chat.{e}") from None


def _tool(tool: pb.Tool, i: int) -> dict:
    function: dict = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except (json.JSONDecodeError, RecursionError) as e:
            raise InvalidArgument(f"chat.tools[{i}].parameters is not valid JSON: {e}") from None
    return {"type": "function", "function": function}


def _tool_choice(chat: pb.Chat) -> str | dict:
    """Chat.tool_choice as OpenAI's tool_choice value."""
    which = chat.tool_choice.WhichOneof("choice")
    if which == "function":
        return {"type": "function", "function": {"name": chat.tool_choice.function.name}}
    if which is None:
        raise InvalidArgument("chat.tool_choice must set mode or function")
    try:
        return TOOL_CHOICE_MODES[chat.tool_choice.mode]
    except KeyError:  # proto3 keeps enum numbers it does not know
        names = ", ".join(pb.ToolChoiceMode.Name(v) for v in TOOL_CHOICE_MODES)
        raise InvalidArgument(
            f"chat.tool_choice.mode must be one of {names}, got {chat.tool_choice.mode}"
        ) from None


def _chat_bytes(chat: pb.Chat) -> int:
    """UTF-8 bytes of a chat's text: contents, call arguments and tools."""
    texts = [m.content for m in chat.messages]
    texts += [c.arguments for m in chat.messages for c in m.tool_calls]
    texts += [t.description + t.parameters for t in chat.tools]
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, core: RouterCore):
        self.core = core

    def _client(self, context) -> str:
        """Who a call comes from: its checked API key, else its peer address."""
        return self.core.client(
            dict(context.invocation_metadata() or ()).get("authorization"), context.peer()
        )

    def _check_model(self, model: str) -> None:
        if model and model != self.core.model_name:
            raise NotFound(f"model {model!r} is not served here (serving {self.core.model_name!r})")

    def _encode(
        self, which: str | None, request, add_special_tokens: bool = True
    ) -> tuple[list[int], ToolRequest | None]:
        """Token ids of a request's text / token_ids / chat input, and a chat's tool request."""
        tok = self.core.tokenizer
        if which == "text":
            return tok.encode(request.text, add_special_tokens=add_special_tokens), None
        if which == "token_ids":
            return list(request.token_ids.ids), None
        if which == "chat":
            add_gen = (
                request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
            )
            tools = chat_tool_request(request.chat)
            rendered = tok.apply_chat_template(
                chat_messages(request.chat),
                add_generation_prompt=add_gen,
                tools=tools.tools if tools is not None else None,
            )
            return tok.encode(rendered, add_special_tokens=False), tools  # the template writes the BOS
        raise InvalidArgument("prompt is required: set text, token_ids or chat")

    def _check_prompt_bytes(self, which: str | None, request) -> None:
        """Refuse, before tokenizing, a text that cannot fit in the context window."""
        if which == "text":
            num_bytes = len(request.text.encode("utf-8", "surrogatepass"))
        elif which == "chat":
            num_bytes = _chat_bytes(request.chat)
        else:
            return
        check_prompt_bytes(num_bytes, self.core.tokenizer, self.core.max_model_len)

    async def Generate(self, request: pb.GenerateRequest, context):
        self._check_model(request.model)
        label = request.request_id or uuid.uuid4().hex  # echoed back; the router's own ids differ
        which = request.WhichOneof("prompt")
        if which == "text" and not request.text:
            raise InvalidArgument("prompt text must not be empty")
        params = convert.sampling_from_proto(request.sampling)
        inp = GenerateInput(
            request_id=label,
            prompt_token_ids=[],
            params=params,
            mode=api_proto.serving_mode_from_proto(request.mode),
            kv_failure_policy=api_proto.kv_failure_policy_from_proto(request.kv_failure_policy),
            score_only=prepare_echo(params) if request.echo else False,
        )
        self._check_prompt_bytes(which, request)
        client = self._client(context)
        async with self.core.admit(1, context.time_remaining()) as queued:
            # Tokenizing (and rendering a chat template) costs time linear in the text: off the
            # loop, fairly among clients.
            inp.prompt_token_ids, tools = await self.core.prepare(client, self._encode, which, request)
            field = "sampling.prompt_logprobs" if not request.echo else "sampling.logprobs"
            try:
                check_prompt_logprobs(len(inp.prompt_token_ids), params.prompt_logprobs, field)
            except ValueError as e:
                raise InvalidArgument(str(e)) from None
            checks = []
            if inp.params.structured_outputs is not None:  # the grammar library's own check
                kind = request.sampling.structured_outputs.WhichOneof("kind")
                field = "sampling.structured_outputs"
                checks.append(ConstraintCheck(inp.params.structured_outputs, field, f"{field}.{kind}", field))
            constraint = tools.constraint() if tools is not None else None
            if constraint is not None:  # tool_choice required or a named function
                if inp.params.structured_outputs is not None:
                    raise InvalidArgument(f"chat.{conflict(tools, 'sampling.structured_outputs')}")
                inp.params.structured_outputs = constraint
                checks = tools.checks("chat.")
            try:
                await self.core.check_constraints(client, checks)
            except ConstraintError as e:
                raise InvalidArgument(str(e)) from None
            try:  # the context first, then what the hand-over would pin
                self.core.validate(inp.prompt_token_ids, params)
                self.core.check_fits([inp.prompt_token_ids], 1, inp.mode)
            except ValueError as e:
                raise InvalidArgument(str(e)) from None
            parser = ToolCallParser(tools.max_calls) if tools is not None and tools.parse else None
            echo = None
            if request.echo:
                text = request.text if which == "text" else None
                echo = await self.core.prepare(
                    client, echo_text, text, inp.prompt_token_ids, params, self.core.tokenizer
                )
            inp.timeout, inp.queued, inp.client = context.time_remaining(), queued, client
            async for delta in self.core.generate(inp):
                calls = []
                if parser is not None:  # the text before the calls, and the calls
                    released, finish_reason = parser.feed_delta(delta.text, delta.finish_reason)
                    delta = dataclasses.replace(delta, text=released.content, finish_reason=finish_reason)
                    calls = released.calls
                msg = api_proto.delta_to_proto(label, delta, calls)
                if echo is not None:  # the first message
                    msg.echo_token_ids.extend(inp.prompt_token_ids)
                    msg.echo_text, echo = echo, None
                yield msg

    async def Complete(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        return api_proto.merge_responses([msg async for msg in self.Generate(request, context)])

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self._check_model(request.model)
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        which = request.WhichOneof("input")
        self._check_prompt_bytes(which, request)
        async with self.core.admit(1, context.time_remaining()):
            ids, _ = await self.core.prepare(self._client(context), self._encode, which, request, add)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.core.max_model_len)

    def _card(self) -> pb.ModelCard:
        return pb.ModelCard(
            id=self.core.model_name, max_model_len=self.core.max_model_len, vocab_size=self.core.vocab_size
        )

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[self._card()])

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        workers = [
            pb.WorkerSummary(
                endpoint=w.endpoint,
                role=w.role,
                dp_rank=w.info.dp_rank if w.info else 0,
                epoch=w.info.identity.epoch if w.info else 0,
                healthy=w.healthy,
            )
            for w in self.core.pool.workers.values()
        ]
        return pb.GetServerInfoResponse(version=VERSION, models=[self._card()], workers=workers)
