"""Offline API: `LLM(model=PATH, **engine_args).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from engine.client import EngineClient, step_outputs
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_args):
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        cfg = EngineConfig(model=str(model), **engine_args)
        if cfg.data_parallel_size > 1:
            from engine.parallel.dp_engine import DPEngineClient

            self.engine: EngineClient = DPEngineClient(cfg)  # rank processes behind the same interface
        else:
            self.engine = EngineCore(cfg)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _requests(
        self,
        prompts: str | Sequence[str] | None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        prompt_token_ids: Sequence[Sequence[int]] | None,
    ) -> list[tuple[str | None, list[int], SamplingParams]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts and prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None:
            texts: list[str | None] = list(prompts)
            ids = [self.tokenizer.encode(p) for p in texts]
        else:
            ids = [list(p) for p in prompt_token_ids]
            texts = [None] * len(ids)
        if sampling_params is None:
            params = [SamplingParams()] * len(ids)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(ids)
        else:
            params = list(sampling_params)
            if len(params) != len(ids):
                raise ValueError(f"got {len(params)} sampling_params for {len(ids)} prompts")
        for i, (p_ids, p) in enumerate(zip(ids, params, strict=True)):
            try:
                self.engine.validate(p_ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return list(zip(texts, ids, params, strict=True))

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in order. Every prompt is
        validated before any runs, so a bad one raises ValueError and nothing is started."""
        requests = self._requests(prompts, sampling_params, prompt_token_ids)
        order = []
        for text, ids, params in requests:
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, ids, params, prompt=text)
            order.append(request_id)
        final: dict[str, RequestOutput] = {}
        for outputs in step_outputs(self.engine, stopping=lambda: not self.engine.has_unfinished_requests()):
            final.update((out.request_id, out) for out in outputs if out.finished)
        return [final[r] for r in order]

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> Iterator[RequestOutput]:
        """Generate one completion, yielding an output (with `new_text`) after every step that
        produced text. Closing the generator early aborts the request."""
        ids_list = None if prompt_token_ids is None else [prompt_token_ids]
        ((text, ids, params),) = self._requests(prompt, sampling_params, ids_list)
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, ids, params, prompt=text)
        try:
            for outputs in step_outputs(
                self.engine, stopping=lambda: not self.engine.has_request(request_id)
            ):
                yield from (out for out in outputs if out.request_id == request_id)
        finally:
            self.engine.abort_request(request_id)  # a no-op when it finished
