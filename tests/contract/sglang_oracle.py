"""SGLang 0.5.23's own checks of a request body or a launch command line, run in one subprocess per test session.

The subprocess imports SGLang (tests/contract/sglang_env.py) and answers one JSON line per JSON line on its stdin;
the pytest process never imports SGLang (it patches transformers and resets the root logger). Bodies cross as JSON,
as they would over HTTP: a numpy integer or a tuple in a body fails here as it would fail on the wire.

Checks, each what SGLang 0.5.23's server does with the same input:
- generate(body, vocab_size, context_len): POST /generate. FastAPI's parse of the body into GenerateReqInput
  (pydantic.TypeAdapter), the route's JSON schema gate (api_contract.generate_contract_error: unknown
  sampling_params keys and wrong types -> HTTP 400), GenerateReqInput.normalize_batch_and_arguments(), then per
  request what TokenizerManager does: SamplingParams(**sampling_params), .normalize(tokenizer), .verify(vocab_size), and
  the context-length rule of TokenizerManager._validate_one_request (restated: prompt < context_len, prompt +
  max_new_tokens <= context_len).
- route(cls, body): a JSON route whose handler takes `Annotated[io_struct.<cls>, Body()]`: TypeAdapter(cls).
  validate_python(body), and the body keys SGLang drops (unknown top-level keys are ignored, not refused).
- server_args(argv): `sglang.launch_server` argv (after the module): prepare_server_args(argv) (argparse with
  SGLang's flags, ServerArgs.from_cli_args), then ServerArgs.resolve_once() on the same flags with
  `--model-path dummy`: the model-independent resolution and validation. Skipped without a GPU and a model: the
  model-config and device steps of the pipeline (memory fraction, CUDA graphs, attention backend for the GPU).
- weight_versions(events, current, num_output_tokens): a finished answer's meta_info weight_version(s) from a
  request's weight-version events ([old version, output tokens then]) as the scheduler and the tokenizer manager
  make them (sglang/srt/utils/weight_versions.py: compute_weight_version_spans, add_weight_versions_to_meta_info).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 420.0  # the import takes ~12 CPU-s: 15 s alone, 90 s seen on two cores at load 12


class SGLangUnavailable(RuntimeError):
    """The oracle could not import SGLang (not installed, wrong version)."""


# ---- the pytest side ----------------------------------------------------------------------------------------
class SGLangOracle:
    """A client of the oracle subprocess. Each call returns {"ok": bool, "error": str?, ...}."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, text=True, cwd=HERE)
        self._lock = threading.Lock()
        hello = self._read(START_TIMEOUT_S)
        if not hello.get("ok"):
            self.close()
            raise SGLangUnavailable(hello.get("error", "the oracle did not start"))
        self.version = hello["version"]

    def _read(self, timeout_s: float) -> dict:
        timer = threading.Timer(timeout_s, self.proc.kill)
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            tail = self.log_path.read_text()[-3000:]
            raise SGLangUnavailable(f"the SGLang oracle exited (code {self.proc.poll()}); its log ends:\n{tail}")
        return json.loads(line)

    def _call(self, op: str, **kwargs: Any) -> dict:
        with self._lock:
            self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")  # strict JSON, as httpx sends
            self.proc.stdin.flush()
            return self._read(120.0)

    def generate(self, body: dict, vocab_size: int, context_len: int) -> dict:
        return self._call("generate", body=body, vocab_size=vocab_size, context_len=context_len)

    def route(self, cls: str, body: dict) -> dict:
        return self._call("route", cls=cls, body=body)

    def weight_versions(self, events: list[list], current: str, num_output_tokens: int) -> dict:
        return self._call("weight_versions", events=events, current=current, num_output_tokens=num_output_tokens)

    def server_args(self, argv: list[str], resolve: bool = True) -> dict:
        return self._call("server_args", argv=list(argv), resolve=resolve)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---- the subprocess side ------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """JSON-able copy of a parsed request (msgspec Struct, dataclass, enums)."""
    import dataclasses

    import msgspec

    if isinstance(value, msgspec.Struct):
        return {k: _plain(v) for k, v in msgspec.structs.asdict(value).items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _field_names(obj: Any) -> set[str]:
    import dataclasses

    import msgspec

    if isinstance(obj, msgspec.Struct):
        return set(obj.__struct_fields__)
    return {f.name for f in dataclasses.fields(obj)}


class _BytesTokenizer:
    """What SamplingParams.normalize asks of the server's tokenizer: a stop string's token count (its bytes here, an
    upper bound), used only to size the detokenizer's stop window."""

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def _check_generate(sgl, body: dict, vocab_size: int, context_len: int) -> dict:
    from pydantic import TypeAdapter

    obj = TypeAdapter(sgl.io_struct.GenerateReqInput).validate_python(body)  # FastAPI's parse of the body
    gate = sgl.generate_contract_error(body)  # the route's schema gate (HTTP 400)
    if gate is not None:
        return {"ok": False, "stage": "api_contract.generate_contract_error", "error": gate}
    dropped = sorted(set(body) - _field_names(obj))
    obj.normalize_batch_and_arguments()
    singles = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
    sampling = []
    for single in singles:
        params = sgl.SamplingParams(**dict(single.sampling_params or {}))  # TokenizerManager._create_tokenized_object
        params.normalize(_BytesTokenizer())  # the server passes its tokenizer: None means skip_tokenizer_init
        params.verify(vocab_size)
        prompt = len(single.input_ids or [])
        if prompt >= context_len:
            raise ValueError(f"The input ({prompt} tokens) is longer than the model's context length "
                             f"({context_len} tokens).")
        if params.max_new_tokens is not None and prompt + params.max_new_tokens > context_len:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of {context_len} "
                             f"tokens ({prompt} input + {params.max_new_tokens} new)")
        sampling.append({k: _plain(getattr(params, k)) for k in (
            "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "stop_strs",
            "sampling_seed", "ignore_eos", "skip_special_tokens", "n")})
    return {"ok": True, "dropped": dropped, "rid": _plain(obj.rid), "return_logprob": _plain(obj.return_logprob),
            "sampling": sampling}


