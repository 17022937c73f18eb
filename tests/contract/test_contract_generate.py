"""Every /generate body the driver loop sends, through SGLang 0.5.23's own parse and checks (tests/contract/sglang_oracle.py:
GenerateReqInput, the route's JSON gate, normalize_batch_and_arguments, SamplingParams(...).normalize/.verify).

The bodies are the project's own: the real driver loop (sync, async, multi-turn tool hooks) and evaluation run over
the real dock against SimulatedEngine (SGLang cannot run here), and what they hand the engine goes through
GenerateRequest.body (rollout/sglang/protocol.py), what EngineClient.generate sends for RolloutManager's every
/generate call."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from contract_checks import accepted
from spillover.infra.config.rollout import RolloutConfig
from spillover.infra.config.run_config import load_config
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.bench.simulator.engine import EngineTiming, SimulatedEngine
from spillover.bench.simulator.workload import DEFAULT_EOS, TableLengths, simulated_prompt
from spillover.rollout.sglang.protocol import GenerateRequest
from spillover.rollout.drivers.default_rollout import generate_training_batch
from spillover.rollout.drivers.requests import SamplingSettings, build_requests

VOCAB = 151_936  # Qwen2.5's (the GPU recipes); the simulated engine's tokens stay below it
GPU_RECIPES = ["qwen2.5-0.5b-gsm8k", "qwen2.5-0.5b-math", "qwen2.5-1.5b-gsm8k", "qwen2.5-1.5b-math"]


class Recorder:
    """A fleet (the driver loop's part) that keeps the wire body of every request and answers with SimulatedEngine."""

    def __init__(self, engine=None, stop_after: int | None = None):
        self.engine, self.stop_after = engine, stop_after
        self.bodies: list[dict] = []
        self.num_engines = getattr(engine, "num_engines", 1)

    def generate(self, jobs, on_result=None):
        self.bodies += [job.request.body() for job in jobs]
        if self.engine is None:
            raise Captured
        return self.engine.generate(jobs, on_result=on_result)


class Captured(Exception):
    """Raised by a Recorder without an engine once it has the bodies of the first round."""


def simulated_dock(cfg: RolloutConfig, groups: int, prompt_len: int = 6) -> TransferDock:
    dock = TransferDock.from_config(cfg, [DEFAULT_EOS])
    dock.load_groups(np.arange(groups), [simulated_prompt(g, prompt_len) for g in range(groups)], [0] * groups)
    return dock


def check_all(sglang, bodies: list[dict], context_len: int) -> list[dict]:
    assert bodies, "the driver sent nothing"
    answers = []
    for body in bodies:
        shown = {**body, "input_ids": f"<{len(body['input_ids'])} ids>"}
        answer = accepted(sglang.generate(body, VOCAB, context_len), f"/generate {shown}")
        assert not answer["dropped"], f"SGLang ignores the /generate keys {answer['dropped']} the project sends"
        answers.append(answer)
    return answers


def token_numbers(ids: list[int]) -> str:
    """The simulated engine's tokens have no text: a decode under which no stop string ever matches."""
    return " ".join(map(str, ids))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_partial_rollout_bodies_are_sglangs(sglang, mode, deterministic):
    """Both partial-rollout drivers, with rows cut and continued (reduced max_new_tokens), stop strings, top-k and
    (deterministic_sampling) per-request sampling_seed."""
    cfg = RolloutConfig(global_batch_size=2, n_samples_per_prompt=2, max_tokens=10, max_model_len=24, max_split=3,
                        mode=mode, top_k=20, top_p=0.9, stop=["\n\n"], deterministic_sampling=deterministic)
    lengths = TableLengths({g: [2, 11] if g % 2 else [3, 30] for g in range(8)})
    engine = Recorder(SimulatedEngine(EngineTiming(num_engines=2, slots_per_engine=4), lengths))
    dock = simulated_dock(cfg, dock_groups(cfg))
    generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], weight_version=0, drain=False, seed=11,
                            decode=token_numbers)
    answers = check_all(sglang, engine.bodies, cfg.max_model_len)
    budgets = {body["sampling_params"]["max_new_tokens"] for body in engine.bodies}
    if mode == "sync":  # rounds of 10 // 3 tokens: the last one of a row asks for what is left of max_tokens
        assert budgets == {3, 1}, budgets
    if answers[0]["sampling"] is not None:  # SGLang's own reading of what was sent
        seen = answers[0]["sampling"][0]
        assert (seen["top_p"], seen["stop_strs"], seen["stop_token_ids"]) == (0.9, ["\n\n"], repr({DEFAULT_EOS}))
        assert (seen["sampling_seed"] is not None) == deterministic


