"""The engine contract: request/response models of the SGLang native HTTP API subset we speak.

Field names and shapes follow SGLang 0.5.x (`GenerateReqInput`, `SamplingParams`, the `meta_info` of a
/generate answer, `AbortReq`, `UpdateWeightFromDiskReqInput`, /v1/loads, the weight and memory control routes). The
drivers, the fleet's client and the torch engine server all build and read their bodies with these models (a body is
`Model(...).model_dump()`, an answer is parsed once into its model), so a field renamed here is renamed everywhere.

Deliberate gaps: one request per /generate call (no batched `input_ids` lists), no streaming, no
`text` input (callers always send token ids; partial samples are continued from ids, never re-tokenised
text).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, field_validator,
                      model_validator)

RID_HEX_CHARS = 32  # SGLang matches abort rids by prefix: fixed-length random hex keeps them unambiguous


def new_rid() -> str:
    """A fixed-length random hex request id."""
    return secrets.token_hex(RID_HEX_CHARS // 2)


def parse_version(value: Any) -> Any:
    """SGLang reports weight versions as text ("default", "3"); ours are ints. Digits -> int, anything else as it is."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


WeightVersion = Annotated[int | str | None, BeforeValidator(parse_version),
                          PlainSerializer(lambda v: None if v is None else str(v), return_type=str | None)]
"""Every weight version field: read as an int when it is one, sent as text (SGLang declares them Optional[str] and
refuses an int)."""


MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]  # torch_memory_saver regions SGLang can release
WeightSelector = Literal["all", "target", "draft"]  # which model a weight-update session covers (draft: speculative)


class BadRequest(ValueError):
    """A request the engine refuses with HTTP 400; the message names the field and the fix."""


# SGLang 0.5.23's sampling_params keys this engine does not implement, with their defaults: a request may send
# one at its default (it changes nothing), any other value is refused rather than silently ignored.
UNIMPLEMENTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "stop_regex": None, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "spaces_between_special_tokens": True, "stream_interval": None, "logit_bias": {}, "custom_params": None,
    "beam_width": None, "watermark": None, "choice": []}


class SamplingParams(BaseModel):
    """SGLang's sampling_params subset. temperature 0 = greedy; top_k -1 = off; top_p 1 = off.

    Keys are checked as SGLang's /generate gate checks them: a key SGLang does not know is refused (HTTP 400,
    "unknown field `X`"); null means the default (max_new_tokens null: up to the context length)."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int | None = Field(128, description="Most tokens to generate (SGLang's default is 128); null: "
                                       "up to the context length.")
    temperature: float = Field(1.0, ge=0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 (or 0) disables top-k.")
    min_p: float = Field(0.0, ge=0, le=1)
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = Field(
        None, description="Stop string(s), at most 32: generation ends once the output text contains one (the "
        "matched tokens stay in output_ids; finish_reason stop with matched = the string).")
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = Field(
        None, description="Per-request seed (SGLang's; it needs --enable-deterministic-inference there): the "
        "sample is a function of (seed, position, token) only, independent of batching and timing.")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | set(UNIMPLEMENTED_SAMPLING_DEFAULTS)
        for key in data:
            if key not in known:
                hint = " (SGLang's seed key is sampling_seed)" if key == "seed" else ""
                raise ValueError(f"unknown field `{key}`{hint}, expected one of {', '.join(sorted(known))}")
        for key, default in UNIMPLEMENTED_SAMPLING_DEFAULTS.items():
            if key in data and data[key] is not None and data[key] != default:
                raise ValueError(f"{key}={data[key]!r} is SGLang's but not implemented by the torch engine: leave it "
                                 f"out (or send its default {default!r}), or use the sglang backend")
        return {k: v for k, v in data.items() if v is not None or k == "max_new_tokens"}

    @field_validator("max_new_tokens")
    @classmethod
    def _non_negative(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"must be >= 0; got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        strings = [v] if isinstance(v, str) else v
        if strings is not None and (len(strings) > 32 or any(not s for s in strings)):
            raise ValueError(f"must be at most 32 non-empty strings (SGLang's MAX_STOP_COUNT); got {strings!r}")
        return strings or None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"must be -1 (off) or >= 1; got {v}")
        return v


class GenerateRequest(BaseModel):
    """POST /generate body (one request)."""

    model_config = ConfigDict(extra="ignore")

    input_ids: list[int] = Field(..., min_length=1, description="Prompt (+ partial response) token ids.")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    rid: str | None = Field(default_factory=new_rid, description="Abort matches request ids by prefix: one of fixed "
                            "length each (null: the engine picks one).")
    stream: bool = False
    extra_key: str | None = Field(default=None, description="SGLang's prefix-cache namespace: a request reuses only "
                                  "prefixes cached by requests with the same key (rollout.adopt_detached: the weight "
                                  "version, so nothing cached under older weights is reused).")

    @model_validator(mode="before")
    @classmethod
    def _no_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and "input_ids" not in data and data.get("text") is not None:
            raise ValueError("input_ids: Field required (text input is not supported by this engine: send "
                             "token ids)")
        return data

    @field_validator("input_ids", mode="before")
    @classmethod
    def _flat_ids(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], list):
            raise ValueError("input_ids must be one flat list of token ids (batched requests are not supported: "
                             "send one /generate call per sample)")
        return v

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("stream=true is not supported by this engine; send stream=false")
        return v

    def body(self) -> dict[str, Any]:
        """The JSON body: the fields this request was given, and its rid (SGLang applies its own defaults to the
        rest)."""
        return {**self.model_dump(exclude_unset=True), "rid": self.rid}


@dataclass(frozen=True, slots=True)
class GenerateJob:
    """A /generate request as the drivers hand it to the fleet. `engine` pins it to that engine (length-aware dispatch,
    rollout/drivers/dispatch.py); None lets the router choose. The pin is ours, not SGLang's: it never goes on the
    wire."""

    request: GenerateRequest
    engine: int | None = None
    # rollout.start_cutoff: the job's prompt group; if no job of this group was sent by the time its detached round
    # stops, it is answered never-sent instead of starting during the update (None: it always goes)
    cutoff_group: int | None = None


FinishType = Literal["stop", "length", "abort"]


class FinishReason(BaseModel):
    """SGLang's finish_reason: stop {matched}, length {length}, abort {message, status_code, err_type}."""

    model_config = ConfigDict(extra="allow")

    type: FinishType
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class WeightVersionSpan(BaseModel):
    """One entry of meta_info.weight_versions: output positions [start, end) were made by weights `version`."""

    version: WeightVersion
    start: int
    end: int


class MetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: WeightVersion = None  # SGLang 0.5.23: the last span's version
    # SGLang 0.5.23 puts the spans on every finished answer, one per version that made its tokens, covering them all
    # (one span unless the request lived through a weight update); an engine that sends none: weight_version
    weight_versions: list[WeightVersionSpan] | None = None
    # (logprob, token id, token text or None) per output token; typed as tuples, the answer parses ~1.5x faster
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None

    @property
    def logprobs(self) -> list[float]:
        return [entry[0] for entry in self.output_token_logprobs or []]


class GenerateResponse(BaseModel):
    """The /generate answer: output_ids include the stop token; completion_tokens == len(output_ids)."""

    model_config = ConfigDict(extra="allow")

    text: str | None = None
    output_ids: list[int]
    meta_info: MetaInfo

    @classmethod
    def never_sent(cls, request: GenerateRequest, message: str) -> "GenerateResponse":
        """The answer of a request whose round was stopped before it was sent: no tokens, finish_reason abort."""
        return cls(output_ids=[], meta_info=MetaInfo(
            id=request.rid or "", finish_reason=FinishReason(type="abort", message=message),
            prompt_tokens=len(request.input_ids), completion_tokens=0,
            output_token_logprobs=[] if request.return_logprob else None))


class AbortRequest(BaseModel):
    """POST /abort_request: `rid` aborts every request whose id starts with it; `abort_all` aborts all."""

    rid: str = ""
    abort_all: bool = False


class ReleaseMemoryOccupationRequest(BaseModel):
    """POST /release_memory_occupation (SGLang's ReleaseMemoryOccupationReqInput); tags None releases everything."""

    model_config = ConfigDict(extra="ignore")

    tags: list[MemoryTag] | None = None


class ResumeMemoryOccupationRequest(BaseModel):
    """POST /resume_memory_occupation (SGLang's ResumeMemoryOccupationReqInput); tags None resumes everything."""

    model_config = ConfigDict(extra="ignore")

    tags: list[MemoryTag] | None = None


class BeginWeightUpdateRequest(BaseModel):
    """POST /begin_weight_update (SGLang's BeginWeightUpdateReqInput): opens the session that update_weights_from_tensor
    and _from_distributed need (SGLang 0.5.23 answers success:false to them outside one); one session covers every
    bucket of one update."""

    model_config = ConfigDict(extra="ignore")

    selector: WeightSelector = "all"


class EndWeightUpdateRequest(BaseModel):
    """POST /end_weight_update (SGLang's EndWeightUpdateReqInput, no fields of its own): closes the session, also after
    a failed update."""

    model_config = ConfigDict(extra="ignore")


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str
    load_format: str | None = None
    weight_version: WeightVersion = None
    abort_all_requests: bool = False
    flush_cache: bool = True  # false while requests paused in_place keep their KV cache


