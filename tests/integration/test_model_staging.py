"""model.path as an s3:// URL (issue 12) on the session's real S3 server (SeaweedFS): the HF folder is staged once
into model.cache_dir and sha256-checked (against the folder's sha256.json when it has one), a torn cached copy is
fetched again, a torn upload or a folder without config.json is refused with the file named; a training run
starts from the s3:// model, and `spillover export RUN_DIR --to DIR` writes an HF folder that transformers and the
torch engine load with the same logprobs and that stages from S3 against its own sha256.json.
(The 2-node case, every node staging its own copy, is in test_placement.py.)
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from spillover.infra.config.run_config import TinyModelConfig
from spillover.infra.storage.model_staging import SOURCE_DIGESTS, STAGED_MANIFEST, file_sha256, stage_model
from spillover.infra.storage.store import open_store

SMALL_SHAPE = TinyModelConfig(num_layers=2, hidden_size=64, intermediate_size=128)  # tests/small_run.py's model


def upload(folder: Path, url: str, storage) -> None:
    store = open_store(url, storage)
    for f in sorted(folder.iterdir()):
        store.put_bytes(f.name, f.read_bytes())


@pytest.fixture(scope="module")
def s3_model(s3_server, tmp_path_factory):
    from spillover.infra.models import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("s3-model") / "tiny", SMALL_SHAPE, 0, 512)
    url = s3_server.url("models/tiny")
    upload(folder, url, s3_server.storage_config())
    return url, s3_server.storage_config(), folder


def test_staged_once_checked_and_fetched_again_when_the_copy_is_torn(s3_model, tmp_path):
    url, storage, folder = s3_model
    path, digests, downloaded = stage_model(url, storage, str(tmp_path / "cache"))
    local = Path(path)
    assert downloaded and sorted(digests) == sorted(f.name for f in folder.iterdir())
    assert all((local / n).read_bytes() == (folder / n).read_bytes() for n in digests)
    assert json.loads((local / STAGED_MANIFEST).read_text()) == {"url": url, "files": digests}
    assert stage_model(url, storage, str(tmp_path / "cache")) == (path, digests, False)  # cached and verified
    weights = local / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7] + b"torn!!!")
    assert stage_model(url, storage, str(tmp_path / "cache")) == (path, digests, True)  # fetched again
    assert weights.read_bytes() == (folder / "model.safetensors").read_bytes()
    other = {**digests, "config.json": "0" * 64}  # another node's copy must match the driver's digests
    with pytest.raises(ValueError, match="config.json: sha256 .* differs from the driver's copy"):
        stage_model(url, storage, str(tmp_path / "cache"), expected=other)
    assert stage_model(url, storage, str(tmp_path / "cache")) == (path, digests, False)  # the good copy stays


def test_a_torn_upload_or_a_folder_without_config_is_refused(s3_model, s3_server, tmp_path):
    url, storage, folder = s3_model
    torn = s3_server.url("models/torn")
    upload(folder, torn, storage)
    digests = {f.name: file_sha256(f) for f in folder.iterdir()}
    store = open_store(torn, storage)
    store.put_bytes(SOURCE_DIGESTS, json.dumps({**digests, "model.safetensors": "ab" * 32}).encode())
    with pytest.raises(ValueError, match="model.safetensors: sha256 .* differs from .*sha256.json"):
        stage_model(torn, storage, str(tmp_path / "cache"))
    store.put_bytes(SOURCE_DIGESTS, json.dumps({**digests, "extra.bin": "ab" * 32}).encode())
    with pytest.raises(ValueError, match="extra.bin"):
        stage_model(torn, storage, str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        stage_model(s3_server.url("models/nothing-here"), storage, str(tmp_path / "cache"))
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # nothing half-staged left behind


@pytest.mark.slow  # ~10 s: one iteration on the session's warm parts, an engine on the export
def test_a_run_trains_from_an_s3_model_and_its_export_loads_everywhere(prefect_harness, ray_session, warm_parts,
                                                                     s3_model, s3_server, tmp_path, monkeypatch):
    from spillover.flows.cli import main
    from spillover.flows.train import grpo_train
    from spillover.bench.reference_lm import load_causal_lm
    from spillover.rollout.fleet.engine_client import EngineClient
    from spillover.rollout.sglang.protocol import GenerateRequest
    from spillover.rollout.torch_engine.server import TorchEngineServer
    from test_train_flow import small_config

    url, storage, _ = s3_model
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", storage.access_key_id.get_secret_value())
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", storage.secret_access_key.get_secret_value())
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    cfg = small_config(run_dir, iterations=1, **{"model.path": url, "model.cache_dir": str(cache),
                                                "storage.endpoint_url": storage.endpoint_url})
    assert grpo_train(cfg, parts=warm_parts)["iterations"] == 1
    staged = [p for p in cache.iterdir() if p.is_dir()]
    assert len(staged) == 1 and (staged[0] / STAGED_MANIFEST).is_file() and not (run_dir / "tiny_model").exists()

    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--to", str(out)]) == 0
    assert {"config.json", "tokenizer.json", "model.safetensors", SOURCE_DIGESTS} <= {p.name for p in out.iterdir()}
    digests = json.loads((out / SOURCE_DIGESTS).read_text())
    assert digests == {p.name: file_sha256(p) for p in out.iterdir() if p.name != SOURCE_DIGESTS}
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}  # the umask decides, not safetensors' 0600
    assert modes["model.safetensors"] == modes[SOURCE_DIGESTS] == 0o666 & ~current_umask(), modes

    prompt = [5, 6, 7, 8]
    engine = TorchEngineServer(str(out), port=0, max_running_requests=4, seed=0)
    engine.start()
    try:
        async def greedy():
            async with EngineClient(engine.url) as client:
                params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
                return await client.generate(GenerateRequest(input_ids=prompt, sampling_params=params,
                                                             return_logprob=True))
        res = asyncio.run(greedy())
    finally:
        engine.stop()
    hf = load_causal_lm(out).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + res.output_ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]
    got = torch.tensor([lp[0] for lp in res.meta_info.output_token_logprobs])
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)

    exported = s3_server.url("models/exported")
    upload(out, exported, storage)  # the export stages from S3 against its own sha256.json
    path, staged_digests, _ = stage_model(exported, storage, str(cache))
    assert staged_digests == digests and (Path(path) / "model.safetensors").read_bytes() == \
        (out / "model.safetensors").read_bytes()


def current_umask() -> int:
    """This process's umask, read without changing it (Linux: /proc/self/status)."""
    for line in open("/proc/self/status"):
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise RuntimeError("no Umask line in /proc/self/status")