def dock_groups(cfg: RolloutConfig) -> int:
    return TransferDock.from_config(cfg, [DEFAULT_EOS]).free_group_slots()


def test_multi_turn_bodies_are_sglangs(sglang, tiny_model_dir):
    """The tool hooks add rollout.tool_call_stop to the stop strings."""
    from spillover.infra.models import load_tokenizer
    from spillover.rollout.drivers.rounds import generate_rounds
    from spillover.rollout.drivers.tool_turns import ToolTurns
    from spillover.rollout.tools.env_pool import EnvPool

    class Quiet:
        async def reset(self, sample):
            return ""

        async def step(self, action):
            raise AssertionError("not reached: the first round is captured")

    cfg = RolloutConfig(global_batch_size=2, n_samples_per_prompt=2, max_tokens=12, max_model_len=24, max_split=2,
                        env_path="contract.Quiet", tool_call_stop=["</tool>", "</call>"], max_turns=3, stop=["\n\n"])
    engine, dock = Recorder(), simulated_dock(cfg, dock_groups(cfg))
    loop = asyncio.new_event_loop()  # the env resets run on the engine's loop: a Recorder has none, so one here
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        tools = ToolTurns(dock, 0, cfg, EnvPool(Quiet, 5.0, 4), load_tokenizer(tiny_model_dir), loop)
        with pytest.raises(Captured):
            generate_rounds(dock, engine, cfg, SamplingSettings.from_rollout(cfg, [DEFAULT_EOS], seed=3), 0,
                            hooks=tools)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    answers = check_all(sglang, engine.bodies, cfg.max_model_len)
    if answers[0]["sampling"] is not None:
        assert answers[0]["sampling"][0]["stop_strs"] == ["\n\n", "</tool>", "</call>"]


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipe_bodies_are_sglangs(sglang, recipe):
    """The first round and an evaluation batch of each configs/gpu recipe, as its settings make them: training
    sampling from rollout.*, eval greedy (spillover.rollout.drivers.default_rollout._evaluate) or eval.* sampling."""
    from spillover.rollout.drivers.default_rollout import generate_rollout

    run = load_config(f"configs/gpu/{recipe}.yaml")
    engine = Recorder()
    dock = simulated_dock(run.rollout, 2, prompt_len=200)
    with pytest.raises(Captured):
        generate_training_batch(dock, engine, run.rollout, [151645, 151643], 0, False, seed=run.model.seed,
                                decode=token_numbers)
    train = check_all(sglang, engine.bodies[:4], run.rollout.max_model_len)

    class PromptSet:
        texts, labels, tokens = ["q"], ["1"], [list(range(300, 700))]

    data_source = type("DataSource", (), dict(eval_sets={"eval": PromptSet()}, fleet=Recorder(), reward_fn=None,
                                              tokenizer=None, stop_token_ids=[151645]))()
    with pytest.raises(Captured):
        generate_rollout(run, 0, data_source, evaluation=True)
    check_all(sglang, data_source.fleet.bodies, run.rollout.max_model_len)
    assert train[0]["sampling"] is None or train[0]["sampling"][0]["temperature"] == run.rollout.temperature


