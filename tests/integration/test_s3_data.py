"""Data files on S3 (`data.prompts_path`, `data.eval_paths`, `spillover eval --data` as s3://BUCKET/KEY, issue 40) on the
session's real S3 server (SeaweedFS): read through s3fs with the run's storage settings (the endpoint from the config,
credentials from the environment), copied once into data.cache_dir under the object's ETag, fetched again only when the
object changed, and named by their s3:// path and line in every message. `spillover check` names a missing object, wrong
credentials and an unreachable server in one line each; a training run reads its prompts and eval set from S3."""
from __future__ import annotations

import json
import logging
import secrets
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from encoded_rows import jsonl, parquet
from small_run import SMALL_RUN
from test_check_cli import refused_once, spillover

ROWS = [{"prompt": f"a*{n}=", "label": n} for n in range(1, 9)]
CHECK = ["check", "--config", "configs/tiny.yaml", *SMALL_RUN]


@pytest.fixture
def s3_data(s3_server):
    """A fresh prefix of the session's bucket holding a JSON Lines and a Parquet prompt file and one with a bad line:
    (store, s3:// URL of the prefix)."""
    from spillover.infra.storage.store import open_store

    url = s3_server.url(f"data-{uuid.uuid4().hex[:8]}")
    store = open_store(url, s3_server.storage_config())
    store.put_bytes("train.jsonl", jsonl(ROWS))
    store.put_bytes("eval/test.parquet", parquet(ROWS[:3]))
    store.put_bytes("bad.jsonl", jsonl(ROWS[:1]) + b'{"prompt": "a*2=", "label": 2\n')
    return store, url


def credentials(s3_server) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}


def test_an_s3_file_is_copied_once_per_version_and_named_by_its_path(s3_server, s3_data, tmp_path, caplog):
    from spillover.flows.eval import eval_data_sets
    from spillover.infra.config.run_config import build_config
    from spillover.infra.data_files import DataFileError, data_file
    from spillover.infra.models import build_char_tokenizer
    from spillover.rollout.prompt_data import PromptFileError, read_prompts

    caplog.set_level(logging.DEBUG)  # botocore's and s3fs's debug logs included: no secret in any of them
    store, url = s3_data
    storage = s3_server.storage_config()
    cfg = build_config({"data": {"cache_dir": str(tmp_path / "cache")},
                        "storage": {"endpoint_url": storage.endpoint_url}})
    cfg = cfg.model_copy(update={"storage": storage})  # the keys as the config gives them (tests below: from the env)
    train = data_file(f"{url}/train.jsonl", "data.prompts_path", cfg)
    assert str(train) == train.pinned == f"{url}/train.jsonl" and train.local.read_bytes() == jsonl(ROWS)
    etag = store.info("train.jsonl")["ETag"].strip('"')
    assert train.local.relative_to(tmp_path / "cache").parts[1:] == (etag, "train.jsonl")
    assert read_prompts(train, build_char_tokenizer(), 16).labels == list(range(1, 9))
    parquet_copy = data_file(f"{url}/eval/test.parquet", "data.eval_paths.test", cfg)
    assert read_prompts(parquet_copy, build_char_tokenizer(), 16).labels == [1, 2, 3]
    assert eval_data_sets(cfg, f"{url}/eval/test.parquet", None) == {"test": parquet_copy}  # `spillover eval --data`
    with pytest.raises(PromptFileError, match=rf"^{url}/bad.jsonl:2: not valid JSON"):
        read_prompts(data_file(f"{url}/bad.jsonl", "data.prompts_path", cfg), build_char_tokenizer(), 16)

    inode = train.local.stat().st_ino
    assert data_file(f"{url}/train.jsonl", "data.prompts_path", cfg, recheck=True).local.stat().st_ino == inode
    store.put_bytes("train.jsonl", jsonl(ROWS[:2]))  # a new version: a new copy beside the old one
    changed = data_file(f"{url}/train.jsonl", "data.prompts_path", cfg, recheck=True)
    assert changed.local != train.local and changed.local.read_bytes() == jsonl(ROWS[:2])
    assert train.local.read_bytes() == jsonl(ROWS)

    store.delete("train.jsonl")  # what this process fetched, it reads without asking S3 again; a recheck asks
    assert data_file(f"{url}/train.jsonl", "data.eval_paths.x", cfg) == changed
    with pytest.raises(DataFileError) as err:
        data_file(f"{url}/train.jsonl", "data.eval_paths.x", cfg, recheck=True)
    assert str(err.value) == (f"data.eval_paths.x='{url}/train.jsonl': the S3 server at {storage.endpoint_url} has no "
                              f"object '{url.split('/', 3)[3]}/train.jsonl' in bucket '{s3_server.bucket}': upload the "
                              "file there or correct data.eval_paths.x")
    assert s3_server.secret_key not in caplog.text and not list((tmp_path / "cache").rglob("*.part"))


