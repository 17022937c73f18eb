"""The run configuration: one nested pydantic model, loaded from YAML with key=value overrides.

Each section is handed only to the code that needs it (engines get `EnginesConfig`, the learner
`GRPOConfig` and `OptimizerConfig`, ...). The same model is the Prefect flow's parameter, so the UI
renders it as a form and validates it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, SecretStr, ValidationError, model_validator

from spillover.infra.config.parsing import ConfigError, apply_overrides, format_validation_error
from spillover.infra.config.engines import EngineSyncFields
from spillover.infra.config.learner import LearnerConfig, check_learner_batch
from spillover.infra.config.placement import PlacementConfig, check_placement
from spillover.infra.config.base import Section
from spillover.infra.config.tools import ToolFields
from spillover.infra.config.scoring import EvalConfig, RewardModelConfig  # noqa: F401 (importable from here)
from spillover.infra.config.training import OFF_POLICY_NEEDS_OLD_LOGPROBS, GRPOConfig, OptimizerConfig  # noqa: F401 (as above)


_Section = Section  # the sections below


class TinyModelConfig(_Section):
    num_layers: int = Field(2, ge=1, description="Transformer layers of the tiny Qwen2 model.")
    hidden_size: int = Field(64, ge=8, description="Hidden size of the tiny model.")
    num_heads: int = Field(4, ge=1, description="Attention heads (hidden_size must divide by it).")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (num_heads must divide by it).")
    intermediate_size: int = Field(128, ge=8, description="MLP width of the tiny model.")
    tokenizer: Literal["char", "bpe"] = Field(
        "char", description="char: one token per character (lower case, digits, a few signs); bpe: byte-level BPE "
        "with special tokens and a Qwen-style chat template, trained here on arithmetic text (infra/tiny_bpe.py).")

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError("model.tiny.hidden_size must be a multiple of model.tiny.num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.tiny.num_heads must be a multiple of model.tiny.num_kv_heads")
        return self


class ModelConfig(_Section):
    path: str | None = Field(
        None, description="HF checkpoint folder of the policy (and reference), or an s3:// URL of one (staged "
        "into model.cache_dir on every node, sha256-checked; endpoint and credentials from the storage section). "
        "Empty: build the tiny model into <run_dir>/tiny_model.")
    cache_dir: str = Field("~/.cache/spillover/models", description="Where each node keeps its copy of an s3:// "
                           "model.path (expanded on the driver; every node uses that path).")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Shape of the built tiny model.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype.")
    seed: int = Field(0, description="Seed for model init, sampling and data order.")


class DataConfig(_Section):
    prompts_path: str | None = Field(
        None, description="Prompt file: JSON Lines (one object per line) or Parquet (one row per prompt). Empty: "
        "generate the built-in repeat task into <run_dir>/data/train.jsonl.")
    prompt_key: str = Field("prompt", description="JSON key of the prompt text.")
    label_key: str = Field("label", description="JSON key of the label handed to the reward function.")
    additional_keys: list[str] = Field(
        default_factory=list, description="More keys (columns) of each prompt, carried with its group through "
        "the dock, checkpoints and debug rollout data to the reward function, which gets them as one dict "
        "{key: value} in a keyword argument named `metadata` (only if it names that parameter; batched "
        "functions get one dict per response).")
    apply_chat_template: bool = Field(
        False, description="Render text prompts as one user message with the tokenizer's chat template (prompts "
        "that are lists of {role, content} messages are always rendered).")
    system_prompt: str | None = Field(
        None, description="System message put first in every chat-rendered prompt that has none of its own.")
    num_prompts: int = Field(4096, ge=1, description="Prompts generated for the built-in task.")
    builtin_task: Literal["repeat", "arithmetic", "calculator"] = Field(
        "repeat", description="The task generated when data.prompts_path is empty: repeat (the 'a*n=' task, JSONL), "
        "arithmetic (chat prompts 'What is a + b?' with the value as label, Parquet; rollout/builtin/arith_task.py) or "
        "calculator (multi-step expressions such as '12*7+5' for the calculator tool, JSONL; rollout/builtin/calculator.py).")
    eval_paths: dict[str, str] = Field(default_factory=dict, description="Eval data sets: key -> JSONL or Parquet path.")
    sft_path: str | None = Field(
        None, description="SFT mode (rollout.rollout_function_path=spillover.rollout.builtin.sft.generate_sft_rollout): JSONL of "
        "pre-generated samples, {prompt, response} or {prompt_tokens, response_tokens}, optional loss_mask.")
    over_long_prompts: Literal["refuse", "truncate"] = Field(
        "refuse", description="What to do with a prompt longer than rollout.max_model_len - rollout.max_tokens: "
        "refuse the file, or keep the prompt's last tokens (counted in metrics).")
    shuffle: bool = Field(True, description="Shuffle prompt order (seeded by model.seed).")


SFT_ROLLOUT_FUNCTION = "spillover.rollout.builtin.sft.generate_sft_rollout"


class RolloutConfig(ToolFields):  # multi-turn tool fields: infra/config/tools.py
    global_batch_size: int = Field(16, ge=1, description="GBS: prompt groups trained per iteration.")
    n_samples_per_prompt: int = Field(8, description="Responses per prompt (group size n). GRPO needs >= 2.")
    max_tokens: int = Field(32, ge=1, description="Most response tokens per sample, over all its rounds.")
    max_model_len: int = Field(64, ge=2, description="Most prompt + response tokens per sample.")
    max_split: int = Field(
        2, description="Partial rollout: a response is generated in up to max_split rounds of "
        "max_tokens // max_split tokens. 1 = plain GRPO (no partial rollout).")
    max_age: int | None = Field(
        None, description="Most iterations a row may be carried over; empty = max_split (async mode or "
        "over_sampling_groups: at least 2).")
    require_max_age_all_finished: bool = Field(
        True, description="The staleness bound, in sync and async mode: a batch waits until every prompt group at "
        "max age has finished (a group's age counts the updates since its first token), so no trained token is more "
        "than max_age - 1 weight versions old; with over-sampling, extra groups start only when they can be trained "
        "in time. false: off (rows may be carried up to max_split iterations and longer with over-sampling).")
    mode: Literal["sync", "async"] = Field("sync", description="sync: chunked rounds; async: stop signal + abort.")
    over_sampling_groups: int = Field(0, ge=0, description="Extra groups dispatched beyond GBS (APRIL).")
    scheduling: Literal["fifo", "length_aware"] = Field(
        "fifo", description="Dispatch order: fifo = the dock's (oldest first); length_aware = longest expected remaining "
        "work first (carried-over rows, a group's finished siblings; rollout/drivers/scheduling.py), rows spread over engines.")
    tail_factor: float = Field(0.0, ge=0, description="Tail batching (length_aware): rows expected above this x the "
                               "median remaining work wait for the long round; 0 = off.")
    tail_round_every: int = Field(2, ge=1, description="Tail batching: every k-th iteration is a long round.")
    tail_engines: int = Field(0, ge=0, description="length_aware with tail_factor: engines reserved for the tail rows, "
                              "every round (they run few requests, so fast steps); 0 = tail rows wait for the long round.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the learner uses the same).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k sampling; -1 = off.")
    stop: list[str] = Field(
        default_factory=list, max_length=32, description="Stop strings (SGLang's sampling_params.stop, at most "
        "32): generation ends once the response text contains one (its tokens stay in the response).")
    deterministic_sampling: bool = Field(
        False, description="Seed every request (SGLang's sampling_params.sampling_seed, from model.seed, the group "
        "and the sample index): samples then do not depend on batching, timing or restarts, so a resumed run "
        "repeats an uninterrupted one. The sglang backend needs --enable-deterministic-inference for it.")
    rollout_function_path: str = Field(
        "spillover.rollout.drivers.default_rollout.generate_rollout", description="Import path of the rollout function.")
    eval_function_path: str | None = Field(
        None, description="Import path of the eval function (slime's signature, called with evaluation=True every "
        "schedule.eval_interval iterations, with or without data.eval_paths); empty = the built-in eval over "
        "data.eval_paths.")

    @property
    def partial(self) -> bool:
        return self.max_split > 1

    @property
    def effective_max_age(self) -> int:
        """max_age, else max_split; async mode and over-sampling carry unfinished groups at least once (APRIL)."""
        if self.max_age is not None:
            return self.max_age
        return max(2, self.max_split) if self.mode == "async" or self.over_sampling_groups else self.max_split

    @property
    def staleness_bounded(self) -> bool:
        """Is the max-age bound on (spillover.rollout.dock.staleness)? The one place that decides it, for every mode."""
        return self.require_max_age_all_finished

    @property
    def sft(self) -> bool:
        return self.rollout_function_path == SFT_ROLLOUT_FUNCTION

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        if self.n_samples_per_prompt < 2 and not self.sft:
            raise ValueError("rollout.n_samples_per_prompt must be >= 2 for GRPO (group-normalised advantages "
                             f"need a group); got {self.n_samples_per_prompt}")
        if self.max_split < 1:
            raise ValueError(f"rollout.max_split must be >= 1 (1 = no partial rollout); got {self.max_split}")
        if self.max_tokens < self.max_split:
            raise ValueError(f"rollout.max_tokens ({self.max_tokens}) must be >= rollout.max_split "
                             f"({self.max_split}): each round generates max_tokens // max_split tokens")
        if self.max_model_len <= self.max_tokens:
            raise ValueError(f"rollout.max_model_len ({self.max_model_len}) must exceed rollout.max_tokens "
                             f"({self.max_tokens}) to leave room for the prompt")
        if self.max_age is not None and self.max_age < 1:
            raise ValueError(f"rollout.max_age must be >= 1; got {self.max_age}")
        if any(not s for s in self.stop):
            raise ValueError("rollout.stop holds an empty string; give non-empty stop strings")
        return self


class EnginesConfig(EngineSyncFields):  # weight sync and SGLang fields: infra/config/engines.py
    backend: Literal["torch", "sglang"] = Field("torch", description="torch: CPU/GPU engine of ours; sglang: GPU.")
    rollout_num_gpus: int = Field(2, ge=1, description="Accelerators (or CPU slots) for rollout in all.")
    gpus_per_engine: int = Field(1, ge=1, description="Accelerators per engine (tensor parallel size).")
    num_cpus_per_engine: float = Field(0.0, ge=0, description="Ray CPUs reserved per CPU engine actor.")
    max_running_requests: int = Field(128, ge=1, description="Decode slots per engine.")
    router_address: str | None = Field(None, description="External sglang-router URL; empty = start one.")
    health_timeout_s: float = Field(30.0, gt=0, description="A /health_generate slower than this is dead.")
    health_interval_s: float = Field(30.0, ge=0, description="Background engine health check every this many "
                                     "seconds (dead or hung engines are restarted); 0 = off.")
    ray_address: str | None = Field(None, description="Ray cluster address; empty = RAY_ADDRESS or local.")

    @model_validator(mode="after")
    def _check(self) -> "EnginesConfig":
        if self.rollout_num_gpus % self.gpus_per_engine:
            raise ValueError(f"engines.rollout_num_gpus ({self.rollout_num_gpus}) must be a multiple of "
                             f"engines.gpus_per_engine ({self.gpus_per_engine})")
        return self

    @property
    def num_engines(self) -> int:
        return self.rollout_num_gpus // self.gpus_per_engine


class StorageConfig(_Section):
    url: str | None = Field(None, description="Checkpoint/debug-data location (file:// or s3://); empty = "
                            "<run_dir>/checkpoints.")
    endpoint_url: str | None = Field(None, description="S3 endpoint (e.g. http://127.0.0.1:8333).")
    region: str | None = Field(None, description="S3 region.")
    access_key_id: SecretStr | None = Field(None, description="S3 key id; empty = AWS_ACCESS_KEY_ID.")
    secret_access_key: SecretStr | None = Field(None, description="S3 secret; empty = AWS_SECRET_ACCESS_KEY.")
    write_checksums: bool = Field(True, description="Send each object's sha256 with its upload (x-amz-checksum-sha256; "
                                  "objects under 320 MiB) so the server refuses a body that differs, e.g. a timed-out "
                                  "attempt arriving after its retry; false only for a server that rejects the header.")
    checkpoint_interval: int = Field(1, ge=1, description="Checkpoint every k iterations.")
    keep_checkpoints: int = Field(2, ge=1, description="Verified checkpoints kept; older ones are pruned.")
    save_debug_rollout_data: str | None = Field(None, description="Path template with {rollout_id}.")
    load_debug_rollout_data: str | None = Field(None, description="Path template with {rollout_id}.")


class TrackingConfig(_Section):
    wandb_mode: Literal["offline", "online", "disabled"] = Field("offline", description="wandb mode.")
    project: str = Field("spillover", description="wandb project.")
    run_name: str | None = Field(None, description="wandb run name; empty = generated.")
    progress: bool = Field(True, description="Rich progress bar in the terminal.")
    report: bool = Field(True, description="At the end of a run, plot it (RUN_DIR/report/*.png, ~1-2 s) and attach "
                                           "the plots to wandb and a Prefect artifact; false: `spillover report "
                                           "RUN_DIR` plots it later.")


class ScheduleConfig(_Section):
    num_iterations: int = Field(60, ge=1, description="Training iterations (rollouts) of the run.")
    eval_interval: int | None = Field(None, ge=1, description="Run eval every k iterations; empty = never.")
    cron: str | None = Field(None, description="Cron schedule of the deployment (e.g. '0 3 * * *').")
    debug_train_only: bool = Field(False, description="No engines: train on debug rollout data.")
    debug_rollout_only: bool = Field(False, description="Generate without updates.")


class RunConfig(_Section):
    run_dir: str = Field("runs/tiny", description="Run directory: metrics, summary, tiny model, checkpoints.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig, description="`spillover eval`: pass@k settings.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Learner ranks, device, precision, "
                                   "attention kernel and logprob chunking (infra/config/learner.py).")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Engines colocated with the "
                                       "learner ranks or on their own (infra/config/placement.py).")

    @model_validator(mode="after")
    def _cross_section(self) -> "RunConfig":
        steps = self.grpo.num_steps_per_rollout
        if self.rollout.global_batch_size % steps:
            raise ValueError(f"grpo.num_steps_per_rollout ({steps}) must divide rollout.global_batch_size "
                             f"({self.rollout.global_batch_size}): each step trains whole groups")
        rows = self.rollout.global_batch_size * self.rollout.n_samples_per_prompt // steps
        if rows % self.grpo.micro_batch_size:
            raise ValueError(
                f"grpo.micro_batch_size ({self.grpo.micro_batch_size}) must divide the samples of one step "
                f"(rollout.global_batch_size x rollout.n_samples_per_prompt / grpo.num_steps_per_rollout = {rows})")
        check_learner_batch(self.learner, rows)
        if self.rollout.sft and self.grpo.tis:
            raise ValueError("grpo.tis must be false in SFT mode, i.e. grpo.off_policy=none "
                             "(rollout.rollout_function_path="
                             f"{SFT_ROLLOUT_FUNCTION}): pre-generated samples have no rollout logprobs")
        if self.grpo.kl_ctrl == "adaptive" and (self.grpo.kl_coef <= 0 or rows * steps >= 5 * self.grpo.kl_horizon):
            raise ValueError(f"grpo.kl_ctrl=adaptive needs grpo.kl_coef > 0 (the starting value; got {self.grpo.kl_coef}) "
                             f"and grpo.kl_horizon above 1/5 of the samples of one update ({rows * steps}; got "
                             f"{self.grpo.kl_horizon}), so that one update changes the coefficient by under 100%")
        check_placement(self)
        if self.schedule.debug_train_only and not self.storage.load_debug_rollout_data:
            raise ValueError("schedule.debug_train_only needs storage.load_debug_rollout_data (a path template)")
        return self


def build_config(data: dict | None = None, overrides: list[str] | None = None) -> RunConfig:
    try:
        return RunConfig.model_validate(apply_overrides(dict(data or {}), overrides or []))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults when path is None) and apply `key=value` overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist (pass --config configs/tiny.yaml)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return build_config(data, overrides)
