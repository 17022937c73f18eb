"""The checks for a lent GPU machine, without Ray or Prefect (the machine has neither), one after another in one
process; each is a function in CHECKS (args, device) -> its figures, printed as a JSON line when it ends
({"check": name, "check_s", "error", ...figures}) and merged into one last JSON line:

- colocated_engine (issue 13): an HF learner model and the torch engine's core (lean decoder + continuous batcher)
  on one device, three iterations of what a colocated run does: generate a batch -> release the engine's memory
  (weights + KV cache) -> a learner step on the generated tokens -> resume the weights -> load the new weights bucket
  by bucket, in place -> resume the KV cache -> check them against the learner's. Figures: engine_gb / freed_gb
  (CUDA memory the engine held and what its release gave back), engine_held_mb and released_to_zero (the engine's
  own count of its weight and KV bytes, before and after a release), gen_tokens_per_s, sync_s per iteration,
  buckets, weights_equal (every iteration), greedy_changed (the update reached the engine),
  kv_cache_free_during_load (issue 37: no KV cache while loading).
- tensor_update_session (issue 28): the torch engine's HTTP server on the device and WeightPoster (the client path that
  drives SGLang): an update outside /begin_weight_update ... /end_weight_update is refused; inside one session, bucket
  by bucket, weights and weight_version change -> "tensor_update": {refused_outside_session, version, weights_equal,
  update_s, buckets, events, greedy_changed}.
- engine_health (issue 37): the torch engine's /health while paused and while released, with SGLang's generation
  probe on (no answer; 503) and off as the fleet runs it (200 both) -> "health".
- stop_across_cut (issue 37): a stop string split by a partial-rollout cut, the torch engine on the device with the
  real dock and driver hooks: the row ends where one uncut request ends -> "stop_across_cut".
- inflight_update (issue 31, rollout.overlap with engines.pause_mode=in_place): one request keeps running through a
  weight update as RolloutManager.update_weights drives it: /pause_generation {mode: in_place} -> new weights bucket by
  bucket through WeightPoster without a cache flush (the engine refuses a flush while the paused request keeps its KV)
  -> /continue_generation. -> "inflight_update": {tokens, at_pause, spans (SGLang's meta_info.weight_versions),
  kv_kept, flush_refused, steps_while_paused, weights_equal, update_s, paused_s}.
- learner_precision (issues 12, 28, 36; bench/gpu_learner.py): a random-init Qwen2 of --learner-size (0.5b on CUDA:
  Qwen2.5-0.5B's shape, no download) in spillover's LearnerActor with --recipe's precision, optimizer and micro-batches
  (bfloat16 compute, float32 masters and AdamW state, lr 1e-6, packed micro-batches of the recipe's token budget),
  FSDP2, three iterations of the KL reference's pass (held in the learner as the recipe places it) + old logprobs +
  GRPO update on long-tailed lengths -> "learner": {params, master_dtypes, optimizer_state_dtypes, compute_dtypes,
  sent_dtypes, moved_share, step_s, tokens_per_s, mfu (against this run's own bf16 matmul rate), padding_share,
  reference_placement, ref_logprob_s, peak_gpu_gb, ...}.
- rollout_split (issue 18): max_split 1 vs 4 on long-tailed lengths (bench/longtail.py --real --local: the real dock
  and sync driver, engines in this process) -> "rollout".

Also in the line: check_s (seconds per check) and errors ({check: message}; a failed check does not stop the others,
and the exit status is 1). Not covered here: SGLang (not installable on that machine), the distributed protocol
(two processes).

    python bench/gpu_smoke.py [--model HF_FOLDER] [--device cuda|cpu] [--bucket-mb 64] [--learner-size 0.5b|tiny|none]
                              [--recipe configs/gpu/X.yaml] [--rollout small|tiny|none] [--checks name,name]

Without --model (or SPILLOVER_GPU_MODEL) the engine check builds the tiny test model. `--device cpu` is the dry run
used here (tests/integration/test_colocate.py).
"""
from __future__ import annotations

if not __package__:  # run as a file: relative imports resolve in the installed package (PEP 366)
    __package__ = "spillover.bench"

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