def test_check_names_a_bad_line_a_missing_object_wrong_keys_and_an_unreachable_server_in_one_line_each(
        s3_server, s3_data, tmp_path):
    """One check reads good JSON Lines and Parquet files from S3 and names a bad line (by its s3:// path) and a missing
    object; wrong credentials and a server that is not there are one line each, with the fix and no secret."""
    _, url = s3_data
    key = url.split("/", 3)[3]
    data = [f"storage.endpoint_url={s3_server.endpoint_url}", f"data.prompts_path={url}/train.jsonl",
            f"data.cache_dir={tmp_path / 'cache'}"]
    evals = json.dumps({"parquet": f"{url}/eval/test.parquet", "bad": f"{url}/bad.jsonl",
                        "missing": f"{url}/absent.jsonl"})
    wrong = secrets.token_urlsafe(24)
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with ThreadPoolExecutor(3) as pool:
        bad_keys = pool.submit(spillover, *CHECK, f"run_dir={tmp_path / 'k'}", *data,
                               **{**credentials(s3_server), "AWS_SECRET_ACCESS_KEY": wrong})
        down = pool.submit(spillover, *CHECK, f"run_dir={tmp_path / 'd'}", *data, f"storage.endpoint_url={nowhere}",
                           **credentials(s3_server))
        code, out, err, _ = spillover(*CHECK, f"run_dir={tmp_path / 'a'}", *data, f"data.eval_paths={evals}",
                                      **credentials(s3_server))
        assert code == 2, err[-3000:]
        assert "Traceback" not in err and s3_server.secret_key not in out + err, err[-3000:]
        assert [line for line in err.splitlines() if line.startswith("spillover: ")] == [
            f"spillover: {url}/bad.jsonl:2: not valid JSON (Expecting ',' delimiter); expected one JSON object with "
            "'prompt' and 'label' per line: fix or remove that line",
            f"spillover: data.eval_paths.missing='{url}/absent.jsonl': the S3 server at {s3_server.endpoint_url} has "
            f"no object '{key}/absent.jsonl' in bucket '{s3_server.bucket}': upload the file there or correct "
            "data.eval_paths.missing"], err[-3000:]
        code, out, err, _ = bad_keys.result()
        line = refused_once(code, err)
        assert line.startswith(f"spillover: data.prompts_path='{url}/train.jsonl': check {url}/train.jsonl was "
                               "refused: "), line
        assert line.endswith(f"Fix: give credentials that the S3 server at {s3_server.endpoint_url} accepts for bucket "
                             f"'{s3_server.bucket}': storage.access_key_id and storage.secret_access_key, or "
                             "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"), line
        assert wrong not in out + err and s3_server.secret_key not in out + err
        code, _, err, _ = down.result()
        line = refused_once(code, err)
        assert line.startswith(f"spillover: data.prompts_path='{url}/train.jsonl': check {url}/train.jsonl kept "
                               "failing for "), line
        assert line.endswith(f"Fix: start the S3 server at {nowhere}, or set storage.endpoint_url (or "
                             "AWS_ENDPOINT_URL_S3) to a reachable one"), line


def test_a_run_trains_on_s3_prompts_and_evaluates_an_s3_eval_set(prefect_harness, ray_session, warm_parts, s3_server,
                                                                 s3_data, tmp_path, monkeypatch):
    """The endpoint from the config, the keys from the environment; the run's config keeps the s3:// names."""
    from spillover.flows.train import grpo_train
    from test_train_flow import small_config

    store, url = s3_data
    for name, value in credentials(s3_server).items():
        monkeypatch.setenv(name, value)
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    cfg = small_config(run_dir, iterations=1, **{"storage.endpoint_url": s3_server.endpoint_url,
                                                "data.prompts_path": f"{url}/train.jsonl",
                                                "data.eval_paths": json.dumps({"s3": f"{url}/eval/test.parquet"}),
                                                "data.cache_dir": str(cache), "schedule.eval_interval": 1})
    assert grpo_train(cfg, parts=warm_parts)["iterations"] == 1
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= row["eval/s3"] <= 1.0
    recorded = json.loads((run_dir / "config.json").read_text())["data"]
    assert (recorded["prompts_path"], recorded["eval_paths"]) == (f"{url}/train.jsonl", {"s3": f"{url}/eval/test.parquet"})
    copies = sorted(p.relative_to(cache).parts[1:] for p in cache.rglob("*") if p.is_file())
    assert copies == sorted((store.info(k)["ETag"].strip('"'), k.rsplit("/", 1)[-1])
                            for k in ("eval/test.parquet", "train.jsonl"))  # one copy each: fetched once
    assert s3_server.secret_key not in (run_dir / "config.json").read_text()