class UpdateWeightsResponse(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = 0


class LoadEntry(BaseModel):
    """One data-parallel rank of /v1/loads (the core fields SGLang reports)."""

    model_config = ConfigDict(extra="allow")

    dp_rank: int = 0
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    utilization: float = 0.0


class LoadsResponse(BaseModel):
    """GET /v1/loads: {timestamp, version, dp_rank_count, loads: [...], aggregate: {...}}."""

    model_config = ConfigDict(extra="allow")

    timestamp: str | None = None
    version: str | None = None
    dp_rank_count: int = 1
    loads: list[LoadEntry]
    aggregate: dict[str, Any] = Field(default_factory=dict)

    @property
    def running(self) -> int:
        return sum(entry.num_running_reqs for entry in self.loads)

    @property
    def waiting(self) -> int:
        return sum(entry.num_waiting_reqs for entry in self.loads)

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0


class ModelInfo(BaseModel):
    """GET /model_info (SGLang also serves it as /get_model_info)."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: dict | None = None
    weight_version: WeightVersion = None


class WeightVersionInfo(BaseModel):
    """GET /get_weight_version."""

    weight_version: WeightVersion = None


# ---- the weight-update group (SGLang's InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput, ...)
DEFAULT_GROUP_NAME = "weight_update_group"


class InitWeightsUpdateGroupRequest(BaseModel):
    """POST /init_weights_update_group: join the trainer's broadcast group as rank rank_offset (+ TP rank)."""

    model_config = ConfigDict(extra="ignore")

    master_address: str
    master_port: int
    rank_offset: int = Field(..., ge=1, description="Rank 0 is the trainer.")
    world_size: int = Field(..., ge=2)
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"

    @model_validator(mode="after")
    def _inside_the_group(self) -> "InitWeightsUpdateGroupRequest":
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset must be in (0, world_size={self.world_size}): rank 0 is the trainer; got "
                             f"{self.rank_offset}")
        return self


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    group_name: str = DEFAULT_GROUP_NAME


class UpdateWeightsFromDistributedRequest(BaseModel):
    """POST /update_weights_from_distributed: receive names/dtypes/shapes by broadcast(src=0), in order, and load."""

    model_config = ConfigDict(extra="ignore")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = None
    load_format: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> "UpdateWeightsFromDistributedRequest":
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names ({len(self.names)}), dtypes ({len(self.dtypes)}) and shapes ({len(self.shapes)}) "
                             "must have one entry per tensor")
        if self.load_format not in (None, "direct"):
            raise ValueError(f"load_format {self.load_format!r} is not supported by this engine: send null")
        return self


class TensorUpdateFields(BaseModel):
    """POST /update_weights_from_tensor's fields besides the tensors: the query parameters of the torch engine's binary
    body (rollout/sglang/tensor_wire.py)."""

    model_config = ConfigDict(extra="ignore")

    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = None
    selector: WeightSelector = "all"

    @field_validator("load_format")
    @classmethod
    def _format(cls, v: str | None) -> str | None:
        if v not in (None, "direct"):
            raise ValueError(f"load_format {v!r} is not supported by this engine: send null")
        return v

    def query(self) -> dict[str, str]:
        """These fields as the query of the torch engine's binary body: text, booleans as JSON writes them; a field
        without a value is left out (the engine takes its default)."""
        return {name: str(value).lower() if isinstance(value, bool) else str(value)
                for name, value in self.model_dump(exclude_none=True).items()}


class UpdateWeightsFromTensorRequest(TensorUpdateFields):
    """POST /update_weights_from_tensor as JSON (SGLang's shape): serialized_named_tensors holds one entry per TP rank
    (this engine has one: it reads entry 0), each base64 text (see rollout/sglang/tensor_wire.py for this engine's
    encoding)."""

    serialized_named_tensors: list[str] = Field(..., min_length=1)


class GetWeightsByNameRequest(BaseModel):
    """GET|POST /get_weights_by_name -> the parameter's first truncate_size rows as a (nested) list of floats."""

    model_config = ConfigDict(extra="ignore")

    name: str
    truncate_size: int = Field(100, ge=1)


class PauseGenerationRequest(BaseModel):
    """POST /pause_generation (SGLang's PauseGenerationReqInput). abort: every request returns with its partial
    output; retract: running requests wait again and free their KV cache (recomputed on continue); in_place: they
    keep it, so cache flushes (and updates with flush_cache=true) fail until they finish."""

    model_config = ConfigDict(extra="ignore")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(BaseModel):
    """POST /continue_generation (SGLang's ContinueGenerationReqInput)."""

    model_config = ConfigDict(extra="ignore")

    torch_empty_cache: bool = True