from ..rollout.torch_engine.batcher import ContinuousBatcher, EngineRequest  # noqa: E402
from ..rollout.torch_engine.lean_forward import LeanDecoder, read_safetensors, read_shape  # noqa: E402
from ..rollout.sglang.protocol import SamplingParams  # noqa: E402
from ..rollout.sglang.update_group import plan_buckets  # noqa: E402
from .weight_digests import tensor_digest  # noqa: E402


def memory_gb(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def generate(batcher: ContinuousBatcher, prompts: list[list[int]], max_new: int, greedy: bool) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0 if greedy else 1.0, ignore_eos=True)
    requests = [EngineRequest(rid=f"r{i}", input_ids=p, params=params, return_logprob=False, max_output=max_new,
                              stop_ids=frozenset()) for i, p in enumerate(prompts)]
    for request in requests:
        batcher.submit(request)
    return [request.future.result(timeout=600).output_ids for request in requests]


def learner_step(model, optimizer, prompts: list[list[int]], outputs: list[list[int]], device) -> None:
    """One AdamW step raising the likelihood of the generated tokens (enough to move every weight)."""
    rows = [p + o for p, o in zip(prompts, outputs)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


ROLLOUT_SCALES = {  # bench/longtail.py --real --local arguments (the tiny model, lognormal natural lengths)
    "small": ["--gbs", "64", "--n", "8", "--engines", "1", "--slots", "256", "--max-tokens", "2048", "--median",
              "256", "--iterations", "2", "--warmup", "1"],
    "tiny": ["--gbs", "8", "--n", "4", "--engines", "1", "--iterations", "1", "--warmup", "1"],
}


def rollout_split_comparison(device: str, scale: list[str]) -> dict:
    """max_split 1 vs 4 (issues 13 and 18): the long-tail bench on engines in this process -> {mode: figures}."""
    from .longtail import main as longtail

    results = longtail(["--real", "--local", "--device", device, "--modes", "no_partial,sync_split4", *scale])
    return {r["mode"]: {k: r[k] for k in ("rollout_s", "speedup", "rollout_speedup", "slot_idle_share",
                                          "trained_tokens_per_iteration")} for r in results}


class CheckFailed(AssertionError):
    """A check whose figures came out wrong: the figures still go into the JSON line, the message into errors."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures


def colocated_engine(args, device: torch.device) -> dict:
    model_path = args.model or _tiny_model()
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    learner = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-4 if args.model else 1e-2)
    shape = read_shape(model_path)
    base = memory_gb(device)
    decoder = LeanDecoder(shape, read_safetensors(model_path), dtype, device)
    batcher = ContinuousBatcher(decoder, args.batch, min(shape.max_position, 2048))
    batcher.start()
    engine_gb = memory_gb(device) - base
    named = {k: v for k, v in learner.state_dict().items() if k in decoder.weights}
    specs = [(k, str(v.dtype), list(v.shape)) for k, v in named.items()]
    buckets = plan_buckets(specs, int(args.bucket_mb * 2**20))
    prompts = [[(7 * i + j) % (shape.vocab_size - 2) + 2 for j in range(8)] for i in range(args.batch)]
    probe = prompts[:2]
    greedy_before = generate(batcher, probe, 8, greedy=True)
    out = {"model": model_path, "engine_gb": round(engine_gb, 3), "buckets": len(buckets),
           "gen_tokens_per_s": [], "sync_s": [], "freed_gb": [], "weights_equal": []}
    try:
        for _ in range(3):
            tic = time.perf_counter()
            outputs = generate(batcher, prompts, args.max_new, greedy=False)
            out["gen_tokens_per_s"].append(round(sum(map(len, outputs)) / (time.perf_counter() - tic), 1))
            held = memory_gb(device)
            out["engine_held_mb"] = round((decoder.weight_bytes() + batcher.runner.cache_bytes()) / 2**20, 2)
            batcher.call(lambda: batcher.release_memory(None), when_idle=True).result()
            out["freed_gb"].append(round(held - memory_gb(device), 3))
            out["released_to_zero"] = decoder.weight_bytes() + batcher.runner.cache_bytes() == 0
            learner_step(learner, optimizer, prompts, outputs, device)
            tic = time.perf_counter()
            # the manager's order (issue 37): the weights' memory, the load, then the KV cache
            batcher.call(lambda: batcher.resume_memory(["weights"])).result()
            state = learner.state_dict()
            for bucket in buckets:
                tensors = {name: state[name] for name, _, _ in bucket}
                batcher.call(lambda t=tensors: decoder.load(t)).result()
            out["kv_cache_free_during_load"] = batcher.runner.cache_bytes() == 0
            batcher.call(lambda: batcher.resume_memory(["kv_cache", "cuda_graph"])).result()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out["sync_s"].append(round(time.perf_counter() - tic, 4))
            out["weights_equal"].append(all(tensor_digest(decoder.weights[n]) == tensor_digest(state[n].to(dtype))
                                            for n in decoder.weights))
        out["greedy_changed"] = generate(batcher, probe, 8, greedy=True) != greedy_before
    finally:
        batcher.stop()
        batcher.release_memory(None)  # the next checks get the whole device
    return out


def tensor_update_session(args, device: torch.device) -> dict:
    """The torch engine's HTTP server on the device and the client path that drives SGLang (WeightPoster, as the
    engine actors and colocated ranks use it): a tensor update outside /begin_weight_update ... /end_weight_update is
    refused as SGLang refuses it; inside one session, bucket by bucket, the weights and weight_version change."""
    import httpx

    from ..rollout.torch_engine.server import TorchEngineServer
    from ..rollout.fleet.weights.weight_poster import WeightPoster

    model_path = args.model or _tiny_model()
    server = TorchEngineServer(model_path, device=device.type, max_running_requests=8)
    url = server.start(timeout_s=300.0)
    poster = WeightPoster(url, "torch", label="smoke engine")
    probe = {"input_ids": [3, 4, 5, 6], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    try:
        greedy_before = httpx.post(url + "/generate", json=probe, timeout=120.0).json()["output_ids"]
        current = {name: t.detach().to("cpu").clone() for name, t in server.batcher.decoder.weights.items()}
        name0 = next(iter(current))
        try:
            poster.post_bucket({name0: current[name0]}, 1)
            refused = False
        except RuntimeError:
            refused = True
        server.weight_update_events.clear()
        generator = torch.Generator().manual_seed(0)
        new = {name: t + 0.5 * torch.randn(t.shape, generator=generator).to(t.dtype) for name, t in current.items()}
        tic = time.perf_counter()
        version = poster.update(new, 1, bucket_bytes=int(args.bucket_mb * 2**20))
        update_s = time.perf_counter() - tic
        weights_equal = all(tensor_digest(server.batcher.decoder.weights[n]) == tensor_digest(new[n].to(device))
                            for n in new)
        events = list(server.weight_update_events)
        greedy_after = httpx.post(url + "/generate", json=probe, timeout=120.0).json()["output_ids"]
    finally:
        server.stop()
    out = {"refused_outside_session": refused, "version": version, "weights_equal": weights_equal,
           "update_s": round(update_s, 4), "buckets": sum(e.startswith("update_weights_from_tensor") for e in events),
           "events": [events[0], events[-1]] if events else [], "greedy_changed": greedy_after != greedy_before}
    if not (refused and version == 1 and weights_equal and events and events[0].startswith("begin")
            and events[-1].startswith("end")):
        raise CheckFailed(f"tensor update session: {out}", {"tensor_update": out})
    return {"tensor_update": out}


def engine_health(args, device: torch.device) -> dict:
    """The torch engine's /health on the device as SGLang's answers it (issue 37): with the generation probe on
    (SGLang's default) a paused engine parks the probe (no answer) and a released one fails it; with
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (what the fleet sets: ENGINE_ENV) both answer 200 at once."""
    import httpx

    from ..rollout.sglang.backend import ENGINE_ENV
    from ..rollout.torch_engine.server import TorchEngineServer

    def status(url: str, timeout_s: float) -> int | str:
        try:
            return httpx.get(url + "/health", timeout=timeout_s).status_code
        except httpx.TimeoutException:
            return "no answer"

    out = {}
    for probe, env in (("generation", {}), ("liveness", ENGINE_ENV)):
        server = TorchEngineServer(args.model or _tiny_model(), device=device.type, max_running_requests=4, env=env)
        url = server.start(timeout_s=300.0)
        try:
            httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30.0).raise_for_status()
            paused = status(url, 2.0 if probe == "generation" else 30.0)  # a parked probe: 2 s shows it
            httpx.post(url + "/continue_generation", json={}, timeout=30.0).raise_for_status()
            httpx.post(url + "/release_memory_occupation", json={}, timeout=60.0).raise_for_status()
            released = status(url, 30.0)
            httpx.post(url + "/resume_memory_occupation", json={}, timeout=60.0).raise_for_status()
            out[probe] = {"paused": paused, "released": released, "after": status(url, 30.0)}
        finally:
            server.stop()
    expected = {"generation": {"paused": "no answer", "released": 503, "after": 200},
                "liveness": {"paused": 200, "released": 200, "after": 200}}
    if out != expected:
        raise CheckFailed(f"engine health: {out}, expected {expected}", {"health": out})
    return {"health": out}


def inflight_update(args, device: torch.device) -> dict:
    """A request running through an in_place weight update on the device (rollout.overlap): every token comes back (none
    lost to the update), the ones before the pause under version 0 and the ones after under version 1, as SGLang's
    meta_info.weight_versions spans say; no decode step runs while paused; the KV cache stays, so a flush is refused."""
    import httpx

    from ..rollout.fleet.weights.weight_poster import WeightPoster
    from ..rollout.sglang.protocol import ContinueGenerationRequest, PauseGenerationRequest
    from ..rollout.torch_engine.server import TorchEngineServer

    model_path = args.model or _tiny_model()
    server = TorchEngineServer(model_path, device=device.type, max_running_requests=8)
    url = server.start(timeout_s=300.0)
    poster = WeightPoster(url, "torch", label="smoke engine")
    # the tiny model decodes so fast on CPU that a short request can end before the poller sees its 4th token
    tokens = args.inflight_tokens or (256 if device.type == "cuda" else 48 if args.model else 400)
    body = {"input_ids": [3, 4, 5, 6, 7, 8], "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0,
                                                                  "ignore_eos": True}}

    def output_length() -> int:
        running = list(server.batcher.running.values())
        return len(running[0].output_ids) if running else 0

    pool = ThreadPoolExecutor(1)
    try:
        current = {name: t.detach().to("cpu").clone() for name, t in server.batcher.decoder.weights.items()}
        generator = torch.Generator().manual_seed(1)
        new = {name: t + 0.5 * torch.randn(t.shape, generator=generator).to(t.dtype) for name, t in current.items()}
        for _attempt in range(3):  # a starved poller (the suite runs this at low priority) may miss the whole request
            answer = pool.submit(lambda: httpx.post(url + "/generate", json=body, timeout=600.0).json())
            deadline = time.monotonic() + 300.0
            while output_length() < 4 and not answer.done():  # paused mid-way, not before the first tokens
                if time.monotonic() > deadline:
                    raise CheckFailed("inflight update: the request made no 4 tokens in 300 s", {})
                time.sleep(0.0005)
            if not answer.done():
                break
            answer.result()
        else:
            raise CheckFailed("inflight update: the request finished before the poller saw it, 3 times", {})
        tic = time.perf_counter()
        pause = PauseGenerationRequest(mode="in_place").model_dump()
        httpx.post(url + "/pause_generation", json=pause, timeout=60.0).raise_for_status()
        at_pause, kv_kept = output_length(), len(server.batcher.running)
        flush_refused = httpx.post(url + "/flush_cache", timeout=60.0).status_code != 200
        update_tic = time.perf_counter()
        version = poster.update(new, 1, bucket_bytes=int(args.bucket_mb * 2**20), flush_cache=False)
        update_s = time.perf_counter() - update_tic
        steps_while_paused = output_length() - at_pause
        resume = ContinueGenerationRequest().model_dump()
        httpx.post(url + "/continue_generation", json=resume, timeout=60.0).raise_for_status()
        paused_s = time.perf_counter() - tic
        result = answer.result(timeout=600)
        weights_equal = all(tensor_digest(server.batcher.decoder.weights[n]) == tensor_digest(new[n].to(device))
                            for n in new)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        server.stop()
    meta = result["meta_info"]
    spans = meta.get("weight_versions", [])
    out = {"tokens": len(result["output_ids"]), "asked": tokens, "at_pause": at_pause, "spans": spans,
           "finish_reason": meta["finish_reason"]["type"], "kv_kept": kv_kept, "flush_refused": flush_refused,
           "steps_while_paused": steps_while_paused, "version": version, "weights_equal": weights_equal,
           "update_s": round(update_s, 4), "paused_s": round(paused_s, 4)}
    expected_spans = [{"version": "0", "start": 0, "end": at_pause},
                      {"version": "1", "start": at_pause, "end": len(result["output_ids"])}]
    if not (0 < at_pause < len(result["output_ids"]) and out["finish_reason"] == "length" and spans == expected_spans
            and kv_kept == 1 and flush_refused and steps_while_paused == 0 and version == 1 and weights_equal):
        raise CheckFailed(f"inflight update: {out}", {"inflight_update": out})
    return {"inflight_update": out}


def stop_across_cut(args, device: torch.device) -> dict:
    """A stop string split by a partial-rollout cut, with the torch engine on the device and the real dock and driver
    hooks (issue 37, item 3): the engine matches stop strings in one request's own output, so a string begun in the
    first round's tokens and ended in the continuation is not seen by it; the driver (RoundHooks.on_answers) must end
    the row where one uncut request ends. The tiny model with its char tokenizer (the random 0.5B folder has no
    tokenizer to spell a string with); greedy, so the device's kernels choose the tokens."""
    import httpx
    import numpy as np

    from ..infra.models import load_tokenizer
    from ..rollout.dock.transfer_dock import TransferDock
    from ..rollout.drivers.requests import SamplingSettings, build_requests
    from ..rollout.drivers.rounds import RoundHooks
    from ..rollout.sglang.protocol import GenerateResponse
    from ..rollout.torch_engine.server import TorchEngineServer

    model, budget = _tiny_model(), 24
    tok = load_tokenizer(model)
    prompt = tok("1+2=", add_special_tokens=False)["input_ids"]
    server = TorchEngineServer(model, device=device.type, max_running_requests=4, seed=0)
    url = server.start(timeout_s=300.0)

    def post(ids, max_new: int, stop: list[str] | None = None) -> GenerateResponse:
        sampling = SamplingSettings(temperature=0.0, stop=tuple(stop or ()), ignore_eos=True)
        body = build_requests([ids], np.array([max_new]), sampling)[0].body()
        response = httpx.post(url + "/generate", json=body, timeout=300.0)
        response.raise_for_status()
        return GenerateResponse.model_validate(response.json())

    try:
        free = post(prompt, budget).output_ids
        text = tok.decode(free)  # one token per character
        cut = next((k for k in range(2, budget - 2) if text.index(text[k - 1:k + 1]) == k - 1), None)
        if cut is None:
            raise CheckFailed(f"stop across cut: no two characters of {text!r} first appear across a cut", {})
        stop = text[cut - 1:cut + 1]
        uncut = post(prompt, budget, [stop]).output_ids
        dock = TransferDock(1, 1, 2, budget, len(prompt) + budget, [int(tok.eos_token_id)])
        dock.load_groups(np.asarray([0]), [prompt], ["label"])
        hooks = RoundHooks(dock, 0, stop=[stop], decode=tok.decode)
        first = post(prompt, cut, [stop])
        hooks.on_answers(dock.take_rows(), [first], stopping=True)
        carried = not bool(dock.complete[0])
        rows = dock.take_rows()
        inputs, max_new = dock.generation_inputs(rows, None)
        second = post(list(map(int, inputs[0])), int(max_new[0]), [stop])
        hooks.on_answers(rows, [second], stopping=False)
        ended = dock.responses.gather(np.asarray([0]), "tokens").tolist()
    finally:
        server.stop()
    out = {"stop": stop, "cut_at": cut, "uncut_tokens": len(uncut), "carried": carried,
           "engine_continued": len(second.output_ids), "row_tokens": len(ended), "row_stopped": bool(dock.stopped[0]),
           "row_equals_uncut": ended == uncut}
    if not (carried and uncut == free[:cut + 1] and len(second.output_ids) > 1 and ended == uncut
            and dock.stopped[0]):
        raise CheckFailed(f"stop across cut: {out}", {"stop_across_cut": out})
    return {"stop_across_cut": out}


def _tiny_model() -> str:
    from ..infra.models import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))


