"""The run configuration: one nested pydantic model, loaded from YAML with key=value overrides.

Each section is handed only to the code that needs it (engines get `EnginesConfig`, the learner
`GRPOConfig` and `OptimizerConfig`, ...). The same model is the Prefect flow's parameter, so the UI
renders it as a form and validates it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, SecretStr, ValidationError, model_validator

from .parsing import ConfigError, apply_overrides, format_validation_error
from .engines import EnginesConfig
from .learner import LearnerConfig, check_learner_batch
from .placement import PlacementConfig, check_placement
from .base import Section
from .rollout import SFT_ROLLOUT_FUNCTION, RolloutConfig
from .scoring import EvalConfig
from .training import GRPOConfig, OptimizerConfig


class TinyModelConfig(Section):
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


class ModelConfig(Section):
    path: str | None = Field(
        None, description="HF checkpoint folder of the policy (and reference), a Hugging Face Hub id (org/name: "
        "huggingface_hub's cache first, HF_HUB_OFFLINE honoured, downloaded when online), or an s3:// URL of a "
        "folder (staged into model.cache_dir on every node, sha256-checked; endpoint and credentials from the storage "
        "section). Empty: build the tiny model into <run_dir>/tiny_model.")
    revision: str | None = Field(
        None, description="A Hub id's branch, tag or commit; empty = main. A run records the commit it resolved "
        "to here (in <run_dir>/config.json), so a resume loads the same weights.")
    cache_dir: str = Field("~/.cache/spillover/models", description="Where each node keeps its copy of an s3:// "
                           "model.path (expanded on the driver; every node uses that path).")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Shape of the built tiny model.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype.")
    seed: int = Field(0, description="Seed for model init, sampling and data order.")


class DataConfig(Section):
    prompts_path: str | None = Field(
        None, description="Prompt file: JSON Lines (one object per line) or Parquet (one row per prompt); a local "
        "path, a file:// URL, a Hub file, hf://datasets/ORG/NAME[@REVISION]/FILE (huggingface_hub's cache first, "
        "HF_HUB_OFFLINE honoured, downloaded when online; the run records the commit it read), or an S3 object, "
        "s3://BUCKET/KEY (endpoint and credentials from the storage section; copied once into data.cache_dir). Empty: "
        "generate the built-in repeat task into <run_dir>/data/train.jsonl.")
    format: Literal["prompt_label", "gsm8k", "math"] = Field(
        "prompt_label", description="What a prompt file's rows are: prompt_label (data.prompt_key / data.label_key); "
        "gsm8k ({question, answer ending '#### N'}, label N) or math ({problem, solution with \\boxed{...}}, label "
        "the last boxed answer; level and type kept), converted on read, so the Hub's own files train as they are; "
        "each row also gets an `id` (and math its level and type) for data.additional_keys.")
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
    eval_paths: dict[str, str] = Field(default_factory=dict, description="Eval data sets: key -> JSONL or Parquet "
                                       "file, named as data.prompts_path is (a path, file://, hf:// or s3://).")
    cache_dir: str = Field("~/.cache/spillover/data", description="Where the driver keeps its copy of each s3:// data "
                           "file, one per version of the object (its ETag): fetched again only when the object changed.")
    sft_path: str | None = Field(
        None, description="SFT mode (rollout.rollout_function_path=spillover.rollout.builtin.sft.generate_sft_rollout): JSONL of "
        "pre-generated samples, {prompt, response} or {prompt_tokens, response_tokens}, optional loss_mask.")
    over_long_prompts: Literal["refuse", "truncate"] = Field(
        "refuse", description="What to do with a prompt longer than rollout.max_model_len - rollout.max_tokens: "
        "refuse the file, or keep the prompt's last tokens (counted in metrics).")
    shuffle: bool = Field(True, description="Shuffle prompt order (seeded by model.seed).")


class StorageConfig(Section):
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


class TrackingConfig(Section):
    wandb_mode: Literal["offline", "online", "disabled"] = Field("offline", description="wandb mode.")
    project: str = Field("spillover", description="wandb project.")
    run_name: str | None = Field(None, description="wandb run name; empty = generated.")
    progress: bool = Field(True, description="Rich progress bar in the terminal.")
    report: bool = Field(True, description="At the end of a run, plot it (RUN_DIR/report/*.png, ~1-2 s) and attach "
                                           "the plots to wandb and a Prefect artifact; false: `spillover report "
                                           "RUN_DIR` plots it later.")


class ScheduleConfig(Section):
    num_iterations: int = Field(60, ge=1, description="Training iterations (rollouts) of the run.")
    eval_interval: int | None = Field(None, ge=1, description="Run eval every k iterations; empty = never.")
    cron: str | None = Field(None, description="Cron schedule of the deployment (e.g. '0 3 * * *').")
    debug_train_only: bool = Field(False, description="No engines: train on debug rollout data.")
    debug_rollout_only: bool = Field(False, description="Generate without updates.")


class RunConfig(Section):
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
        if rows % self.grpo.micro_batch_size and self.learner.max_tokens_per_micro_batch is None:
            raise ValueError(
                f"grpo.micro_batch_size ({self.grpo.micro_batch_size}) must divide the samples of one step "
                f"(rollout.global_batch_size x rollout.n_samples_per_prompt / grpo.num_steps_per_rollout = {rows})")
        check_learner_batch(self.learner, rows, self.rollout.max_model_len)
        if self.rollout.sft and self.grpo.off_policy != "none":
            raise ValueError("grpo.off_policy must be none in SFT mode "
                             "(rollout.rollout_function_path="
                             f"{SFT_ROLLOUT_FUNCTION}): pre-generated samples have no rollout logprobs")
        if self.grpo.kl_ctrl == "adaptive" and (self.grpo.kl_coef <= 0 or rows * steps >= 5 * self.grpo.kl_horizon):
            raise ValueError(f"grpo.kl_ctrl=adaptive needs grpo.kl_coef > 0 (the starting value; got {self.grpo.kl_coef}) "
                             f"and grpo.kl_horizon above 1/5 of the samples of one update ({rows * steps}; got "
                             f"{self.grpo.kl_horizon}), so that one update changes the coefficient by under 100%")
        check_placement(self)
        if self.rollout.overlap and self.placement.colocate:
            raise ValueError("rollout.overlap=true cannot run with placement.colocate=true: colocated engines release "
                             "their memory to the learner for the update, so nothing can generate through it; set "
                             "one of them to false")
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
            where = "" if p.is_absolute() else f" in {Path.cwd()}"
            raise ConfigError(f"config file {str(p)!r} does not exist{where}: give the path of a YAML run config (the "
                              "repository's configs/ hold examples)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return build_config(data, overrides)


RUN_CONFIG_FILE = "config.json"  # in <run_dir>: the config a run started with


def save_run_config(cfg: RunConfig, run_dir: Path) -> None:
    """<run_dir>/config.json: what `spillover resume RUN_DIR` starts from. Credentials are left out
    (a resumed run reads them from its config or the environment again)."""
    data = cfg.model_dump(mode="json", exclude={"storage": {"access_key_id", "secret_access_key"}})
    (run_dir / RUN_CONFIG_FILE).write_text(json.dumps(data, indent=2))


def load_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The config a run was started with (<run_dir>/config.json), with `key=value` overrides."""
    path = Path(run_dir) / RUN_CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: RUN_DIR must be the run_dir of an earlier `spillover train`")
    data = json.loads(path.read_text())
    return build_config(data, list(overrides or []) + [f"run_dir={run_dir}"])
