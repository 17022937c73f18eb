"""`spillover eval RUN_DIR|MODEL_DIR --data FILE`: pass@1 (greedy) and pass@k (sampled) of a policy on a prompt file.

The policy is the newest verified checkpoint of a training run (its weights exported once into
`<run_dir>/eval/policy-ckpt-<iteration>/`, an HF folder next to the run's model config and tokenizer), or an HF
model folder as it is. Engines are the run's kind (engines.*), started for the eval and shut down after it;
generation and scoring are spillover.rollout.drivers.evaluation.run_eval's, so eval sees what training saw (chat template,
stop strings, reward function, additional keys). The result goes to `<run_dir>/eval/<name>.json`
(`<MODEL_DIR>/eval/<name>.json` for a model folder).

pass@k is the unbiased estimator of Chen et al. (2021) with k samples per prompt: the share of prompts with at
least one solved sample (reward >= eval.pass_threshold); pass@1 is the greedy response's.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .parts import NewParts, RunParts
from ..infra.config.parsing import ConfigError
from ..infra.data_files import DataFile, data_file
from ..infra.config.run_config import RunConfig

EXPORT_MARKER = "spillover_weights.json"


@dataclass(frozen=True)
class EvalTarget:
    cfg: RunConfig
    model_dir: Path          # the HF folder the engines load
    out_dir: Path            # results go to out_dir/eval/<name>.json
    source: dict             # what was evaluated: kind, path, checkpoint iteration, weight version


def resolve_target(target: str | Path, overrides: list[str], config: str | None = None) -> EvalTarget:
    """A run dir (its config.json and newest verified checkpoint), an HF model folder or a Hub id (settings from
    `config`, a YAML run config, else the defaults; e.g. a recipe of configs/gpu/) -> what to evaluate."""
    from ..infra.hub_models import is_hub_id, resolve_hub_model

    if is_hub_id(str(target)):  # results go under ./eval-<org>--<name>; the engines load the cached snapshot
        from ..infra.config.run_config import load_config

        out = Path(f"eval-{str(target).replace('/', '--')}")
        cfg = load_config(config, [*overrides, f"model.path={target}", f"run_dir={out}"])
        folder, commit = resolve_hub_model(str(target), cfg.model.revision)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"revision": commit})})
        return EvalTarget(cfg, folder, out, {"kind": "hub_model", "path": str(target), "revision": commit})
    path = Path(target)
    folder_config = path / "config.json"
    if not folder_config.is_file():
        raise ConfigError(f"{path} is neither a run dir (config.json of `spillover train`) nor an HF model folder "
                          "(config.json + *.safetensors)")
    try:
        data = json.loads(folder_config.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{folder_config} is not valid JSON ({err.msg})") from None
    if "model_type" in data:  # an HF model folder
        from ..infra.config.run_config import load_config

        cfg = load_config(config, [*overrides, f"model.path={path}", f"run_dir={path}"])
        return EvalTarget(cfg, path, path, {"kind": "model_folder", "path": str(path)})
    from ..infra.config.run_config import load_run_config

    if config is not None:
        raise ConfigError(f"--config is for HF model folders; {path} is a run dir, which evaluates with its own "
                          "config.json (give key=value overrides instead)")
    cfg = load_run_config(path, overrides)
    model_dir, source = export_newest_policy(cfg, path)
    return EvalTarget(cfg, model_dir, path, source)


def export_newest_policy(cfg: RunConfig, run_dir: Path, out: Path | None = None) -> tuple[Path, dict]:
    """The newest verified checkpoint's policy weights as an HF folder: `out`, or under <run_dir>/eval (kept for
    reuse; `spillover export RUN_DIR --to DIR` and `spillover eval RUN_DIR` both come here)."""
    from ..infra.storage.checkpoint import load_latest_checkpoint
    from ..infra.models import resolve_model_path
    from ..tasks.run_state import open_checkpoint_store

    state = load_latest_checkpoint(open_checkpoint_store(cfg))
    if state is None:
        raise ConfigError(f"{run_dir}: no verified checkpoint to evaluate (storage.url / <run_dir>/checkpoints); "
                          "train first, or pass an HF model folder")
    source = {"kind": "checkpoint", "path": str(run_dir), "checkpoint_iteration": int(state.iteration),
              "weight_version": int(state.meta.get("weight_version", -1))}
    out = Path(out) if out is not None else run_dir / "eval" / f"policy-ckpt-{state.iteration:08d}"
    if (out / EXPORT_MARKER).is_file() and json.loads((out / EXPORT_MARKER).read_text()) == source:
        return out, source
    base = resolve_model_path(cfg.model, run_dir, max(512, cfg.rollout.max_model_len), cfg.storage)
    write_policy_folder(policy_state(state), Path(base), out, source)
    return out, source


def policy_state(state) -> dict:
    """The checkpoint's full learner state: rank 0's, or every rank's slices put together (learner.world_size > 1,
    as spillover.tasks.run_state.restore_weights does)."""
    if "learner_shards" in state.meta:
        from ..tasks.learner.shards import assemble

        return assemble([(state.tensors[f"policy-rank{info['rank']:03d}"], info)
                         for info in state.meta["learner_shards"]])[0]
    return state.tensors["policy"]


def write_policy_folder(learner_tensors: dict, base_model: Path, out: Path, source: dict | None = None) -> Path:
    """Learner state tensors ('model/<HF name>' -> tensor) + the base folder's config and tokenizer -> HF folder,
    with `source` in its EXPORT_MARKER and every file's sha256 in sha256.json (written last)."""
    import torch
    from safetensors.torch import save_file

    weights = {k[len("model/"):]: torch.as_tensor(np.asarray(v) if not torch.is_tensor(v) else v).contiguous()
               for k, v in learner_tensors.items() if k.startswith("model/")}
    if not weights:
        raise ConfigError("the checkpoint's policy state holds no model weights ('model/...' tensors)")
    from ..infra.storage.model_staging import SOURCE_DIGESTS, STAGED_MANIFEST, file_sha256

    out.mkdir(parents=True, exist_ok=True)
    for f in base_model.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".safetensors.index.json") and \
                f.name not in (SOURCE_DIGESTS, STAGED_MANIFEST):
            shutil.copy(f, out / f.name)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    if source is not None:
        (out / EXPORT_MARKER).write_text(json.dumps(source))
    digests = {f.name: file_sha256(f) for f in sorted(out.iterdir()) if f.is_file() and f.name != SOURCE_DIGESTS}
    (out / SOURCE_DIGESTS).write_text(json.dumps(digests, indent=1))  # checked when staged from s3:// (model.path)
    # safetensors writes its file 0600 whatever the umask; a new file of ours (the digests) got what the umask gives
    os.chmod(out / "model.safetensors", stat.S_IMODE((out / SOURCE_DIGESTS).stat().st_mode))
    return out


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` solved it (Chen et al. 2021)."""
    if n - correct < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - correct + 1, n + 1)))


def summarize(greedy: list, sampled: list, k: int, threshold: float) -> dict:
    """Scored groups (one greedy sample, k sampled per prompt) -> the eval metrics."""
    solved_greedy = [g[0].reward >= threshold for g in greedy]
    solved_sampled = [sum(s.reward >= threshold for s in g) for g in sampled]
    flat = [s for g in sampled for s in g]
    return {
        "prompts": len(greedy), "k": k,
        "pass@1": float(np.mean(solved_greedy)),
        f"pass@{k}": float(np.mean([pass_at_k(len(g), c, k) for g, c in zip(sampled, solved_sampled)])),
        "mean@k": float(np.mean([s.reward >= threshold for s in flat])),
        "reward_greedy": float(np.mean([g[0].reward for g in greedy])),
        "reward_sampled": float(np.mean([s.reward for s in flat])),
        "truncated_greedy": float(np.mean([g[0].status.value == "truncated" for g in greedy])),
        "response_tokens_greedy": float(np.mean([g[0].response_length for g in greedy])),
    }


def eval_data_sets(cfg: RunConfig, data: str | None, name: str | None) -> dict[str, DataFile]:
    """What `spillover eval` scores: --data (named --name, else its file stem), else every data set of the run's
    data.eval_paths (each under its key); a Hub file (hf://) from huggingface_hub's cache, a run's at the commit
    it recorded; an S3 object (s3://) from its copy in data.cache_dir."""
    if data:
        return {name or Path(data).stem: data_file(data, "--data", cfg)}
    if not cfg.data.eval_paths:
        raise ConfigError("nothing to evaluate: pass --data FILE, or set data.eval_paths (the run's config has none)")
    return {key: data_file(path, f"data.eval_paths.{key}", cfg) for key, path in cfg.data.eval_paths.items()}


def evaluate(target: EvalTarget, data_sets: dict[str, DataFile], parts: RunParts | None = None
             ) -> list[tuple[dict, Path]]:
    """Start engines on the target's policy once (from `parts`; None: started for this and shut down after it), score
    greedy and k sampled responses per prompt of each data set, write <out_dir>/eval/<name>.json for each ->
    [(result, its path)]. Sampling is seeded with model.seed when the run samples seeded
    (rollout.deterministic_sampling): two evals of one policy then give the same pass@k."""
    from ..infra.cluster import init_ray
    from ..infra.imports import load_function
    from ..infra.models import end_token_ids, load_tokenizer
    from ..rollout.prompt_data import read_prompt_file
    from ..rollout.drivers.evaluation import run_eval
    from ..tasks.reward import REWARD_KEYWORDS

    cfg = target.cfg
    reward_fn = load_function(cfg.grpo.reward_function_path, "grpo.reward_function_path",
                              required_params=("response", "label"), optional_keywords=REWARD_KEYWORDS)
    tokenizer = load_tokenizer(target.model_dir)
    max_prompt = cfg.rollout.max_model_len - cfg.rollout.max_tokens
    prompts = {name: read_prompt_file(path, tokenizer, cfg.data, max_prompt) for name, path in data_sets.items()}
    stop_ids = list(end_token_ids(target.model_dir, tokenizer))
    common = dict(tokenizer=tokenizer, stop_token_ids=stop_ids, max_new_tokens=cfg.rollout.max_tokens,
                  max_model_len=cfg.rollout.max_model_len, reward_fn_path=cfg.grpo.reward_function_path,
                  stop=cfg.rollout.stop)
    seed = cfg.model.seed if cfg.rollout.deterministic_sampling else None
    init_ray(cfg.engines.ray_address)
    parts = parts if parts is not None else NewParts()
    engines, scored, written = parts.fleet(cfg.engines, Path(target.model_dir)), False, []
    try:
        for name, path in data_sets.items():
            start = time.perf_counter()
            greedy = run_eval({name: prompts[name]}, engines, reward_fn, temperature=0.0, **common)[name]
            sampled = run_eval({name: prompts[name]}, engines, reward_fn, temperature=cfg.eval.temperature,
                               top_p=cfg.eval.top_p, n_samples_per_prompt=cfg.eval.k, seed=seed, **common)[name]
            result = {"name": name, "data": data_file(path).pinned, **target.source,
                      **summarize(greedy, sampled, cfg.eval.k, cfg.eval.pass_threshold),
                      "reward_function": cfg.grpo.reward_function_path, "temperature": cfg.eval.temperature,
                      "seed": seed, "time_s": round(time.perf_counter() - start, 3)}
            out = target.out_dir / "eval" / f"{name}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))
            written.append((result, out))
        scored = True
    finally:
        parts.give_back(engines, keep=scored)
    return written


def format_table(result: dict) -> str:
    """The result as a small aligned table (what `spillover eval` prints)."""
    k = result["k"]
    rows = [("data", result["data"]), ("policy", result.get("checkpoint_iteration", result["path"])),
            ("prompts", result["prompts"]), ("pass@1 (greedy)", f"{result['pass@1']:.4f}"),
            (f"pass@{k} (T={result['temperature']:g})", f"{result[f'pass@{k}']:.4f}"),
            ("mean@k", f"{result['mean@k']:.4f}"), ("reward greedy", f"{result['reward_greedy']:.4f}"),
            ("reward sampled", f"{result['reward_sampled']:.4f}"), ("truncated", f"{result['truncated_greedy']:.3f}")]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