def test_a_wrong_body_is_refused(sglang):
    """The check bites: SGLang refuses an unknown sampling key (there is no `seed`: it is sampling_seed), a top_p of
    0, and a prompt + max_new_tokens over the context length."""
    good = build_requests([[5, 6, 7]], np.array([4]), SamplingSettings(stop_token_ids=[2]))[0].body()
    accepted(sglang.generate(good, VOCAB, 64), "the good body")
    seed = {**good, "sampling_params": {**good["sampling_params"], "seed": 3}}
    assert not sglang.generate(seed, VOCAB, 64)["ok"]


def test_values_sglang_refuses(sglang_classes):
    good = build_requests([[5, 6, 7]], np.array([4]), SamplingSettings(stop_token_ids=[2]))[0].body()
    top_p = {**good, "sampling_params": {**good["sampling_params"], "top_p": 0.0}}
    refused = sglang_classes.generate(top_p, VOCAB, 64)
    assert not refused["ok"] and "top_p" in refused["error"]
    long = sglang_classes.generate(good, VOCAB, 6)  # 3 prompt + 4 new > 6
    assert not long["ok"] and "context length" in long["error"]
    numpy_seed = SamplingSettings(stop_token_ids=[2], seed=1)
    seeded = build_requests([[5, 6, 7]], np.array([4]), numpy_seed, seeds=np.array([2**31 - 1]))[0].body()
    accepted(sglang_classes.generate(seeded, VOCAB, 64), "a seeded body")
    no_eos = build_requests([[5, 6, 7]], np.array([4]), SamplingSettings(ignore_eos=True))[0].body()  # rollout.ignore_eos
    assert no_eos["sampling_params"]["ignore_eos"] is True and not no_eos["sampling_params"]["stop_token_ids"]
    accepted(sglang_classes.generate(no_eos, VOCAB, 64), "an ignore_eos body")
    keyed = build_requests([[5, 6, 7]], np.array([4]), SamplingSettings(), extra_key="weights-v3")[0].body()
    assert keyed["extra_key"] == "weights-v3"  # rollout.adopt_detached: the prefix-cache namespace of the weights
    accepted(sglang_classes.generate(keyed, VOCAB, 64), "a body with extra_key")


def test_engine_client_generate_body_is_sglangs(sglang):
    """EngineClient.generate (BatchGenerator's every request, bench/engine.py): its body, transport recorded."""
    import asyncio

    import orjson

    from spillover.rollout.fleet.engine_client import EngineClient

    sent = []
    client = EngineClient("http://127.0.0.1:1")

    async def record(method, path, json=None, timeout=None):
        sent.append(orjson.loads(orjson.dumps(json)))
        raise Captured

    client._request = record
    with pytest.raises(Captured):
        asyncio.run(client.generate(GenerateRequest(
            input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True})))
    check_all(sglang, sent, 64)


# (events: [old version, output tokens then] per weight change, version now, output tokens at the end)
SPAN_CASES = [([], "0", 0), ([], "0", 12), ([["0", 5]], "7", 12), ([["0", 5]], "7", 5), ([["0", 5], ["7", 5]], "8", 9),
              ([["0", 3], ["7", 6]], "0", 10), ([["0", 4], ["7", 9]], "8", 6), ([["0", 2]], "7", 0)]


@pytest.mark.parametrize("events,current,length", SPAN_CASES)
def test_the_torch_engine_reports_weight_versions_as_sglang(sglang_classes, events, current, length):
    """Issue 37: a finished answer's meta_info weight_versions and weight_version, from the same weight-version events,
    as SGLang 0.5.23 makes them (on every answer, one span per version that made tokens)."""
    from spillover.rollout.torch_engine.batcher import weight_version_spans

    want = accepted(sglang_classes.weight_versions(events, current, length), "the weight-version events")["meta_info"]
    spans = weight_version_spans([tuple(e) for e in events], current, length)
    assert {"weight_versions": spans, "weight_version": spans[-1]["version"]} == want
