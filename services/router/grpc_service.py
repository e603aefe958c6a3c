"""The public `Inference` gRPC service: protos in, engine types to the router core, protos out."""

from __future__ import annotations

import uuid

from engine.structured.compiler import check as check_structured_outputs
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from services.common import convert
from services.common.errors import InvalidArgument, NotFound
from services.router import api_proto
from services.router.api import CHAT_ROLES, GenerateInput, check_prompt_bytes, echo_text, prepare_echo
from services.router.core import RouterCore

VERSION = "0.1.0"


def chat_messages(chat: pb.Chat) -> list[dict]:
    """The chat as the template takes it; INVALID_ARGUMENT naming the message for a role the
    template does not render (it would be dropped from the prompt without a word)."""
    if not chat.messages:
        raise InvalidArgument("chat.messages must not be empty")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"chat.messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.role[:64]!r}"
            )
    return [{"role": CHAT_ROLES[m.role], "content": m.content} for m in chat.messages]


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, core: RouterCore):
        self.core = core

    def _check_model(self, model: str) -> None:
        if model and model != self.core.model_name:
            raise NotFound(f"model {model!r} is not served here (serving {self.core.model_name!r})")

    def _encode(self, which: str | None, request, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a request's text / token_ids / chat input."""
        tok = self.core.tokenizer
        if which == "text":
            return tok.encode(request.text, add_special_tokens=add_special_tokens)
        if which == "token_ids":
            return list(request.token_ids.ids)
        if which == "chat":
            add_gen = (
                request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
            )
            rendered = tok.apply_chat_template(chat_messages(request.chat), add_generation_prompt=add_gen)
            return tok.encode(rendered, add_special_tokens=False)  # the template writes the BOS
        raise InvalidArgument("prompt is required: set text, token_ids or chat")

    def _check_prompt_bytes(self, which: str | None, request) -> None:
        """Refuse, before tokenizing, a text that cannot fit in the context window."""
        if which == "text":
            num_bytes = len(request.text.encode("utf-8", "surrogatepass"))
        elif which == "chat":
            num_bytes = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in request.chat.messages)
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
        async with self.core.admit(1, context.time_remaining()) as queued:
            # Tokenizing (and rendering a chat template) costs time linear in the text: off the loop.
            inp.prompt_token_ids = await self.core.off_loop(self._encode, which, request)
            if inp.params.structured_outputs is not None:  # the grammar library's own check
                kind = request.sampling.structured_outputs.WhichOneof("kind")
                await self.core.off_loop(
                    check_structured_outputs,
                    inp.params.structured_outputs,
                    "sampling.structured_outputs",
                    f"sampling.structured_outputs.{kind}",
                )
            echo = None
            if request.echo:
                text = request.text if which == "text" else None
                echo = await self.core.off_loop(
                    echo_text, text, inp.prompt_token_ids, params, self.core.tokenizer
                )
            inp.timeout, inp.queued = context.time_remaining(), queued
            async for delta in self.core.generate(inp):
                msg = api_proto.delta_to_proto(label, delta)
                if echo is not None:  # the first message
                    msg.echo_token_ids.extend(inp.prompt_token_ids)
                    msg.echo_text, echo = echo, None
                yield msg

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self._check_model(request.model)
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        which = request.WhichOneof("input")
        self._check_prompt_bytes(which, request)
        async with self.core.admit(1, context.time_remaining()):
            ids = await self.core.off_loop(self._encode, which, request, add)
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