def _check_route(sgl, cls: str, body: dict) -> dict:
    from pydantic import TypeAdapter

    obj = TypeAdapter(getattr(sgl.io_struct, cls)).validate_python(body)
    return {"ok": True, "dropped": sorted(set(body) - _field_names(obj)), "parsed": _plain(obj)}


def _check_server_args(sgl, argv: list[str], resolve: bool) -> dict:
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = sgl.prepare_server_args(list(argv))
    except SystemExit:  # argparse: the last stderr line names the flag
        lines = [ln for ln in captured.getvalue().splitlines() if ln.strip()]
        return {"ok": False, "stage": "prepare_server_args", "error": lines[-1] if lines else "argparse refused"}
    fields = {name: _plain(getattr(args, name)) for name in args.__struct_fields__}
    if not resolve:
        return {"ok": True, "fields": fields}
    dummy = list(argv)
    for flag in ("--model-path", "--model"):
        if flag in dummy:
            dummy[dummy.index(flag) + 1] = "dummy"
    try:
        with contextlib.redirect_stderr(captured):
            sgl.prepare_server_args(dummy).resolve_once()
    except (Exception, SystemExit) as err:
        return {"ok": False, "stage": "ServerArgs.resolve_once", "error": f"{type(err).__name__}: {err}"}
    return {"ok": True, "fields": fields}


def _weight_versions(events: list[list], current: str, num_output_tokens: int) -> dict:
    from sglang.srt.utils import weight_versions as wv

    spans = wv.compute_weight_version_spans([wv.WeightVersionEvent(old_version=v, num_output_tokens=n)
                                             for v, n in events], current, num_output_tokens)
    meta: dict = {}
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens)
    return {"ok": True, "meta_info": meta}


def serve() -> None:
    """The subprocess: one JSON answer line per JSON request line; SGLang's own prints go to stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.path.insert(0, str(HERE))
    from sglang_env import import_sglang

    try:
        sgl = import_sglang()
    except ImportError as err:
        answers.write(json.dumps({"ok": False, "error": str(err)}) + "\n")
        return
    answers.write(json.dumps({"ok": True, "version": sgl.version}) + "\n")
    ops = {"generate": lambda r: _check_generate(sgl, r["body"], r["vocab_size"], r["context_len"]),
           "route": lambda r: _check_route(sgl, r["cls"], r["body"]),
           "server_args": lambda r: _check_server_args(sgl, r["argv"], r.get("resolve", True)),
           "weight_versions": lambda r: _weight_versions(r["events"], r["current"], r["num_output_tokens"])}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = ops[request["op"]](request)
        except Exception as err:  # SGLang's refusal: pydantic ValidationError, ValueError, TypeError, ...
            answer = {"ok": False, "stage": request["op"], "error": f"{type(err).__name__}: {err}"}
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    serve()