def learner_precision(args, device: torch.device) -> dict:
    size = args.learner_size or ("0.5b" if device.type == "cuda" else "tiny")
    if size == "none":
        return {}
    from .gpu_learner import DEFAULT_RECIPE, RECIPES, learner_smoke

    out = learner_smoke(size, device.type, samples=args.learner_samples, tokens=args.learner_tokens,
                        recipe=args.recipe or RECIPES.get(size, DEFAULT_RECIPE))
    expected = {"master_dtypes": ["float32"], "optimizer_state_dtypes": ["float32"],
                "compute_dtypes": [out["param_dtype"]], "sent_dtypes": [out["model_dtype"]]}
    wrong = {k: out[k] for k, v in expected.items() if out[k] != v}
    if wrong or out["moved_share"] <= 0.9:  # as bfloat16 masters, a 1e-6 step would round away almost everywhere
        raise CheckFailed(f"learner precision: expected {expected} and moved_share > 0.9; got {wrong}, "
                          f"moved_share {out['moved_share']}", {"learner": out})
    return {"learner": out}


def rollout_split(args, device: torch.device) -> dict:
    scale = args.rollout or ("small" if device.type == "cuda" else "tiny")
    if scale == "none":
        return {}
    return {"rollout": rollout_split_comparison(device.type, ROLLOUT_SCALES[scale])}


