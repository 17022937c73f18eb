"""Stop strings (SGLang's sampling_params.stop) in the real torch engine over HTTP: generation ends once the
output text holds one; the matched tokens stay in output_ids; finish_reason stop with matched = the string."""
from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def engine(varied_model_dir):
    from spillover.rollout.torch_engine.server import TorchEngineServer

    server = TorchEngineServer(str(varied_model_dir), port=0, max_running_requests=4, seed=0)
    server.start()
    yield server
    server.stop()


def generate(engine, ids, **params):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0, **params},
            "return_logprob": True}
    response = httpx.post(engine.url + "/generate", json=body, timeout=60)
    return response


def test_stop_string_ends_generation_where_the_text_first_holds_it(engine):
    from spillover.infra.models import load_tokenizer

    tok = load_tokenizer(engine.model_path)
    prompt = tok("1+2=", add_special_tokens=False)["input_ids"]
    free = generate(engine, prompt, ignore_eos=True).json()
    text = tok.decode(free["output_ids"])
    assert len(free["output_ids"]) == 24, text
    stop = text[5:7]  # a two-character string the greedy output holds; it may first appear earlier
    first_end = text.index(stop) + len(stop)
    answer = generate(engine, prompt, ignore_eos=True, stop=[stop, "never-seen"]).json()
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert answer["output_ids"] == free["output_ids"][:first_end]  # char tokens: one token per character
    assert len(answer["meta_info"]["output_token_logprobs"]) == first_end
    single = generate(engine, prompt, ignore_eos=True, stop=stop).json()  # a single string is accepted too
    assert single["output_ids"] == answer["output_ids"]


def test_bad_stop_values_are_refused(engine):
    response = generate(engine, [3, 4], stop=[""])
    assert response.status_code == 400 and "stop" in response.text
    response = generate(engine, [3, 4], stop=[f"s{i}" for i in range(33)])
    assert response.status_code == 400 and "at most 32" in response.text
