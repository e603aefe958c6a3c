"""lm-eval's `local-completions` model, unchanged, against a served stack (router, prefill and
decode workers as processes, every request disaggregated): a local multiple-choice task
(loglikelihood: `echo`, `logprobs: 1`, context + continuation as token ids) and a local
generate_until task (token-id prompts, lm-eval's stop sequences and max_gen_toks). The
multiple-choice task runs twice: with the tokenizer read from the model folder, and with the
`remote` tokenizer backend lm-eval picks by itself when given no tokenizer (the server's /tokenize,
/detokenize and /tokenizer_info), which must tokenize alike.

Each choice's loglikelihood lm-eval logs equals the sum of the offline engine's prompt logprobs over
that choice's continuation tokens, taken from the very token ids lm-eval sent, and its is_greedy
flag agrees; the task's accuracy is what those sums give; every generation equals the offline
engine's greedy output for the same prompt, stops and length. Nothing is downloaded: the tasks and
their data are written to tmp_path, the tokenizer is the model folder's, the hub is offline.
"""

from __future__ import annotations

import copy
import json

import pytest

from engine import LLM, SamplingParams

MODEL = "pdserve-tiny"
ATOL = 1e-4
MC_DOCS = [  # a third choice, the model's own greedy token, is added by the test
    {"question": "2 + 2 =", "choices": [" 4", " 22"], "answer": 0},
    {"question": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " None"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry"], "answer": 1},
]
GEN_PROMPTS = ["def fibonacci(n):\n", "Once upon a time", "import os\nimport"]
MAX_GEN_TOKS = 16


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def hub_offline(tmp_path_factory):
    """Set before lm-eval (and with it `datasets`) is first imported, which reads them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
        yield


@pytest.fixture(scope="module")
def lm(serving_stack, tiny_model, hub_offline):
    """lm-eval's client as its users configure it for a vLLM-style server, the tokenizer read
    from the model folder; every request body it builds is recorded in `lm.sent`."""
    return _local_completions(serving_stack, tokenizer=tiny_model, tokenizer_backend="huggingface")


@pytest.fixture(scope="module")
def remote_lm(serving_stack, hub_offline):
    """The same client given no tokenizer: lm-eval probes the server's tokenizer endpoints and,
    finding them, tokenizes through them (its default tokenizer_backend "auto")."""
    return _local_completions(serving_stack)


def _local_completions(serving_stack, **tokenizer_args):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        model=MODEL,
        base_url=serving_stack.http_url + "/v1/completions",
        batch_size=4,  # several prompts per request, as lm-eval's users run it
        max_retries=1,
        timeout=120,
        **tokenizer_args,
    )
    lm.sent = []
    create = lm._create_payload

    def record(*args, **kwargs) -> dict:
        body = create(*args, **kwargs)
        lm.sent.append(copy.deepcopy(body))
        return body

    lm._create_payload = record
    return lm


def _write_task(folder, name: str, docs: list[dict], **config) -> None:
    """A task YAML (JSON is YAML) over a local JSONL file, as `--include_path` reads it."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(folder / "datasets")},
        "test_split": "test",
        **config,
    }
    (folder / f"{name}.yaml").write_text(json.dumps(task, indent=1))


def _evaluate(lm, folder, task: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(folder), include_defaults=False)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=[task],
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
        random_seed=None,  # leave the session's RNGs alone
        numpy_random_seed=None,
        torch_random_seed=None,
    )


def test_the_remote_tokenizer_backend_tokenizes_as_the_model_folders(lm, remote_lm):
    assert (lm.tokenizer_backend, remote_lm.tokenizer_backend) == ("huggingface", "remote")
    for text in ["2 + 2 =", " Paris", "def add(a, b):\n    return", "héllo ✓"]:
        assert remote_lm.tok_encode(text) == lm.tok_encode(text)
    assert remote_lm.decode_batch([lm.tok_encode("héllo ✓")]) == ["héllo ✓"]
    assert (remote_lm.eot_token_id, remote_lm.eos_string) == (lm.eot_token_id, lm.eos_string)
    # lm-eval's remote prefix_token_id is `bos_token_id or eos_token_id`: EOS for a BOS of id 0, as
    # here (the huggingface backend takes the BOS); the BOS itself comes through the same.
    assert remote_lm.tokenizer.bos_token_id == lm.tokenizer.bos_token_id