# The checks, in the order they run: each takes (parsed args, device) and returns its figures (merged into the one
# JSON line); a new GPU check is a function appended here (and named in --checks).
CHECKS = [colocated_engine, tensor_update_session, engine_health, inflight_update, stop_across_cut, learner_precision,
          rollout_split]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=os.environ.get("SPILLOVER_GPU_MODEL"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checks", default=",".join(c.__name__ for c in CHECKS),
                        help="comma-separated names of the checks to run (default: all, in CHECKS order)")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--inflight-tokens", type=int, default=None,
                        help="inflight_update's response length (default: 256 on CUDA; on CPU 48 with --model, 400 "
                        "with the tiny model, which ends a shorter one too fast); the pause comes after its 4th token")
    parser.add_argument("--learner-size", choices=["0.5b", "1.5b", "tiny", "none"], default=None,
                        help="the learner part's model (default: 0.5b on CUDA, tiny on CPU)")
    parser.add_argument("--recipe", default=None,
                        help="the GPU recipe whose precision, optimizer and micro-batch settings the learner part runs "
                        "(default: the size's math recipe under configs/gpu/)")
    parser.add_argument("--learner-samples", type=int, default=64)
    parser.add_argument("--learner-tokens", type=int, default=None,
                        help="most response tokens per sample (default: the recipe's rollout.max_tokens)")
    parser.add_argument("--rollout", choices=["small", "tiny", "none"], default=None,
                        help="max_split 1 vs 4 on long-tailed lengths through the real dock and driver (default: "
                        "small on CUDA, tiny on CPU)")
    args = parser.parse_args(argv)
    known = {c.__name__: c for c in CHECKS}
    chosen = [name for name in args.checks.split(",") if name]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"--checks: unknown {unknown}; the checks are {sorted(known)}")
    device = torch.device(args.device)
    out: dict = {"device": str(device), "check_s": {}, "errors": {}}
    for name in chosen:
        tic = time.perf_counter()
        figures, error = {}, None
        try:
            figures = known[name](args, device)
        except Exception as err:  # noqa: BLE001 - one failed check must not cost the lent machine's other checks
            figures = getattr(err, "figures", {})
            traceback.print_exc(file=sys.stderr)
            error = out["errors"][name] = f"{type(err).__name__}: {err}"[:2000]
        out.update(figures)
        out["check_s"][name] = round(time.perf_counter() - tic, 1)
        # a line per check as it ends: a run cut short by its time limit still leaves the finished checks' figures
        print(json.dumps({"check": name, "check_s": out["check_s"][name], "error": error, **figures}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