@pytest.mark.parametrize("backend", ["lm", "remote_lm"], ids=["huggingface", "remote"])
def test_multiple_choice_loglikelihoods_equal_the_offline_engines(request, backend, offline, tmp_path):
    lm = request.getfixturevalue(backend)
    # Each doc also offers the token the model would write next, so is_greedy is true somewhere.
    contexts = [lm.tok_encode(d["question"]) for d in MC_DOCS]
    nexts = offline.generate(
        prompt_token_ids=contexts, sampling_params=SamplingParams(temperature=0, max_tokens=1)
    )
    docs = [
        {**d, "choices": [*d["choices"], lm.tokenizer.decode(o.token_ids)]}
        for d, o in zip(MC_DOCS, nexts, strict=True)
    ]
    _write_task(
        tmp_path,
        "pdserve_mc",
        docs,
        output_type="multiple_choice",
        target_delimiter="",  # the choices carry their own spaces
        doc_to_text="{{question}}",
        doc_to_choice="{{choices}}",
        doc_to_target="{{answer}}",
        metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    )
    lm.sent.clear()
    out = _evaluate(lm, tmp_path, "pdserve_mc")
    bodies = [b for b in lm.sent if b.get("echo")]
    assert bodies and all(b["logprobs"] == 1 and b["max_tokens"] == 1 for b in bodies)
    sent = [ids for b in bodies for ids in b["prompt"]]
    assert len(sent) == sum(len(d["choices"]) for d in docs)

    samples = sorted(out["samples"]["pdserve_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    pairs = [args for s in samples for args in s["arguments"]]
    encoded = [lm._encode_pair(context, continuation) for context, continuation in pairs]
    prompts = [ctx + cont for ctx, cont in encoded]
    assert sorted(prompts) == sorted(sent)  # exactly the token ids lm-eval sent, tokenized as it does
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    refs = offline.generate(prompt_token_ids=prompts, sampling_params=params)
    got = [resp for s in samples for resp in s["filtered_resps"]]
    assert len(got) == len(encoded) == len(refs)
    chosen, greedy = [], []
    for (loglikelihood, is_greedy), (ctx, cont), ref in zip(got, encoded, refs, strict=True):
        entries = [
            (ref.prompt_logprobs[i], ref.prompt_token_ids[i]) for i in range(len(ctx), len(ctx) + len(cont))
        ]
        want = sum(entry[t] for entry, t in entries)
        assert loglikelihood == pytest.approx(want, abs=ATOL)
        assert is_greedy == all(entry[t] == max(entry.values()) for entry, t in entries)
        chosen.append(want)
        greedy.append(is_greedy)
    assert any(greedy) and not all(greedy)
    # The accuracy lm-eval reports is the one the offline engine's scores give.
    k = 0
    correct = []
    for doc in docs:
        scores = chosen[k : k + len(doc["choices"])]
        k += len(doc["choices"])
        correct.append(scores.index(max(scores)) == doc["answer"])
    assert out["results"]["pdserve_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))


def test_generate_until_equals_the_offline_engines_greedy_output(lm, offline, tmp_path):
    from lm_eval.models.utils import handle_stop_sequences

    prompts = [lm.tok_encode(p) for p in GEN_PROMPTS]  # what lm-eval sends: no BOS, as it adds none
    greedy = SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS)
    unstopped = [o.text for o in offline.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    # A stop sequence the first prompt's output runs into: a word from its second half.
    words = [w for w in unstopped[0][len(unstopped[0]) // 2 :].split() if "\ufffd" not in w]
    until = ["\n\n", words[-1]]
    _write_task(
        tmp_path,
        "pdserve_gen",
        [{"prompt": p, "target": ""} for p in GEN_PROMPTS],
        output_type="generate_until",
        doc_to_text="{{prompt}}",
        doc_to_target="{{target}}",
        generation_kwargs={"until": until, "max_gen_toks": MAX_GEN_TOKS},
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    )
    lm.sent.clear()
    out = _evaluate(lm, tmp_path, "pdserve_gen")
    bodies = [b for b in lm.sent if not b.get("echo")]
    stop = handle_stop_sequences(list(until), lm.eos_string)  # lm-eval adds the EOS text
    assert all(b["stop"] == stop and b["max_tokens"] == MAX_GEN_TOKS for b in bodies)
    assert sorted(ids for b in bodies for ids in b["prompt"]) == sorted(prompts)

    samples = sorted(out["samples"]["pdserve_gen"], key=lambda s: s["doc_id"])
    assert [s["arguments"][0][0] for s in samples] == GEN_PROMPTS
    stopped = SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS, stop=stop)
    refs = [o.text for o in offline.generate(prompt_token_ids=prompts, sampling_params=stopped)]
    assert [s["resps"][0][0] for s in samples] == refs
    assert refs[0] != unstopped[0] and unstopped[0].startswith(refs[0])  # the stop sequence cut it
